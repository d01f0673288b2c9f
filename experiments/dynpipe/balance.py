r"""DynPipe's DP-stage load balancing: a replica of a data-parallel stage
slows down.

PipeDream's hybrid plan for the small VGG at 3e10 B/s (the CLI's
``configs/pipedream_vgg.py`` with ``pipeline.partition=pipedream_hybrid``):
slot 0 on devices 0-2 (a replica group), slot 1 on device 3; asynchronous
1F1B with weight stashing, 4 microbatches of 12 examples. Every forward + backward of the model spends a
simulated ``--bal_simulated_ms`` per microbatch, split among the stages by
their cost shares and, in a replica group, among its replicas by their
examples (sleeps: honest CPU timings); device 1 runs ``--bal_factor``
times slower from step ``--bal_from`` to ``--bal_to``. Runs, each
``--bal_steps`` steps of the training CLI's DynPipe mode:

- split: each microbatch split evenly (SPMD), jpipe's re-partitioning
  policy (it may move layers off the slowed slot);
- weighted_static: the weighted split, measured but never changed;
- weighted: the weighted split re-split by the replicas' measured speeds
  (DynPipe's B4) under jpipe's policy.

Reported: mean seconds per step before, during and after the slowdown
(from the measured windows), the re-splits and re-partitions, and the
final accuracy. In one process one host thread sleeps for every stage,
so all the runs' step times include every stage's sleeps in turn: compare
runs, not against a real multi-device pipeline.

  python -m experiments.dynpipe.balance [--bal_steps 60]

Prints a table; writes results/balance.{json,md}.
"""

import json
import os
import tempfile

import numpy as np
from absl import app, flags

from experiments.gpu_campaign import _common

FLAGS = flags.FLAGS


def define_flags() -> None:
  """The command line's flags: defined when run as a script only, so a
  test imports this module's functions without defining them."""
  flags.DEFINE_integer("bal_steps", 60, "Steps per run.")
  flags.DEFINE_integer("bal_window", 4, "Steps per measurement window.")
  flags.DEFINE_float("bal_simulated_ms", 60.0, "Simulated ms per model F+B.")
  flags.DEFINE_float("bal_factor", 4.0, "Slowdown factor of device 1.")
  flags.DEFINE_integer("bal_from", 16, "First slowed step.")
  flags.DEFINE_integer("bal_to", 44, "First step after the slowdown.")
  flags.DEFINE_list(
    "bal_runs", ["split", "weighted_static", "weighted"], "Runs."
  )
  flags.DEFINE_string(
    "bal_out_dir",
    os.path.join(os.path.dirname(__file__), "results"),
    "Where balance.{json,md} go.",
  )


RUNS = {
  "split": {"routing": "split", "policy": "jpipe"},
  "weighted_static": {"routing": "weighted", "policy": "static"},
  "weighted": {"routing": "weighted", "policy": "jpipe"},
}


def config_for(run, steps, window, simulated_ms, inject):
  """The training config of one run."""
  from jpipe.train import config_plan

  root = os.path.dirname(os.path.dirname(os.path.dirname(__file__)))
  config = config_plan.load_config_file(
    os.path.join(root, "configs", "pipedream_vgg.py")
  )
  config.pipeline.partition = "pipedream_hybrid"
  config.pipeline.bandwidth = 3e10
  # Microbatches of 12: the split (SPMD) run needs a multiple of 3.
  config.data.batch_size = 48
  config.pipeline.replica_routing = RUNS[run]["routing"]
  config.dynamic.enabled = True
  config.dynamic.policy = RUNS[run]["policy"]
  config.dynamic.window = window
  config.dynamic.horizon_steps = steps
  config.dynamic.simulated_ms = simulated_ms
  config.dynamic.inject = inject
  config.train.steps = steps
  config.train.eval_every = steps
  config.train.checkpoint_every = steps
  return config


def phase_seconds(windows, start, end) -> float:
  """Mean measured step seconds of the windows (``{step: seconds}``)
  ending in (start, end]."""
  picked = [t for step, t in windows.items() if start < step <= end]
  return float(np.mean(picked)) if picked else float("nan")


def run_one(run):
  """Trains one run with the CLI; returns its record (windows and events
  read back from its ``metrics.jsonl``)."""
  from jpipe.train import train_lib

  inject = f"1:{FLAGS.bal_factor}:{FLAGS.bal_from}:{FLAGS.bal_to}"
  config = config_for(
    run, FLAGS.bal_steps, FLAGS.bal_window, FLAGS.bal_simulated_ms, inject
  )
  with tempfile.TemporaryDirectory() as workdir:
    summary = train_lib.train_and_evaluate(config, workdir)
    with open(os.path.join(workdir, "metrics.jsonl")) as f:
      lines = [json.loads(line) for line in f]
  windows = {
    r["step"]: r["dynamic/step_seconds"]
    for r in lines
    if "dynamic/step_seconds" in r
  }
  # A phase's first windows are left out: one straddling a change mixes
  # both, and the next compiles the new split's programs.
  w = FLAGS.bal_window
  return {
    "run": run,
    "before_s": phase_seconds(windows, w, FLAGS.bal_from),
    "during_s": phase_seconds(windows, FLAGS.bal_from + 2 * w, FLAGS.bal_to),
    "after_s": phase_seconds(windows, FLAGS.bal_to + 2 * w, FLAGS.bal_steps),
    "windows": windows,
    "rebalances": [
      {k: r[k] for k in ("step", "stage", "old", "new")}
      for r in summary["rebalances"]
    ],
    "repartitions": [
      {k: r[k] for k in ("step", "old", "new")} for r in summary["repartitions"]
    ],
    "accuracy": summary["eval"]["accuracy"],
    # The training loss logged last (a mean over the steps since the
    # previous log line).
    "final_loss": [r["train/loss"] for r in lines if "train/loss" in r][-1],
  }


def main(argv):
  del argv
  records = [run_one(run) for run in FLAGS.bal_runs]
  rows = [
    f"| {r['run']} | {r['before_s']:.3f} | {r['during_s']:.3f} | "
    f"{r['after_s']:.3f} | "
    + (
      "; ".join(
        f"{x['step']}: {x['old']} -> {x['new']}" for x in r["rebalances"]
      )
      or "-"
    )
    + " | "
    + (
      "; ".join(
        f"{x['step']}: {x['old']} -> {x['new']}" for x in r["repartitions"]
      )
      or "-"
    )
    + f" | {r['final_loss']:.3f} | {r['accuracy']:.3f} |"
    for r in records
  ]
  meta = _common.metadata()  # Date, device, JAX version, commit.
  header = (
    f"{meta['date']}, {meta['device']}, jax {meta['jax']}, "
    f"commit {meta['commit'][:7]}: pipedream_vgg 3-1 hybrid plan, async ws, "
    f"{FLAGS.bal_steps} steps, window {FLAGS.bal_window}, simulated "
    f"{FLAGS.bal_simulated_ms} ms, device 1 x{FLAGS.bal_factor} from step "
    f"{FLAGS.bal_from} to {FLAGS.bal_to}."
  )
  table = (
    "| run | s/step before | s/step during | s/step after | re-splits "
    "(step: old -> new) | re-partitions | last logged loss | accuracy |\n"
    "|---|---|---|---|---|---|---|---|\n" + "\n".join(rows)
  )
  text = f"{header}\n\n{table}\n"
  os.makedirs(FLAGS.bal_out_dir, exist_ok=True)
  with open(os.path.join(FLAGS.bal_out_dir, "balance.md"), "w") as f:
    f.write(text)
  with open(os.path.join(FLAGS.bal_out_dir, "balance.json"), "w") as f:
    json.dump({**meta, "header": header, "records": records}, f, indent=1)
  print(text)


if __name__ == "__main__":
  # Set here, not at import: a test importing this module must not change
  # the environment its later subprocesses inherit.
  from jpipe.train.host_devices import default_cpu_device_count

  default_cpu_device_count(8)
  define_flags()
  app.run(main)
