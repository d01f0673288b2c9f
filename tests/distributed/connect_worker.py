"""One process of the connect test: two pipelines built one after the
other, the first only to read its plan (dropped at once, its transfer
server with it), with process 0's pulls in ``Transport.connect`` late.

Process 1 sends connect's last link's value to process 0. Had its
connect returned before process 0 pulled that value, process 1 would
drop the first pipeline and wait in the second's address exchange,
while process 0 pulled from a server that no longer exists: both wait
forever (the hang CI once met by chance). Prints "done P".
"""

import gc
import os
import time

from jpipe import distributed

distributed.initialize()

import jax  # noqa: E402
import optax  # noqa: E402

import jpipe  # noqa: E402
from jpipe.runtime.build import transport  # noqa: E402
from tests.partition import flax_models  # noqa: E402

PULL_DELAY_S = float(os.environ.get("PULL_DELAY_S", "2"))


def _late_pulls():
  """This process's receiving ends of connect's links wait first."""
  pair = transport.Transport._pair

  def late(self, x, a, b, aval, key=None):
    if x is None:  # (The receiving end.)
      time.sleep(PULL_DELAY_S)
    return pair(self, x, a, b, aval, key)

  transport.Transport._pair = late


def main():
  me = jax.process_index()
  if me == 0:
    _late_pulls()
  loss_fn, params, batch, _ = flax_models.CASES["mlp"]()

  def build():
    return jpipe.Pipeline(
      loss_fn,
      params,
      batch,
      num_stages=2,
      schedule="1f1b",
      num_microbatches=2,
      optimizer=optax.sgd(0.1),
    )

  stages = build().plan.stage_devices  # (Dropped at once.)
  gc.collect()
  pipe = build()
  state, _ = pipe.step(pipe.init(params), batch)
  assert len(stages) == 2 and state.step == 1
  print(f"done {me}", flush=True)


if __name__ == "__main__":
  main()
