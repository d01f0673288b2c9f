r"""SD-Pipe's experiment shape on 8 CPU devices: 4 pipelines x 2 stages.

The MLP of ``configs/default.py`` on the embedded digits, each pipeline an
asynchronous 1F1B pipeline with weight stashing (as SD-Pipe), its stage
replicas synchronised by allreduce, preduce, adpsgd or hetpipe. Every
forward and backward spends a simulated compute time (``--sd_base_ms``, a
sleep) and, with probability 0.1, SD-Pipe's ``hetero`` delay on top: the
run is sleep-dominated, so its wall-clock times are honest on a CPU
(a real action of this MLP takes well under a millisecond).

Per policy and hetero: wall-clock seconds and optimizer steps (all
pipelines' last-stage steps) until the consensus model (the replicas'
mean, evaluated after every epoch) first reaches ``--sd_target`` test
accuracy; the final accuracy; the mean averaging-group size. Compilation
is done before the clock starts (stage programs by a warm-up call,
averaging programs by ``compile_groups``); evaluation is not timed.

  python -m experiments.sdpipe.time_to_accuracy [--sd_epochs 15]

Prints a table; writes results/time_to_accuracy.{json,md,png}.
"""

import datetime
import json
import os
import time

from jpipe.train.host_devices import default_cpu_device_count

default_cpu_device_count(8)

import jax  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from absl import app, flags  # noqa: E402

import jpipe  # noqa: E402
from configs import default  # noqa: E402
from jpipe import parallel  # noqa: E402
from jpipe.train import tasks  # noqa: E402

FLAGS = flags.FLAGS
flags.DEFINE_list("sd_sync", list(parallel.SYNC_POLICIES), "Policies.")
flags.DEFINE_list("sd_hetero", ["0", "0.05", "0.1"], "Hetero delays (s).")
flags.DEFINE_integer("sd_epochs", 15, "Epochs per run.")
flags.DEFINE_float("sd_learning_rate", 0.03, "SGD (momentum 0.9) rate.")
flags.DEFINE_integer("sd_steps_per_epoch", 24, "Steps per pipeline/epoch.")
flags.DEFINE_float("sd_base_ms", 4.0, "Simulated ms per forward/backward.")
flags.DEFINE_float("sd_target", 0.9, "Target test accuracy.")
flags.DEFINE_list("sd_seeds", ["0", "1", "2"], "Seeds of params and delays.")
flags.DEFINE_string(
  "sd_results_dir",
  os.path.join(os.path.dirname(__file__), "results"),
  "Where to write the tables.",
)

PIPELINES, STAGES, BATCH, MICROBATCHES = 4, 2, 32, 2


def _task(seed):
  config = default.get_config()
  config.data.batch_size = BATCH
  config.seed = seed
  return tasks.build_task(config)


def run(task, sync: str, hetero: float, seed: int) -> dict:
  """One training run; returns its per-epoch record."""
  tx = optax.sgd(FLAGS.sd_learning_rate, momentum=0.9)
  example = task.batch_at(0)
  build = jpipe.PipelineBuilder.of(
    task.loss_fn,
    task.params,
    example,
    num_stages=STAGES,
    schedule="async",
    weight_stashing=True,
    num_microbatches=MICROBATCHES,
    optimizer=tx,
  )
  dp = parallel.DataParallelPipelines(
    build,
    pipelines=PIPELINES,
    sync=sync,
    batches_per_epoch=FLAGS.sd_steps_per_epoch,
    hetero=parallel.Heterogeneity(
      hetero=hetero, base_seconds=FLAGS.sd_base_ms / 1000, seed=seed
    ),
  )
  # Compile everything before the clock: a throw-away call per pipeline.
  warm = dp.init(task.params)
  dp.compile_groups(warm)
  warm, _ = dp.step(warm, [example] * PIPELINES)
  dp.flush(warm)
  dp.reset_statistics()  # The warm-up's groups and delays do not count.

  states = dp.init(task.params)
  seconds, steps, epochs = 0.0, 0, []
  drawn = [0]

  def batch_at(p, i):
    # Disjoint shards: pipeline p takes every P-th batch of the stream.
    return task.batch_at(drawn[0] + i * PIPELINES + p)

  for epoch in range(FLAGS.sd_epochs):
    states, report = dp.run_epoch(states, batch_at)
    drawn[0] += PIPELINES * max(report.batches)
    seconds += report.seconds
    steps = sum(report.steps)
    accuracy = float(
      task.evaluate(dp.consensus_params(states), None)["accuracy"]
    )
    epochs.append(
      {
        "epoch": epoch + 1,
        "seconds": seconds,
        "steps": steps,
        "accuracy": accuracy,
        "batches": report.batches,
        "mean_group_size": report.mean_group_size,
      }
    )
    print(
      f"  {sync:9s} hetero={hetero:<5} seed {seed} epoch {epoch + 1:2d}: "
      f"{seconds:6.2f} s, {steps:4d} steps, acc {accuracy:.3f}, "
      f"batches {report.batches}, groups "
      f"{[round(g, 2) for g in report.mean_group_size]}",
      flush=True,
    )
  dp.close()
  return {"sync": sync, "hetero": hetero, "seed": seed, "epochs": epochs}


def _to_target(record, target):
  for e in record["epochs"]:
    if e["accuracy"] >= target:
      return e["seconds"], e["steps"]
  return None, None


def _groups(records):
  """Runs by (hetero, sync), in the order they ran."""
  out = {}
  for r in records:
    out.setdefault((r["hetero"], r["sync"]), []).append(r)
  return out


def _table(records, target) -> str:
  lines = [
    f"| hetero (s) | sync | runs at {target:.0%} | median s to {target:.0%} | "
    f"median steps to {target:.0%} | final acc (mean ± sd) | "
    "best acc (mean) | s per epoch | mean group size |",
    "|---|---|---|---|---|---|---|---|---|",
  ]
  for (hetero, sync), runs in _groups(records).items():
    reached = [_to_target(r, target) for r in runs]
    reached = [x for x in reached if x[0] is not None]
    finals = [r["epochs"][-1]["accuracy"] for r in runs]
    bests = [max(e["accuracy"] for e in r["epochs"]) for r in runs]
    per_epoch = [r["epochs"][-1]["seconds"] / len(r["epochs"]) for r in runs]
    group = [np.mean(r["epochs"][-1]["mean_group_size"]) for r in runs]
    # Median over all runs, a run that never reached it counting as
    # infinitely slow ("-" when most never did).
    times = sorted(
      [s for s, _ in reached] + [np.inf] * (len(runs) - len(reached))
    )
    steps = sorted(
      [n for _, n in reached] + [np.inf] * (len(runs) - len(reached))
    )
    mid = len(runs) // 2

    def fmt(x, spec):
      return "-" if not np.isfinite(x) else format(x, spec)

    lines.append(
      f"| {hetero} | {sync} | {len(reached)}/{len(runs)} | "
      f"{fmt(times[mid], '.1f')} | {fmt(steps[mid], '.0f')} | "
      f"{np.mean(finals):.3f} ± {np.std(finals):.3f} | {np.mean(bests):.3f} | "
      f"{np.mean(per_epoch):.2f} | {np.mean(group):.2f} |"
    )
  return "\n".join(lines)


def _plot(records, path):
  import matplotlib

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  heteros = sorted({r["hetero"] for r in records})
  fig, axes = plt.subplots(
    1, len(heteros), figsize=(5 * len(heteros), 4), squeeze=False
  )
  for ax, h in zip(axes[0], heteros, strict=True):
    for (hetero, sync), runs in _groups(records).items():
      if hetero != h:
        continue
      # Mean over seeds, epoch by epoch.
      xs = np.mean([[e["seconds"] for e in r["epochs"]] for r in runs], 0)
      ys = np.mean([[e["accuracy"] for e in r["epochs"]] for r in runs], 0)
      ax.plot(xs, ys, marker="o", label=f"{sync} ({len(runs)} seeds)")
    ax.axhline(FLAGS.sd_target, color="grey", lw=0.8, ls="--")
    ax.set_title(f"hetero = {h} s")
    ax.set_xlabel("training seconds")
    ax.set_ylabel("test accuracy (consensus model, mean over seeds)")
    ax.legend()
  fig.suptitle(f"{PIPELINES} pipelines x {STAGES} stages, 8 CPU devices")
  fig.tight_layout()
  fig.savefig(path, dpi=110)


def main(argv):
  del argv
  records = []
  for seed in map(int, FLAGS.sd_seeds):
    task = _task(seed)
    for h in map(float, FLAGS.sd_hetero):
      for sync in FLAGS.sd_sync:
        start = time.perf_counter()
        records.append(run(task, sync, h, seed))
        print(
          f"  ({time.perf_counter() - start:.0f} s with set-up)", flush=True
        )
  table = _table(records, FLAGS.sd_target)
  print(table)
  os.makedirs(FLAGS.sd_results_dir, exist_ok=True)
  out = os.path.join(FLAGS.sd_results_dir, "time_to_accuracy")
  meta = {
    "date": datetime.date.today().isoformat(),
    "device": str(jax.devices()[0].platform),
    "pipelines": PIPELINES,
    "stages": STAGES,
    "batch_per_pipeline": BATCH,
    "microbatches": MICROBATCHES,
    "base_ms": FLAGS.sd_base_ms,
    "steps_per_epoch": FLAGS.sd_steps_per_epoch,
    "target": FLAGS.sd_target,
    "learning_rate": FLAGS.sd_learning_rate,
    "seeds": [int(x) for x in FLAGS.sd_seeds],
  }
  with open(out + ".json", "w") as f:
    json.dump({"meta": meta, "runs": records}, f, separators=(",", ":"))
  with open(out + ".md", "w") as f:
    f.write(table + "\n")
  _plot(records, out + ".png")
  print(f"wrote {out}.{{json,md,png}}")


if __name__ == "__main__":
  app.run(main)
