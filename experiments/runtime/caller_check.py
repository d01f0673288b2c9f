r"""The per-call look for a caller's arrays, in µs: what every public
``Pipeline`` call pays in a multi-process run or under a caller's
``jax.set_mesh`` (``runtime/build/user_mesh._plain`` over the call's
arguments: the pipeline, its state, a batch), with the state passed
through as one leaf (``own_type``, as the runtime does) and looked into
leaf by leaf (as before it), paired in one run, on a tiny GPT of p
stages (adamw: the state's leaves are the stages' params and moments).

Writes results/caller_check_<platform>.{md,json}.

Usage: python -m experiments.runtime.caller_check [--stages 2,4,8]
  [--repeats 2000]
"""

import argparse
import os
import time
from unittest import mock

import jax
import numpy as np
import optax

from experiments.gpu_campaign import _common
from experiments.gpu_campaign.overhead import one_device_pipeline
from jpipe.runtime.build import user_mesh


def _us_per_call(tree, repeats: int) -> float:
  """Median over 5 runs of ``repeats`` calls, µs per call."""
  runs = []
  for _ in range(5):
    start = time.perf_counter()
    for _ in range(repeats):
      user_mesh._plain(tree, None)
    runs.append((time.perf_counter() - start) / repeats * 1e6)
  return float(np.median(runs))


def measure(p: int, repeats: int, layers: int = 8) -> dict:
  """µs per call of ``step``'s arguments' check, the state skipped and
  looked into."""
  loss_fn, params, batch, _ = _common.language_model(
    layers=layers, width=8, heads=1, length=4, batch=16
  )
  pipe = one_device_pipeline(
    loss_fn,
    params,
    batch,
    p=p,
    schedule="1f1b",
    m=2,
    tx=optax.adamw(1e-3),
    recompute=True,
  )
  state = pipe.init(params)
  tree = ((pipe, state, batch), {})  # What ``step(state, batch)`` passes.
  skipped = _us_per_call(tree, repeats)
  with mock.patch.object(user_mesh, "_OWN_TYPES", ()):
    looked_into = _us_per_call(tree, repeats)
  return {
    "stages": p,
    "state_leaves": len(jax.tree.leaves(state)),
    "us_state_skipped": round(skipped, 1),
    "us_state_looked_into": round(looked_into, 1),
  }


def main(argv=None):
  parser = argparse.ArgumentParser(
    prog="python -m experiments.runtime.caller_check"
  )
  parser.add_argument("--stages", default="2,4,8", help="all on one device")
  parser.add_argument("--repeats", type=int, default=2000)
  parser.add_argument("--layers", type=int, default=8, help="GPT layers")
  parser.add_argument(
    "--out_dir", default=os.path.join(os.path.dirname(__file__), "results")
  )
  args = parser.parse_args(argv)
  rows = [
    measure(int(p), args.repeats, args.layers) for p in args.stages.split(",")
  ]
  table = (
    "| p | state leaves | µs / call, state skipped | µs / call, looked "
    "into |\n|---|---|---|---|\n"
  )
  for r in rows:
    print(r)
    table += (
      f"| {r['stages']} | {r['state_leaves']} | {r['us_state_skipped']} "
      f"| {r['us_state_looked_into']} |\n"
    )
  name = f"caller_check_{jax.devices()[0].platform}"
  _common.write_table(
    args.out_dir, name, table, {**_common.metadata(), "rows": rows}
  )


if __name__ == "__main__":
  main()
