"""The fine-tuning demonstration end to end, shrunk to seconds: the
fine-tuned run (configs/gpt_finetune.py) starts from the pretrained
model's held-out loss; the baseline from a random init's."""

import json

import pytest


@pytest.mark.slow
def test_finetune_starts_from_the_pretrained_loss(tmp_path):
  from experiments.finetune import finetune

  results = finetune.run(
    str(tmp_path / "runs"), pretrain_steps=2, finetune_steps=1, eval_sequences=8
  )
  finetune.write(results, str(tmp_path))
  results = json.loads((tmp_path / "finetune.json").read_text())
  runs = results["runs"]
  (pretrained,) = runs["pretrain (train[:50%])"]
  tuned = runs["fine-tune (train[50%:])"]
  scratch = runs["from scratch (train[50%:])"]
  assert [e["step"] for e in tuned] == [0, 1]
  assert tuned[0]["loss"] == pretrained["loss"]  # The same model, evaluated.
  assert scratch[0]["step"] == 1  # A random init logs no step-0 evaluation.
  assert (
    "| fine-tune (train[50%:]) | 0 |" in (tmp_path / "finetune.md").read_text()
  )
