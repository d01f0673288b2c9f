r"""The driver's host work per action, counted: Python function calls
(cProfile's count: within ~2 % from run to run, on any machine) and the
host's µs,
on a tiny GPT (compute ~ 0) with p stages on one device, asynchronous
1F1B with Adam -- the setting of ``experiments.runtime.packed_params``.

A change to the executor is compared by running this in both checkouts
(``git worktree add``), alternately: the call count barely moves, the
µs are a median of steps that a busy machine blurs (experiments/RESULTS.md,
"The executor in three parts").

Writes results/host_calls_<platform>.{md,json}.

Usage: python -m experiments.runtime.host_calls [--stages 8]
  [--microbatches 32] [--steps 15]
"""

import argparse
import cProfile
import os
import pstats
import time

import jax
import numpy as np
import optax

from experiments.gpu_campaign import _common
from experiments.gpu_campaign.overhead import one_device_pipeline


def measure(
  p: int, m: int, steps: int, profiled_steps: int, layers: int = 8
) -> dict:
  """Calls and host µs per action of ``steps`` steps (F, B and S of
  every microbatch on every stage: 3 p m actions a step)."""
  loss_fn, params, batch, _ = _common.language_model(
    layers=layers, width=8, heads=1, length=4, batch=64
  )
  pipe = one_device_pipeline(
    loss_fn,
    params,
    batch,
    p=p,
    schedule="async",
    m=m,
    tx=optax.adam(1e-3),
    recompute=False,
    fuse_step=True,
  )
  state = pipe.init(params)
  for _ in range(6):  # Compiles, then the stream's steady state.
    state, _ = pipe.step(state, batch)
  jax.block_until_ready(state.stage_params)
  profile = cProfile.Profile()
  profile.enable()
  for _ in range(profiled_steps):
    state, _ = pipe.step(state, batch)
  profile.disable()
  jax.block_until_ready(state.stage_params)
  actions = 3 * p * m
  seconds = []
  for _ in range(steps):
    start = time.perf_counter()
    state, _ = pipe.step(state, batch)
    seconds.append(time.perf_counter() - start)
  jax.block_until_ready(state.stage_params)
  calls = pstats.Stats(profile).total_calls / (profiled_steps * actions)
  return {
    "stages": p,
    "microbatches": m,
    "actions_per_step": actions,
    "python_calls_per_action": round(calls, 2),
    "host_us_per_action": round(float(np.median(seconds)) / actions * 1e6, 1),
  }


def main(argv=None):
  parser = argparse.ArgumentParser(
    prog="python -m experiments.runtime.host_calls"
  )
  parser.add_argument("--stages", type=int, default=8, help="all on one device")
  parser.add_argument("--microbatches", type=int, default=32)
  parser.add_argument("--steps", type=int, default=15, help="timed steps")
  parser.add_argument("--profiled_steps", type=int, default=5)
  parser.add_argument("--layers", type=int, default=8, help="GPT layers")
  parser.add_argument(
    "--out_dir", default=os.path.join(os.path.dirname(__file__), "results")
  )
  args = parser.parse_args(argv)
  row = measure(
    args.stages, args.microbatches, args.steps, args.profiled_steps, args.layers
  )
  print(row)
  table = (
    "| p | m | actions / step | Python calls / action | host µs / action |\n"
    "|---|---|---|---|---|\n"
    f"| {row['stages']} | {row['microbatches']} | {row['actions_per_step']} "
    f"| {row['python_calls_per_action']} | {row['host_us_per_action']} |\n"
  )
  name = f"host_calls_{jax.devices()[0].platform}"
  record = {**_common.metadata(), "rows": [row]}
  _common.write_table(args.out_dir, name, table, record)


if __name__ == "__main__":
  main()
