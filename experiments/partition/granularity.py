r"""Automatic granularity on jpipe's training configs.

For each config in ``configs/`` (its model on one microbatch of its data,
as ``python -m jpipe.train`` traces it): the trace time, then per stage
count n and per module-path depth, the nodes and the balance of the best
n-stage split by analytic FLOPs (slowest stage over an even share, 1.00 is
perfect), the depth ``choose_depth`` picks and what it costs to choose.
Writes results/granularity.{md,json}.

Usage: python -m experiments.partition.granularity
"""

import json
import os
import time

import jax
import numpy as np
from absl import app, flags

from jpipe import partition
from jpipe.train import config_plan, tasks

FLAGS = flags.FLAGS
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(__file__)))
flags.DEFINE_string(
  "out_dir",
  os.path.join(os.path.dirname(__file__), "results"),
  "Output folder.",
)
flags.DEFINE_list("stages", ["2", "4", "8"], "Stage counts n.")
CONFIGS = ("default", "wrn_stale", "pipedream_vgg", "pipedream_resnet")
CONFIGS += ("gpt_lm", "t5")


def _traced(name):
  config = config_plan.load_config_file(
    os.path.join(ROOT, "configs", f"{name}.py")
  )
  task = tasks.build_task(config)
  m = config.pipeline.num_microbatches
  micro = jax.tree.map(lambda x: x[: len(x) // m], task.batch_at(0))
  loss_fn = task.loss_fn
  if task.model_state is not None:
    loss_fn, micro = partition.with_model_state(
      task.loss_fn, micro, task.model_state
    )
  start = time.perf_counter()
  traced = partition.trace(
    loss_fn, task.params, micro, has_aux=task.model_state is not None
  )
  return traced, time.perf_counter() - start


def main(argv):
  del argv
  rows = []
  for name in CONFIGS:
    traced, trace_seconds = _traced(name)
    for n in map(int, FLAGS.stages):
      start = time.perf_counter()
      try:
        cut, chosen = partition.choose_depth(traced, n)
      except ValueError:
        continue  # Fewer nodes than n at every depth.
      choose_seconds = time.perf_counter() - start
      best = min(chosen.balance.values())
      rows.append(
        {
          "config": name,
          "stages": n,
          "equations": len(traced.jaxpr.eqns),
          "trace_seconds": trace_seconds,
          "choose_seconds": choose_seconds,
          "depth": chosen.depth,
          "nodes": cut.num_nodes,
          "balance": chosen.balance[chosen.depth],
          "best_fixed_depth_balance": best,
          "depth_1_balance": _finite(chosen.balance[1]),
          "nodes_per_depth": {
            d: traced.at_depth(d).num_nodes for d in chosen.balance
          },
        }
      )
  lines = [
    "| config | n | eqns | trace s | choose s | depth (nodes) | balance | "
    "best depth's | depth 1's |",
    "|---|---|---|---|---|---|---|---|---|",
  ]
  for r in rows:
    lines.append(
      f"| {r['config']} | {r['stages']} | {r['equations']} | "
      f"{r['trace_seconds']:.2f} | {r['choose_seconds']:.3f} | "
      f"{r['depth']} ({r['nodes']}) | {r['balance']:.2f} | "
      f"{r['best_fixed_depth_balance']:.2f} | "
      f"{_fmt(r['depth_1_balance'])} |"
    )
  table = "\n".join(lines)
  print(table)
  os.makedirs(FLAGS.out_dir, exist_ok=True)
  with open(os.path.join(FLAGS.out_dir, "granularity.md"), "w") as f:
    f.write(table + "\n")
  with open(os.path.join(FLAGS.out_dir, "granularity.json"), "w") as f:
    json.dump(rows, f, separators=(",", ":"))


def _finite(x):
  """None for inf (too few nodes): JSON has no infinity."""
  return float(x) if np.isfinite(x) else None


def _fmt(x):
  return "too few nodes" if x is None else f"{x:.2f}"


if __name__ == "__main__":
  app.run(main)
