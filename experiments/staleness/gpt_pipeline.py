r"""Delay corrections on a GPT language model through the pipeline itself.

Issue 34's study on a transformer: ``configs/gpt_lm.py``'s byte-level GPT
(AdamW, warm-up + cosine, stdlib bytes) trained as a ``jpipe.Pipeline`` of
p stages for every variant -- synchronous 1F1B, and asynchronous 1F1B
(stage s of p sees delay p - 1 - s) with no mitigation, FTPipe's weight
prediction, weight stashing, PipeMare's rescheduling and the delay-aware
Nesterov method -- and reports the held-out perplexity at the end and the
mean training loss over the run (a convergence-speed measure), each
variant against 1F1B's at the same p.

Writes results/gpt_pipeline.{md,json}.

Usage:
  python -m experiments.staleness.gpt_pipeline                # p = 4, 8
  python -m experiments.staleness.gpt_pipeline --quick        # a smoke run
"""

import json
import os
import time

from jpipe.train.host_devices import default_cpu_device_count

default_cpu_device_count(8)

import jax  # noqa: E402
import numpy as np  # noqa: E402
import tqdm  # noqa: E402
from absl import app, flags  # noqa: E402

from jpipe.train import config_check, config_plan, tasks, train_lib  # noqa: E402

CONFIG = os.path.join(
  os.path.dirname(os.path.dirname(os.path.dirname(__file__))),
  "configs",
  "gpt_lm.py",
)
FLAGS = flags.FLAGS


def define_flags() -> None:
  """The command line's flags: defined when run as a script only, so
  tests (and other experiments) import this module's functions without
  clashing flag names."""
  flags.DEFINE_list("stages", ["4", "8"], "Pipeline stages p.")
  flags.DEFINE_list(
    "variants",
    ["1f1b", "stale", "wp", "ws", "ws+pm", "ws+dnag", "ws+nag99"],
    "1f1b, or async with: stale, wp, ws, and the corrections pm (PipeMare), "
    "dnag (delay-aware Nesterov, adaptive momentum), nag99 (beta1 0.99).",
  )
  flags.DEFINE_integer("steps", 300, "Pipeline steps (4 microbatches each).")
  flags.DEFINE_integer("layers", 8, "Transformer blocks (p = 8 needs enough).")
  flags.DEFINE_bool("quick", False, "p = 2, 3 variants, 4 steps: a smoke run.")
  flags.DEFINE_string(
    "out_dir",
    os.path.join(os.path.dirname(__file__), "results"),
    "Output folder.",
  )


def variant_config(variant: str, num_stages: int, steps: int, layers: int):
  """gpt_lm.py with ``variant``'s schedule and staleness fields."""
  config = config_plan.load_config_file(CONFIG)
  config.unlock()
  config.model.kwargs.num_layers = layers
  config.pipeline.num_stages = num_stages
  config.train.steps = steps
  parts = variant.split("+")
  st = config.staleness
  st.prediction = "msnag" if "wp" in parts else ""
  st.stashing = "ws" in parts
  st.pipemare_anneal_steps = -1 if "pm" in parts else 0
  st.delay_nesterov = (
    "adaptive" if "dnag" in parts else "fixed" if "nag99" in parts else ""
  )
  if variant == "1f1b":
    config.schedule.name = "1f1b"
    config.pipeline.recompute = False
  else:
    config.schedule.name = "async"
    # Stashing keeps residuals at the forward's params; otherwise the
    # backward recomputes at the current ones (FTPipe's stale).
    config.pipeline.recompute = not st.stashing
  config_check.check(config)
  return config


def run(variant: str, num_stages: int, steps: int, layers: int) -> dict:
  config = variant_config(variant, num_stages, steps, layers)
  task = tasks.build_task(config)
  lr = train_lib.learning_rate(config)
  tx = train_lib.build_optimizer(config, lr)
  pipe = train_lib.build_pipeline(config, task, task.batch_at(0), tx, lr)
  state = pipe.init(task.params, task.model_state)
  losses = []
  start = time.perf_counter()
  for step in range(steps):
    state, metrics = pipe.step(state, task.batch_at(step))
    losses.append(float(metrics["loss"]))
  if config.schedule.name == "async":
    state, _ = pipe.flush(state)
  held_out = task.evaluate(
    pipe.gather_params(state), pipe.gather_model_state(state)
  )
  return {
    "variant": variant,
    "num_stages": num_stages,
    "steps": steps,
    "layers": layers,
    "perplexity": float(held_out["perplexity"]),
    "mean_train_loss": float(np.mean(losses)),
    "train_loss_curve": losses,
    "cpu_wall_seconds": time.perf_counter() - start,
  }


def table(records) -> str:
  """Per p: each variant's perplexity and mean loss, and their ratios to
  1F1B's at the same p."""
  lines = [
    "| p | variant | held-out perplexity | vs 1f1b | mean train loss "
    "| vs 1f1b |",
    "|---|---|---|---|---|---|",
  ]
  base = {r["num_stages"]: r for r in records if r["variant"] == "1f1b"}
  for r in records:
    b = base.get(r["num_stages"])
    ppl = r["perplexity"] / b["perplexity"] if b else float("nan")
    loss = r["mean_train_loss"] / b["mean_train_loss"] if b else float("nan")
    lines.append(
      f"| {r['num_stages']} | {r['variant']} | {r['perplexity']:.3f} | "
      f"{ppl:.3f} | {r['mean_train_loss']:.3f} | {loss:.3f} |"
    )
  return "\n".join(lines)


def main(argv):
  del argv
  stages = [int(p) for p in FLAGS.stages]
  variants, steps, layers = FLAGS.variants, FLAGS.steps, FLAGS.layers
  if FLAGS.quick:
    stages, variants, steps, layers = [2], ["1f1b", "stale", "ws+dnag"], 4, 2
  if any(p > len(jax.devices()) for p in stages):
    raise app.UsageError(
      f"--stages {stages}: only {len(jax.devices())} devices (set "
      "XLA_FLAGS=--xla_force_host_platform_device_count=8 on CPU)"
    )
  records = []
  runs = [(p, v) for p in stages for v in variants]
  for p, v in tqdm.tqdm(runs, desc="gpt pipeline runs"):
    records.append(run(v, p, steps, layers))
    # Written after every run: an hour's study stopped halfway keeps
    # what it finished.
    text = (
      f"GPT ({layers} blocks, width 128, bytes of the stdlib), {steps} "
      f"pipeline steps of 4 microbatches, AdamW warm-up + cosine; "
      f"{jax.devices()[0].platform}, jax {jax.__version__}.\n\n"
      + table(records)
    )
    _write(FLAGS.out_dir, text, records)
  print(text)


def _write(out_dir, text, records):
  os.makedirs(out_dir, exist_ok=True)
  with open(os.path.join(out_dir, "gpt_pipeline.md"), "w") as f:
    f.write(text + "\n")
  with open(os.path.join(out_dir, "gpt_pipeline.json"), "w") as f:
    json.dump(
      {"date": time.strftime("%Y-%m-%d"), "runs": records},
      f,
      separators=(",", ":"),
    )


if __name__ == "__main__":
  define_flags()
  app.run(main)
