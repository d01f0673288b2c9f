"""The seeds' small variants report the papers' generated-text metrics
through the CLI on embedded data (``jpipe.data.stdlib_tasks``: no
download): FTPipe's T5 SQuAD's exact match and F1, PipeDream's GNMT
BLEU. The logged values are recomputed here from the text the trained
params generate (a one-device greedy loop) by ``text_metrics``."""

import dataclasses
import json
import os
import subprocess
import sys

import numpy as np
import pytest

from jpipe.data import text_examples
from jpipe.train import (
  config_plan,
  input_pipeline,
  pretrained,
  tasks,
  text_generation,
  text_metrics,
)

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(__file__)))
# A short run: two steps, an evaluation of 16 held-out examples.
OVERRIDES = {
  "train.steps": 2,
  "train.eval_every": 2,
  "train.checkpoint_every": 2,
  "train.profile_last_step": False,
  "data.eval_examples": 16,
}


def _run(config_arg, workdir) -> str:
  flags = [f"--config.{k}={v}" for k, v in OVERRIDES.items()]
  command = [sys.executable, "-m", "jpipe.train", "--config", config_arg]
  done = subprocess.run(
    [*command, "--workdir", str(workdir), *flags],
    capture_output=True,
    text=True,
    cwd=ROOT,
    env=dict(os.environ, PYTHONPATH=ROOT),
    timeout=900,
  )
  assert done.returncode == 0, done.stderr[-3000:]
  return done.stdout


def _generated_texts(config_arg, workdir):
  """(the texts the workdir's params generate on one device, the
  held-out records)."""
  config = config_plan.load_config_file(os.path.join(ROOT, config_arg))
  config.unlock()
  for key, value in OVERRIDES.items():
    group, name = key.split(".")
    config[group][name] = value
  task = tasks.build_task(config)
  params = pretrained.load_params(str(workdir), task.params)
  rows = []
  capture = dataclasses.replace(
    task.evaluation.generation, score=lambda r: rows.append(r) or {}
  )
  capture.on_one_device(params)
  encoder = text_examples.Encoder(input_pipeline.tokenizer(config))
  texts = [text_generation.text_of(encoder, row) for row in rows[0]]
  held_out = input_pipeline.records(config, config.data.eval_split)
  return texts, [held_out[i] for i in range(len(texts))]


def _logged(workdir) -> dict:
  with open(os.path.join(workdir, "metrics.jsonl")) as f:
    rows = [json.loads(line) for line in f]
  (row,) = [r for r in rows if "eval/loss" in r]
  return row


@pytest.mark.slow
def test_ftpipe_t5_small_logs_exact_match_and_f1_of_its_answers(tmp_path):
  config_arg = "configs/seeds/ftpipe_t5_3b.py:small"
  stdout = _run(config_arg, tmp_path)
  assert "eval generated_exact_match" in stdout
  assert "eval generated_f1" in stdout
  logged = _logged(tmp_path)
  texts, records = _generated_texts(config_arg, tmp_path)
  assert len(texts) == 16
  golds = [
    [input_pipeline.as_text(a) for a in r["answers"]["text"]] for r in records
  ]
  want = text_metrics.squad(texts, golds)
  assert logged["eval/generated_exact_match"] == pytest.approx(
    want["exact_match"], abs=1e-9
  )
  assert logged["eval/generated_f1"] == pytest.approx(want["f1"], abs=1e-9)


@pytest.mark.slow
def test_pipedream_gnmt_small_logs_bleu_of_its_translations(tmp_path):
  config_arg = "configs/seeds/pipedream_gnmt16.py:small"
  stdout = _run(config_arg, tmp_path)
  assert "eval bleu" in stdout
  logged = _logged(tmp_path)
  texts, records = _generated_texts(config_arg, tmp_path)
  assert len(texts) == 16
  references = [input_pipeline.as_text(r["target"]) for r in records]
  want = text_metrics.bleu(texts, references)
  assert logged["eval/bleu"] == pytest.approx(want["bleu"], abs=1e-9)
  assert np.isfinite(logged["eval/bleu"])
