r"""Fine-tuning through the pipeline, shown without a download.

Pretrains configs/gpt_lm.py on the first half of the training files,
fine-tunes it with configs/gpt_finetune.py on the second half (a slice it
never saw; ``config.init_from`` = the pretraining workdir), and, as the
baseline, trains the same config from a random init on that slice. Every
run evaluates on the same held-out files. Prints the table and writes
results/finetune.{md,json}: per run the evaluation at step 0 (the
fine-tuned run's must be the pretrained model's) and at each later
evaluation.

Usage: python -m experiments.finetune.finetune [--pretrain_steps 300]
"""

import datetime
import json
import os
import tempfile

# Before jax loads: a CPU run gets 8 devices, as python -m jpipe.train does.
from jpipe.train.host_devices import default_cpu_device_count

default_cpu_device_count(8)

from absl import app, flags  # noqa: E402

from jpipe.train import config_plan, train_lib  # noqa: E402
from jpipe.train.metric_log import read_metrics  # noqa: E402

FLAGS = flags.FLAGS
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(__file__)))
flags.DEFINE_integer("pretrain_steps", 300, "Pretraining steps.")
flags.DEFINE_integer("finetune_steps", 100, "Fine-tuning (and baseline) steps.")
flags.DEFINE_integer("eval_sequences", 128, "Held-out sequences evaluated.")
flags.DEFINE_string(  # Not out_dir: experiments imported together clash.
  "results_dir",
  os.path.join(os.path.dirname(__file__), "results"),
  "Output folder.",
)
flags.DEFINE_string("work_dir", "", "Run workdirs; default a temporary dir.")


def _config(name, eval_sequences, init_from=None):
  config = config_plan.load_config_file(
    os.path.join(ROOT, "configs", f"{name}.py")
  )
  config.unlock()
  if init_from is not None:
    config.init_from = init_from
  config.train.profile_last_step = False
  config.data.eval_sequences = eval_sequences
  return config


def _evaluations(workdir):
  """[(step, eval loss, eval perplexity)] from a run's metrics."""
  return [
    (r["step"], r["eval/loss"], r["eval/perplexity"])
    for r in read_metrics(workdir)
    if "eval/loss" in r
  ]


def run(work_dir, pretrain_steps, finetune_steps, eval_sequences):
  """The three runs in ``work_dir``; returns the results dict."""
  pre_dir = os.path.join(work_dir, "pretrain")
  pre = _config("gpt_lm", eval_sequences)
  pre.data.train_split = "train[:50%]"
  pre.train.steps = pretrain_steps
  pre.train.eval_every = pre.train.checkpoint_every = pretrain_steps
  train_lib.train_and_evaluate(pre, pre_dir)
  runs = {"pretrain (train[:50%])": _evaluations(pre_dir)}
  for label, init_from in (
    ("fine-tune (train[50%:])", pre_dir),
    ("from scratch (train[50%:])", ""),
  ):
    workdir = os.path.join(work_dir, label.split()[0])
    config = _config("gpt_finetune", eval_sequences, init_from)
    config.train.steps = finetune_steps
    config.train.eval_every = max(finetune_steps // 2, 1)
    config.train.checkpoint_every = finetune_steps
    train_lib.train_and_evaluate(config, workdir)
    runs[label] = _evaluations(workdir)
  return {
    "date": datetime.date.today().isoformat(),
    "pretrain_steps": pretrain_steps,
    "finetune_steps": finetune_steps,
    "eval_sequences": eval_sequences,
    "runs": {
      label: [{"step": s, "loss": x, "perplexity": p} for s, x, p in evals]
      for label, evals in runs.items()
    },
  }


def table(results) -> str:
  lines = [
    "| run | step | held-out loss (nats/byte) | perplexity |",
    "|---|---:|---:|---:|",
  ]
  for label, evals in results["runs"].items():
    for e in evals:
      lines.append(
        f"| {label} | {e['step']} | {e['loss']:.4f} | {e['perplexity']:.2f} |"
      )
  return "\n".join(lines)


def write(results, results_dir) -> str:
  """Writes finetune.{md,json}; returns the table."""
  text = table(results)
  os.makedirs(results_dir, exist_ok=True)
  with open(os.path.join(results_dir, "finetune.md"), "w") as f:
    f.write(text + "\n")
  with open(os.path.join(results_dir, "finetune.json"), "w") as f:
    json.dump(results, f, separators=(",", ":"))
  return text


def main(argv):
  del argv
  sizes = (FLAGS.pretrain_steps, FLAGS.finetune_steps, FLAGS.eval_sequences)
  if FLAGS.work_dir:
    results = run(FLAGS.work_dir, *sizes)
  else:
    with tempfile.TemporaryDirectory() as work_dir:
      results = run(work_dir, *sizes)
  print(write(results, FLAGS.results_dir))


if __name__ == "__main__":
  app.run(main)
