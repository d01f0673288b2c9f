r"""Time to a target on a clock: asynchronous pipelines against GPipe and
1F1B, one process per stage.

Issue 34, item 3. ``configs/gpt_lm.py``'s byte-level GPT split into 2
stages, each in its own process (``python -m jpipe.launch --nprocs 2``)
whose XLA runs one thread, so on a 2-core machine each stage has a core,
as ``experiments.distributed.throughput`` measures. Every variant trains
through the training CLI itself (``python -m jpipe.train``), evaluating
held-out perplexity every ``--eval_every`` steps; its time to the target
is the training clock at the first evaluation that reaches it
(``metrics.jsonl``'s ``time/train_seconds``: evaluations and checkpoints
left out, and the first step, which compiles, counted at the run's mean
step time). Beside it, the simulator's prediction for the same steps to
target (``experiments.staleness.predicted_time``: each stage's forward,
backward and step timed one at a time on one thread, the variant's
schedule replayed by the event simulator).

Writes results/time_to_target.{md,json}.

Usage:
  python -m experiments.staleness.time_to_target [--steps 200]
      [--target 12] [--variants gpipe,1f1b,ws+wp,ws+nag99]
"""

import json
import os
import subprocess
import sys
import tempfile
import time

from absl import app, flags

from experiments.distributed import throughput

ROOT = throughput.ROOT
CONFIG = os.path.join(ROOT, "configs", "gpt_lm.py")
OUT = os.path.join(os.path.dirname(__file__), "results")
FLAGS = flags.FLAGS


def define_flags() -> None:
  """The command line's flags: defined when run as a script only, so
  tests (and other experiments) import this module's functions without
  clashing flag names."""
  flags.DEFINE_list(
    "variants",
    ["gpipe", "1f1b", "ws+wp", "ws+dnag", "ws+nag99"],
    "gpipe, 1f1b, or async with ws / wp / dnag / nag99 joined by '+'.",
  )
  flags.DEFINE_integer("steps", 200, "Pipeline steps per run (4 microbatches).")
  flags.DEFINE_integer("eval_every", 10, "Steps between evaluations.")
  flags.DEFINE_float("target", 12.0, "Held-out perplexity to reach.")
  flags.DEFINE_bool("predict", True, "Also the simulator's prediction.")
  flags.DEFINE_string("out_dir", OUT, "Output folder.")


# Options of each variant on top of gpt_lm.py (asynchronous 1F1B, AdamW,
# msnag prediction, recomputation): the training CLI's own overrides.
SYNCHRONOUS = ("gpipe", "1f1b")


def overrides(variant: str, steps: int, eval_every: int) -> list[str]:
  """The ``--config.*`` flags of one run of ``variant``."""
  common = [
    "--config.pipeline.num_stages=2",
    f"--config.train.steps={steps}",
    f"--config.train.eval_every={eval_every}",
    f"--config.train.log_every={eval_every}",
    f"--config.train.checkpoint_every={steps}",
    "--config.train.profile_last_step=False",
  ]
  if variant in SYNCHRONOUS:
    return [
      *common,
      f"--config.schedule.name={variant}",
      "--config.staleness.prediction=",
      "--config.pipeline.recompute=False",
    ]
  parts = variant.split("+")
  unknown = set(parts) - {"ws", "wp", "dnag", "nag99"}
  if unknown:
    raise app.UsageError(f"variant {variant!r}: unknown {sorted(unknown)}")
  nesterov = (
    "adaptive" if "dnag" in parts else "fixed" if "nag99" in parts else ""
  )
  return [
    *common,
    "--config.schedule.name=async",
    f"--config.staleness.stashing={'ws' in parts}",
    f"--config.staleness.prediction={'msnag' if 'wp' in parts else ''}",
    f"--config.staleness.delay_nesterov={nesterov}",
    # Stashing keeps residuals at the forward's params; otherwise the
    # backward recomputes at the current ones.
    f"--config.pipeline.recompute={'ws' not in parts}",
  ]


def time_to_target(rows, target, steps):
  """(steps, seconds) at the first evaluation whose perplexity <= target,
  or (None, None); seconds: the training clock there, the first
  (compiling, untimed) step counted at the run's mean step time."""
  timed = [r for r in rows if "time/train_seconds" in r]
  last = max(timed, key=lambda r: r["step"])
  per_step = last["time/train_seconds"] / max(last["step"] - 1, 1)
  for r in sorted(rows, key=lambda r: r["step"]):
    ppl = r.get("eval/perplexity")
    if ppl is not None and ppl <= target:
      return r["step"], r["time/train_seconds"] + per_step
  return None, None


def measure(variant: str) -> dict:
  """Trains ``variant`` on 2 processes; its curve and time to target."""
  with tempfile.TemporaryDirectory() as workdir:
    command = [
      sys.executable,
      "-m",
      "jpipe.launch",
      "--nprocs",
      "2",
      "--",
      sys.executable,
      "-m",
      "jpipe.train",
      f"--config={CONFIG}",
      f"--workdir={workdir}",
      *overrides(variant, FLAGS.steps, FLAGS.eval_every),
    ]
    done = subprocess.run(
      command,
      env=throughput.one_core_env(1),
      capture_output=True,
      text=True,
      cwd=ROOT,
    )
    if done.returncode:
      raise SystemExit(
        f"{variant}: the run failed\n{done.stdout[-3000:]}{done.stderr[-3000:]}"
      )
    with open(os.path.join(workdir, "metrics.jsonl")) as f:
      rows = [json.loads(line) for line in f]
  steps, seconds = time_to_target(rows, FLAGS.target, FLAGS.steps)
  curve = [
    (r["step"], r["eval/perplexity"], r["time/train_seconds"])
    for r in rows
    if "eval/perplexity" in r
  ]
  return {
    "variant": variant,
    "steps_to_target": steps,
    "seconds_to_target": seconds,
    "curve": curve,
  }


def config_with(variant: str, steps: int, eval_every: int):
  """gpt_lm.py with ``overrides(variant, ...)`` applied, as the CLI
  applies them (unlocked)."""
  from jpipe.train import config_plan

  config = config_plan.load_config_file(CONFIG)
  config.unlock()
  for flag in overrides(variant, steps, eval_every):
    key, _, value = flag[len("--config.") :].partition("=")
    group, name = key.split(".")
    old = config[group][name]
    config[group][name] = (
      value == "True" if isinstance(old, bool) else type(old)(value)
    )
  return config


def predicted_seconds_per_step(variant: str) -> float:
  """The simulator's seconds per step of ``variant`` at 2 stages, from
  per-action costs measured in this process (one thread)."""
  from experiments.staleness import predicted_time
  from jpipe.train import tasks

  config = config_with(variant, FLAGS.steps, FLAGS.eval_every)
  task = tasks.build_task(config)
  delay = 1 if config.staleness.prediction else 0
  costs = predicted_time.isolated_costs(config, task, delay)
  return predicted_time.seconds_per_step(config, costs, FLAGS.eval_every)


def table(records) -> str:
  base = {r["variant"]: r["seconds_to_target"] for r in records}
  lines = [
    "| variant | steps to target | measured s to target | vs gpipe | vs 1f1b "
    "| predicted s to target |",
    "|---|---|---|---|---|---|",
  ]
  for r in records:
    t = r["seconds_to_target"]

    def vs(name, t=t):
      b = base.get(name)
      return f"{b / t:.2f}" if b and t else "-"

    predicted = r.get("predicted_seconds_to_target")
    lines.append(
      f"| {r['variant']} | {r['steps_to_target'] or 'not reached'} | "
      f"{'-' if t is None else f'{t:.1f}'} | {vs('gpipe')} | {vs('1f1b')} | "
      f"{'-' if predicted is None else f'{predicted:.1f}'} |"
    )
  return "\n".join(lines)


def main(argv):
  del argv
  records = []
  for variant in FLAGS.variants:
    r = measure(variant)
    if FLAGS.predict and r["steps_to_target"]:
      per_step = predicted_seconds_per_step(variant)
      r["predicted_seconds_per_step"] = per_step
      r["predicted_seconds_to_target"] = per_step * r["steps_to_target"]
    records.append(r)
    print(table(records).splitlines()[-1], flush=True)
  text = (
    f"GPT 4x128 (configs/gpt_lm.py), 2 stages in 2 processes of one XLA "
    f"thread each; target held-out perplexity {FLAGS.target}, evaluated "
    f"every {FLAGS.eval_every} steps of 4 microbatches.\n\n" + table(records)
  )
  print(text)
  os.makedirs(FLAGS.out_dir, exist_ok=True)
  with open(os.path.join(FLAGS.out_dir, "time_to_target.md"), "w") as f:
    f.write(text + "\n")
  with open(os.path.join(FLAGS.out_dir, "time_to_target.json"), "w") as f:
    json.dump(
      {
        "date": time.strftime("%Y-%m-%d"),
        "target": FLAGS.target,
        "runs": records,
      },
      f,
      separators=(",", ":"),
    )


if __name__ == "__main__":
  # This process only predicts: one thread, two CPU devices (the stages).
  # Set here, not at import: a test importing this module must not change
  # the environment its later subprocesses inherit. (The device count
  # first: XLA reads no flag after ONE_THREAD's bare
  # intra_op_parallelism_threads=1.)
  os.environ["XLA_FLAGS"] = (
    "--xla_force_host_platform_device_count=2 " + throughput.ONE_THREAD
  )
  define_flags()
  app.run(main)
