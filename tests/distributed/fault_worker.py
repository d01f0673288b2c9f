"""One process of a fault test: a 2-stage streaming pipeline that keeps
stepping (``STEPS`` steps, default: until stopped).

  FAULT=raise:P:K   process P raises at step K
  FAULT=hang:P:K    process P stops making progress at step K (alive:
                    the heartbeat goes on; its peer waits in a transfer)

Prints "ready <process> <pid>" after its first step.
"""

import os
import threading

from jpipe import distributed

distributed.initialize()

import sys  # noqa: E402

import jax  # noqa: E402
import optax  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "partition"))
import flax_models  # noqa: E402

import jpipe  # noqa: E402


class _Injected(RuntimeError):
  pass


def main():
  fault = os.environ.get("FAULT", "")
  steps = int(os.environ.get("STEPS", "1000000"))
  loss_fn, params, batch, _ = flax_models.mlp_case()
  pipe = jpipe.Pipeline(
    loss_fn,
    params,
    batch,
    num_stages=2,
    schedule="async",
    weight_stashing=True,
    num_microbatches=4,
    optimizer=optax.sgd(0.01),
  )
  state = pipe.init(params)
  me = jax.process_index()
  for step in range(steps):
    if fault == f"raise:{me}:{step}":
      raise _Injected(f"injected failure in process {me} at step {step}")
    if fault == f"hang:{me}:{step}":
      print(f"hanging {me}", flush=True)
      threading.Event().wait()
    state, metrics = pipe.step(state, batch)
    loss = float(metrics["loss"])
    if step == 0:
      print(f"ready {me} {os.getpid()}", flush=True)
  print(f"done {me} loss {loss:.4f}", flush=True)


if __name__ == "__main__":
  main()
