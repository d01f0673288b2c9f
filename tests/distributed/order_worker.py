"""One process of the ordering test: process 1 sends a value to process
0 and goes straight into a device collective; process 0 asks for the
value only 0.3 s later, then joins the collective.

Without a quiet point in front of the collective this deadlocks (the
pull needs process 1's device, which waits in the collective for process
0): measured with ``multihost_utils.process_allgather``. Prints "done P"
after ``ROUNDS`` rounds.
"""

import os
import time

from jpipe import distributed

distributed.initialize()

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from jpipe.runtime import PullLinks  # noqa: E402


def main():
  links = PullLinks()
  me = jax.process_index()
  src = jax.local_devices(process_index=1)[-1]
  dst = jax.local_devices(process_index=0)[0]
  scalar = jax.ShapeDtypeStruct((), np.float32)
  for r in range(int(os.environ.get("ROUNDS", "5"))):
    if me == 1:
      x = jnp.mean(jax.device_put(np.full((256, 256), r, np.float32), src))
      links.transfer(x, src, dst, scalar)
    else:
      time.sleep(0.3)  # Process 1 is in the collective by now.
      y = links.transfer(None, src, dst, scalar)
      assert float(y) == r
    total = distributed.allgather(np.int32(r))
    assert np.asarray(total).tolist() == [r, r]
  print(f"done {me}", flush=True)


if __name__ == "__main__":
  main()
