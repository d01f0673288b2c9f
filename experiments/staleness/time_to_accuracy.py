r"""Time to accuracy: the runtime's asynchronous pipelines against GPipe.

The reason to run asynchronously at all is reaching a target sooner. For
the WRN config (digits, test accuracy) and the GPT config (stdlib bytes,
held-out perplexity), at p = 4 stages and 4 microbatches per step, this
trains with the runtime itself -- ``jpipe.Pipeline``, the schedules and
mitigations the training CLI runs -- gpipe and async with ws, wp, ws+wp
and wp+ga, evaluating every ``--eval_every`` steps (an asynchronous stream
is flushed there, as the training CLI does), and reports the first step
that reaches the target.

Wall time is PREDICTED from measured per-action costs: each stage's
forward, backward and step are timed one at a time (a ``seq`` twin of the
variant's pipeline, profiled after compilation; plus one weight
prediction per forward where the variant predicts) and the event
simulator replays the variant's schedule with them (gpipe: a flush per
call; async: a stream whose warm-up is paid once per evaluation
interval). CPU devices share two cores, so wall time measured here would
show the cores' contention, not the schedule; on a GPU, time it there.

Writes results/time_to_accuracy.{md,json}.

Usage: python -m experiments.staleness.time_to_accuracy [--models wrn,gpt]
"""

import json
import os
import time

from jpipe.train.host_devices import default_cpu_device_count

default_cpu_device_count(8)

import jax  # noqa: E402
from absl import app, flags  # noqa: E402

from experiments.staleness.predicted_time import (  # noqa: E402
  isolated_costs,
  seconds_per_step,
)
from jpipe.train import config_plan, tasks, train_lib  # noqa: E402

OUT = os.path.join(os.path.dirname(__file__), "results")
FLAGS = flags.FLAGS
flags.DEFINE_list("models", ["wrn", "gpt"], "Which configs to run.")
flags.DEFINE_list(
  "variants",
  ["gpipe", "ws", "wp", "ws+wp", "wp+ga", "ws-k4"],
  "Schedules/mitigations; -kN: a step every N backwards.",
)
flags.DEFINE_integer("eval_every", 10, "Steps between evaluations.")

MODELS = {
  # config, metric, target, better, steps
  "wrn": ("configs/wrn_stale.py", "accuracy", 0.97, "higher", 150),
  "gpt": ("configs/gpt_lm.py", "perplexity", 12.0, "lower", 200),
}


def _config(path, variant, steps):
  """The model's config with a variant: gpipe, ws, wp, ws+wp, wp+ga, and
  "-kN" for a step every N backwards (FTPipe's step_every)."""
  variant, _, every = variant.partition("-k")
  spec = f"{path}:{variant}" if "wrn" in path else path
  config = config_plan.load_config_file(spec)
  config.unlock()
  if "gpt" in path:  # gpt_lm.py is async + wp; set the variant here.
    apply = {
      "gpipe": dict(name="gpipe", stashing=False, prediction=""),
      "ws": dict(name="async", stashing=True, prediction=""),
      "wp": dict(name="async", stashing=False, prediction="msnag"),
      "ws+wp": dict(name="async", stashing=True, prediction="msnag"),
      "wp+ga": dict(name="async", stashing=False, prediction="msnag"),
    }[variant]
    config.schedule.name = apply["name"]
    config.staleness.stashing = apply["stashing"]
    config.staleness.prediction = apply["prediction"]
    config.staleness.gap_aware = "ga" if "ga" in variant else ""
    # Only a stale async pipeline needs to recompute (no stashing);
    # gpipe and ws keep residuals, as the WRN variants do.
    config.pipeline.recompute = (
      apply["name"] == "async" and not apply["stashing"]
    )
  if every:
    config.schedule.step_every = int(every)
    config.staleness.gap_aware = ""  # (Gap-Aware needs step_every 1.)
  config.train.steps = steps
  return config


def run(model, variant):
  path, metric, target, better, steps = MODELS[model]
  config = _config(path, variant, steps)
  task = tasks.build_task(config)
  lr = train_lib.learning_rate(config)
  tx = train_lib.build_optimizer(config, lr)
  pipe = train_lib.build_pipeline(config, task, task.batch_at(0), tx, lr)
  state = pipe.init(task.params, task.model_state)
  reached, curve = None, []
  t0 = time.perf_counter()
  for step in range(steps):
    state, _ = pipe.step(state, task.batch_at(step))
    done = step + 1
    if done % FLAGS.eval_every == 0 or done == steps:
      state, _ = pipe.flush(state)
      value = task.evaluate(
        pipe.gather_params(state), pipe.gather_model_state(state)
      )[metric]
      curve.append((done, value))
      ok = value >= target if better == "higher" else value <= target
      if ok and reached is None:
        reached = done
        break
  wall = time.perf_counter() - t0
  delay = pipe.stages.num_stages - 1 if config.staleness.prediction else 0
  costs = isolated_costs(config, task, delay)
  per_step = seconds_per_step(config, costs, FLAGS.eval_every)
  return {
    "model": model,
    "variant": variant,
    "metric": metric,
    "target": target,
    "steps_to_target": reached,
    "predicted_seconds_per_step": per_step,
    "predicted_seconds_to_target": None
    if reached is None
    else reached * per_step,
    "stage_costs_seconds": costs,
    "cpu_wall_seconds": wall,
    "curve": curve,
  }


def main(argv):
  del argv
  records, rows = [], []
  for model in FLAGS.models:
    base = None
    for variant in FLAGS.variants:
      r = run(model, variant)
      records.append(r)
      if variant == "gpipe":
        base = r["predicted_seconds_to_target"]
      t = r["predicted_seconds_to_target"]
      speedup = base / t if base and t else float("nan")
      rows.append(
        f"| {model} | {variant} | {r['metric']} {r['target']} | "
        f"{r['steps_to_target'] or 'not reached'} | "
        f"{1e3 * r['predicted_seconds_per_step']:.2f} | "
        f"{'-' if t is None else f'{t:.2f}'} | {speedup:.2f} |"
      )
      print(rows[-1], flush=True)
  table = (
    "| model | variant | target | steps to target | predicted ms/step | "
    "predicted s to target | vs gpipe |\n|---|---|---|---|---|---|---|\n"
    + "\n".join(rows)
  )
  print(table)
  os.makedirs(OUT, exist_ok=True)
  with open(os.path.join(OUT, "time_to_accuracy.md"), "w") as f:
    f.write(table + "\n")
  with open(os.path.join(OUT, "time_to_accuracy.json"), "w") as f:
    json.dump(records, f, separators=(",", ":"))


if __name__ == "__main__":
  jax.config.parse_flags_with_absl()
  app.run(main)
