r"""DynPipe's situation with honest timing: 4 stages, one process each.

``configs/dynpipe.py``'s model (a 7-hidden-layer MLP on the embedded
digits, 4-stage asynchronous 1F1B with weight stashing) runs across 4
processes, one stage (one CPU device) per process, started by
``jpipe.launch``. Every forward + backward of the whole model spends a
simulated ``--dp_simulated_ms`` per microbatch, split among the stages by
their cost shares -- sleeps, each process for its own stage, so the
stages really overlap and CPU timings are honest -- and device 1 runs
``--dp_factor`` times slower from step ``--dp_from`` to ``--dp_to``.

Runs, each ``--dp_steps`` steps:

- static: the partitioner's plan throughout (no re-partitioning);
- dynpipe: DynPipe's rule (window trigger, top-k candidate cuts, its
  1F1B score);
- jpipe: jpipe's rule (exact split for the measured slowdowns, switched
  to when the predicted gain pays for the switch);
- jpipe_rf, dynpipe_rf: the same rules with DynPipe's slowdown predictor
  (a random forest fitted first on stage times this 4-process pipeline
  measured on several splits with its devices slowed 1.5-4x:
  ``jpipe.dynamic.collect``; the collection's time is reported);
- best: the split that is optimal for the slowed device (jpipe's exact
  solver on the cost model with the true factor), static, slowed from
  the start: the step time the policies should reach during the slowdown.

Each process reads the loss every step (so step times are wall-clock
between steps, measured in process 0); the model is evaluated every
``--dp_eval_every`` steps (time to accuracy; evaluation is not timed).

  python -m experiments.dynpipe.repartition [--dp_steps 200]

Prints a table; writes results/repartition_seed{SEED}.{json,md,png}
(``--dp_seed``: config.seed, the params and the data order).
"""

import datetime
import json
import os
import subprocess
import sys
import time

from absl import app, flags

FLAGS = flags.FLAGS
flags.DEFINE_integer("dp_steps", 200, "Steps per run.")
flags.DEFINE_integer("dp_window", 10, "Steps per measurement window.")
flags.DEFINE_float("dp_simulated_ms", 40.0, "Simulated ms per model F+B.")
flags.DEFINE_float("dp_factor", 3.0, "Slowdown factor of device 1.")
flags.DEFINE_integer("dp_from", 60, "First slowed step.")
flags.DEFINE_integer("dp_to", 140, "First step after the slowdown.")
flags.DEFINE_integer("dp_eval_every", 20, "Steps between evaluations.")
flags.DEFINE_list(
  "dp_runs",
  ["static", "dynpipe", "jpipe", "dynpipe_rf", "jpipe_rf", "best"],
  "Runs.",
)
flags.DEFINE_integer("dp_splits", 8, "Splits the predictor is fitted on.")
flags.DEFINE_integer("dp_seed", 0, "config.seed: params and data order.")
flags.DEFINE_float(
  "dp_target", 0.85, "Test accuracy whose first reaching is timed."
)
flags.DEFINE_string("dp_worker", "", "(internal) write results here.")
flags.DEFINE_string(
  "dp_results_dir",
  os.path.join(os.path.dirname(__file__), "results"),
  "Where to write the tables.",
)

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(__file__)))
STAGES = 4


def _worker():
  """One process of the launched run: every run, results from process 0."""
  from jpipe import distributed

  distributed.initialize()
  import jax
  import numpy as np

  sys.path.insert(0, ROOT)
  import jpipe
  from configs import dynpipe as dynpipe_config
  from jpipe import dynamic, partition
  from jpipe.train import tasks, train_lib

  config = dynpipe_config.get_config()
  config.seed = FLAGS.dp_seed
  task = tasks.build_task(config)
  example = task.batch_at(0)
  lr = train_lib.learning_rate(config)
  tx = train_lib.build_optimizer(config, lr)
  options = train_lib.pipeline_options(config, task, lr)
  options.pop("partition")
  shapes = jax.tree.map(
    lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), example
  )
  slowed = f"1:{FLAGS.dp_factor}:{FLAGS.dp_from}:{FLAGS.dp_to}"
  records = []
  best_split = best_bounds = None
  predictor, collection = None, {}
  if any(run.endswith("_rf") for run in FLAGS.dp_runs):
    predictor, collection = _fit_predictor(task, example, tx, options)
  for run in FLAGS.dp_runs:
    inject = slowed
    plan = "contiguous"
    policy = run.removesuffix("_rf")
    policy = policy if policy in dynamic.POLICIES else "static"
    if run == "best":
      inject = f"1:{FLAGS.dp_factor}:0"  # Slowed throughout.
      plan = best_split
    interference = dynamic.Interference(
      dynamic.parse_inject(inject), FLAGS.dp_simulated_ms / 1e3
    )
    build = jpipe.PipelineBuilder.of(
      task.loss_fn,
      task.params,
      example,
      devices=jax.devices(),
      optimizer=tx,
      partition=plan,
      **options,
    )
    dp = dynamic.DynamicPipeline(
      build,
      policy=policy,
      window=FLAGS.dp_window,
      horizon_steps=50,
      interference=interference,
      # Process 0 decides: only it consults the predictor.
      predictor=predictor if run.endswith("_rf") else None,
    )
    if best_split is None:  # From the first run's traced model and costs.
      slowdown = [1.0] * STAGES
      slowdown[1] = FLAGS.dp_factor
      best_bounds, _ = dynamic.jpipe_split(dp.forward, dp.backward, slowdown)
      best_split = partition.plan_from_boundaries(
        dp.pipeline.traced, dp.costs, best_bounds
      )
    state = dp.init(task.params, task.model_state)
    times, evals, start = [], [], time.perf_counter()
    last = start
    for step in range(FLAGS.dp_steps):
      batch = task.batch_at(step) if dp.reads_batch else shapes
      state, metrics = dp.step(state, batch)
      float(metrics["loss"])  # The step's losses are in.
      now = time.perf_counter()
      times.append(now - last)
      last = now
      if (step + 1) % FLAGS.dp_eval_every == 0:
        state, _ = dp.flush(state)
        params = dp.gather_params(state)  # All processes: a collective.
        pause = time.perf_counter()
        if jax.process_index() == 0:
          accuracy = float(task.evaluate(params, None)["accuracy"])
          evals.append((step + 1, now - start, accuracy))
        last += time.perf_counter() - pause  # Evaluation is not timed.
        start += time.perf_counter() - pause
    records.append(
      {
        "run": run,
        "policy": policy,
        "inject": inject,
        "first_split": list(dp.history[0]["old"]) if dp.history else None,
        "step_seconds": times,
        "windows": [
          {"step": w.step, "sigma": list(w.sigma), "seconds": w.step_seconds}
          for w in dp.windows
        ],
        "repartitions": dp.history,
        "evals": evals,
        "split_at_end": list(dp.boundaries),
      }
    )
    if jax.process_index() == 0:
      print(f"{run}: {np.mean(times[1:]):.4f} s/step, {dp.history}", flush=True)
  if jax.process_index() == 0:
    with open(FLAGS.dp_worker, "w") as f:
      json.dump(
        {
          "runs": records,
          "best_split": list(best_bounds),
          "predictor": collection,
        },
        f,
      )


def _fit_predictor(task, example, tx, options):
  """DynPipe's forest, fitted on what this pipeline measures (every
  process collects; process 0 fits): ``(predictor or None, info)``."""
  import jax

  import jpipe
  from jpipe import dynamic

  start = time.perf_counter()
  build = jpipe.PipelineBuilder.of(
    task.loss_fn,
    task.params,
    example,
    devices=jax.devices(),
    optimizer=tx,
    **options,
  )
  dp = dynamic.DynamicPipeline(
    build,
    policy="static",
    interference=dynamic.Interference((), FLAGS.dp_simulated_ms / 1e3),
  )
  state = dp.init(task.params, task.model_state)
  _, measured = dynamic.collect(
    dp, state, task.batch_at, num_splits=FLAGS.dp_splits
  )
  seconds = time.perf_counter() - start
  if jax.process_index() != 0:
    return None, {}
  predictor = dynamic.SlowdownPredictor.fit(measured)
  info = predictor.info | {
    "collect_seconds": seconds,
    "splits": [list(b) for b in measured.splits],
  }
  print(f"predictor: {info}", flush=True)
  return predictor, info


def _launch(out):
  env = dict(os.environ)  # (jpipe.launch drops proxies for its children.)
  env.pop("XLA_FLAGS", None)  # Each process sets its own device count.
  env["JAX_PLATFORMS"] = "cpu"
  env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
  command = [sys.executable, "-m", "jpipe.launch", "--nprocs", str(STAGES)]
  command += ["--", sys.executable, "-m", "experiments.dynpipe.repartition"]
  command += [f"--dp_worker={out}"]
  for name in (
    "dp_steps",
    "dp_window",
    "dp_simulated_ms",
    "dp_factor",
    "dp_from",
    "dp_to",
    "dp_eval_every",
    "dp_splits",
    "dp_seed",
  ):
    command.append(f"--{name}={getattr(FLAGS, name)}")
  command.append(f"--dp_runs={','.join(FLAGS.dp_runs)}")
  subprocess.run(command, env=env, cwd=ROOT, check=True)


def _mean(xs):
  return sum(xs) / len(xs) if xs else float("nan")


def _median(xs):
  return float(sorted(xs)[len(xs) // 2]) if xs else float("nan")


def _summary(record, window):
  """Mean step seconds before, during (after two windows), after; the
  slowed stretch also as a median: the step time a run settled at,
  without the one-off switch and compile of a switch that lands in it
  (those stay in the total)."""
  t = record["step_seconds"]
  a, b = FLAGS.dp_from, FLAGS.dp_to
  settled = min(a + 2 * window, b)
  first = next(
    (r["step"] for r in record["repartitions"] if r["step"] > a), None
  )
  accuracy = record["evals"][-1][2] if record["evals"] else float("nan")
  reached = next(
    (e[1] for e in record["evals"] if e[2] >= FLAGS.dp_target), None
  )
  return {
    "before": _mean(t[window:a]),
    "slowed_settled": _mean(t[settled:b]),
    "slowed_settled_median": _median(t[settled:b]),
    "after": _mean(t[b + 2 * window :]),
    "first_switch_after_onset": first,
    "total_seconds": sum(t),
    "final_accuracy": accuracy,
    "seconds_to_target": reached,
  }


def _table(data) -> str:
  window = FLAGS.dp_window
  rows = {r["run"]: _summary(r, window) for r in data["runs"]}
  best = rows.get("best", {}).get("slowed_settled_median")
  lines = [
    "| run | s/step before | s/step slowed, from 2 windows after onset: "
    "mean | median | median vs best | s/step after | first switch after "
    f"onset | total s | final accuracy | s to {FLAGS.dp_target:.2f} "
    "accuracy |",
    "|---|---|---|---|---|---|---|---|---|---|",
  ]
  for run, s in rows.items():
    ratio = s["slowed_settled_median"] / best if best else float("nan")
    lines.append(
      f"| {run} | {s['before']:.4f} | {s['slowed_settled']:.4f} | "
      f"{s['slowed_settled_median']:.4f} | {ratio:.2f} | {s['after']:.4f} | "
      f"{s['first_switch_after_onset'] or '-'} | {s['total_seconds']:.1f} | "
      f"{s['final_accuracy']:.3f} | "
      + (
        f"{s['seconds_to_target']:.1f} |"
        if s["seconds_to_target"] is not None
        else "not reached |"
      )
    )
  return "\n".join(lines)


def _plot(data, path):
  import matplotlib

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  fig, (top, bottom) = plt.subplots(1, 2, figsize=(13, 4.5))
  w = FLAGS.dp_window
  for r in data["runs"]:
    t = r["step_seconds"]
    # Mean over windows of steps (the raw steps are noisy).
    xs = list(range(w, len(t) + 1, w))
    ys = [_mean(t[x - w : x]) for x in xs]
    (line,) = top.plot(xs, ys, marker=".", label=r["run"])
    for rec in r["repartitions"]:
      top.axvline(rec["step"], color=line.get_color(), ls="--", lw=0.8)
    if r["evals"]:
      bottom.plot(
        [e[1] for e in r["evals"]],
        [e[2] for e in r["evals"]],
        marker="o",
        label=r["run"],
        color=line.get_color(),
      )
  top.axvspan(FLAGS.dp_from, FLAGS.dp_to, color="grey", alpha=0.15)
  top.set_xlabel("step (grey: device 1 slowed; dashed: re-partitions)")
  top.set_ylabel(f"seconds per step (mean of {w})")
  top.legend()
  bottom.set_xlabel("training seconds")
  bottom.set_ylabel("test accuracy")
  bottom.legend()
  fig.suptitle(
    f"{STAGES} stages, one process each; device 1 {FLAGS.dp_factor}x slower "
    f"from step {FLAGS.dp_from} to {FLAGS.dp_to}"
  )
  fig.tight_layout()
  fig.savefig(path, dpi=110)


def main(argv):
  del argv
  if FLAGS.dp_worker:
    _worker()
    return
  os.makedirs(FLAGS.dp_results_dir, exist_ok=True)
  out = os.path.join(FLAGS.dp_results_dir, f"repartition_seed{FLAGS.dp_seed}")
  _launch(out + ".json")
  with open(out + ".json") as f:
    data = json.load(f)
  data["meta"] = {
    "date": datetime.date.today().isoformat(),
    "device": "CPU, 4 processes x 1 device (2 cores)",
    "steps": FLAGS.dp_steps,
    "window": FLAGS.dp_window,
    "simulated_ms": FLAGS.dp_simulated_ms,
    "factor": FLAGS.dp_factor,
    "from": FLAGS.dp_from,
    "to": FLAGS.dp_to,
    "seed": FLAGS.dp_seed,
    "target_accuracy": FLAGS.dp_target,
  }
  with open(out + ".json", "w") as f:
    json.dump(data, f, separators=(",", ":"))
  table = _table(data)
  fitted = data.get("predictor")
  if fitted:
    table += (
      f"\n\nPredictor: {fitted['samples']} samples from "
      f"{len(fitted['splits'])} splits, collected in "
      f"{fitted['collect_seconds']:.0f} s; held-out mean absolute error of "
      f"the slowdown: forest {fitted['heldout_mae']:.3f}, measured rule "
      f"{fitted['heldout_mae_measured_rule']:.3f}."
    )
  print(table)
  with open(out + ".md", "w") as f:
    f.write(table + "\n")
  _plot(data, out + ".png")
  print(f"wrote {out}.{{json,md,png}}")


if __name__ == "__main__":
  app.run(main)
