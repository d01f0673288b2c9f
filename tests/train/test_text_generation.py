"""Generated-text metrics of the text-to-text tasks (T5 v1): through the
pipeline's stages they equal the one-device greedy loop's; the true
targets score 100."""

import dataclasses
import math

import jax
import ml_collections
import numpy as np
import optax
import pytest
import tensorflow_datasets as tfds

import jpipe
from jpipe.data import text_examples
from jpipe.train import (
  config_plan,
  evaluation,
  input_pipeline,
  tasks,
  text_generation,
  text_metrics,
  train_lib,
)
from tests.tiers import slow
from tests.train.test_text_tasks import _config, _mock, _translation_records

GENERATED = {
  "classification": {"generated_accuracy"},
  "qa": {"generated_exact_match", "generated_f1"},
  "translation": {"bleu"},
}


def _t5_config(fmt):
  c = _config(fmt, "t5_v1")
  c.data.target_length = 8
  c.model.kwargs = ml_collections.ConfigDict(
    dict(
      vocab_size=257,
      d_model=32,
      d_kv=8,
      d_ff=32,
      num_layers=2,
      num_heads=2,
      dropout=0.0,
      version="1.1",  # (v1.0's tied head continues one token at init.)
    )
  )
  return c


@pytest.mark.parametrize(
  "fmt", [slow("qa"), slow("translation"), slow("classification")]
)
def test_generated_metrics_through_stages_equal_one_device(fmt):
  config = _t5_config(fmt)
  with _mock(fmt, train=16, test=12):
    task = tasks.build_task(config)
  params = task.params
  # The generated tokens are recorded as they are scored (one decoding
  # each way).
  rows, generation = [], task.evaluation.generation
  recording = dataclasses.replace(
    task.evaluation,
    generation=dataclasses.replace(
      generation, score=lambda r: rows.append(r) or generation.score(r)
    ),
  )
  one = recording.on_one_device(params, None)
  assert GENERATED[fmt] <= set(one)
  pipe = jpipe.Pipeline(
    task.loss_fn,
    task.params,
    task.batch_at(0),
    num_stages=2,
    num_microbatches=2,
    optimizer=optax.sgd(0.0),
    devices=jax.devices()[:2],
  )
  state = pipe.init(params)
  staged = evaluation.through_pipeline(pipe, state, recording)
  for name in GENERATED[fmt]:
    assert math.isfinite(staged[name])
    assert staged[name] == pytest.approx(one[name], abs=1e-9), name
  # The generated tokens themselves (an untrained model scores about 0
  # both ways): the same rows, and varied.
  assert len(rows) == 2
  np.testing.assert_array_equal(rows[0], rows[1])
  assert rows[0].shape[0] == 12 and len(np.unique(rows[0])) > 2


def _true_targets(config, fmt):
  with _mock(fmt, train=16, test=12):
    task = tasks.build_task(config)
  generation = task.evaluation.generation
  targets = np.concatenate([b["targets"] for b in task.evaluation.batches()])
  return generation, targets[: len(generation.prompts)]


@pytest.mark.parametrize("fmt", ["qa", "classification"])
def test_the_true_targets_score_100(fmt):
  """The score of the targets' own ids (as the decoder would write them,
  end included): the decoding of ids to text and the metric agree."""
  config = _t5_config(fmt)
  config.data.target_length = 16  # Whole targets: nothing cut.
  generation, targets = _true_targets(config, fmt)
  scores = generation.score(targets)
  assert set(scores) == GENERATED[fmt]
  assert all(v == pytest.approx(100.0) for v in scores.values()), scores
  # And an empty answer (the end first) lowers them.
  wrong = targets.copy()
  wrong[0] = generation.eos_id
  assert min(generation.score(wrong).values()) < 100.0


def test_translation_targets_decode_to_the_references():
  """BLEU's input: the targets' ids decode to the records' English (the
  mock's sentences have 3 words, too short for BLEU-4 to score), and
  BLEU of the decoded targets against those references is BLEU of the
  references against themselves."""
  config = _t5_config("translation")
  config.data.target_length = 16
  generation, targets = _true_targets(config, "translation")
  encoder = text_examples.Encoder(input_pipeline.tokenizer(config))
  want = [r["en"] for r in _translation_records(12, 1)]
  assert [text_generation.text_of(encoder, row) for row in targets] == want
  assert generation.score(targets) == text_metrics.bleu(want, want)


@pytest.mark.slow
def test_ftpipe_t5_squad_seed_reports_generated_exact_match_and_f1(tmp_path):
  """ftpipe_t5_3b.py:squad's own path (T5 v1 text-to-text, the mixed
  pipe with its 32 blocks -- 14 stages on 2 devices, cut inside layers --,
  async) at a size for 2 CPU cores on mock SQuAD records: its evaluation
  reports SQuAD's exact match and F1 of generated answers."""
  config = _shrunk_seed(
    "configs/seeds/ftpipe_t5_3b.py:squad", _t5_config("qa").model.kwargs, 48, 8
  )
  with _mock("qa", train=16, test=12):
    summary = train_lib.train_and_evaluate(config, str(tmp_path))
  for name in ("generated_exact_match", "generated_f1"):
    assert 0.0 <= summary["eval"][name] <= 100.0


@pytest.mark.slow
def test_pipedream_gnmt16_seed_reports_bleu(tmp_path):
  """pipedream_gnmt16.py's own path (GNMT, PipeDream's straight split) at
  a small size on mock WMT16 records, evaluated once (``train.steps=0``:
  its training, async 1F1B with stashing, is the :small variant's in
  test_seed_plans): BLEU of the translations generated through the
  stages."""
  config = _shrunk_seed(
    "configs/seeds/pipedream_gnmt16.py",
    dict(vocab_size=257, hidden=32, num_layers=2, dropout=0.0),
    32,
    16,
  )
  config.train.steps = 0
  rng = np.random.default_rng(0)
  words = "red green blue cyan gold pink gray jade".split()

  def records(n):
    out = []
    for _ in range(n):
      en = list(rng.choice(words, size=5))
      out.append({"en": " ".join(en), "de": " ".join(en[::-1])})
    return out

  by_split = {"train": records(16), "validation": records(12)}
  by_split["test"] = by_split["validation"]

  def as_data_source(builder, split, **kwargs):
    del builder, kwargs
    return by_split[str(split)]

  with tfds.testing.mock_data(as_data_source_fn=as_data_source):
    summary = train_lib.train_and_evaluate(config, str(tmp_path))
  assert 0.0 <= summary["eval"]["bleu"] <= 100.0


def _shrunk_seed(path, model_kwargs, sequence_length, target_length):
  """The seed config at ``path`` (its own task, schedule and partition) at
  a size for 2 CPU cores: the given model, 8 examples a step in 2
  microbatches over 2 stages, two steps then an evaluation."""
  config = config_plan.load_config_file(path)
  config.unlock()
  config.model.size = ""
  config.model.kwargs = ml_collections.ConfigDict(dict(model_kwargs))
  config.data.sequence_length = sequence_length
  config.data.target_length = target_length
  config.data.batch_size = 8
  config.pipeline.num_stages = 2
  config.pipeline.num_microbatches = 2
  config.pipeline.memory_limit = ""
  config.train.steps = 2
  config.train.eval_every = 2
  config.train.checkpoint_every = 2
  config.train.profile_last_step = False
  return config
