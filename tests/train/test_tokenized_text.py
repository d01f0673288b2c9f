"""Text tasks on a tokenizer file's ids (config.data.tokenizer): the
language model on a SentencePiece model's, span corruption on a
HuggingFace tokenizer.json's; errors before any work."""

import numpy as np
import pytest

from jpipe.data import sequences, tokenizers
from jpipe.train import config_check, run, tasks, train_lib
from jpipe.train.errors import UsageError
from tests.data import tokenizer_files
from tests.train.test_configs import _get_config, _short


@pytest.fixture(scope="module")
def files(tmp_path_factory):
  directory = str(tmp_path_factory.mktemp("tokenizers"))
  return {
    "sentencepiece": tokenizer_files.sentencepiece_model(directory),
    "huggingface": tokenizer_files.huggingface_json(directory),
  }


def _smaller(config):
  """The tokenizer is under test, not the pipeline: 2 stages, 2 layers,
  a tenth of the corpus to encode."""
  config.data.train_split = "train[:10%]"
  config.pipeline.num_stages = 2
  config.pipeline.num_microbatches = 2
  config.model.kwargs.num_layers = 2
  return config


def _lm_config(path, vocab=tokenizer_files.VOCAB):
  config = _smaller(_short(_get_config("gpt_lm")))
  config.data.tokenizer = path
  config.data.sequence_length = 32
  config.model.kwargs.vocab_size = vocab
  return config


@pytest.mark.slow
def test_language_model_on_sentencepiece_ids(files, tmp_path):
  """The windows are the tokenizer's ids of the text (a window decodes
  to a piece of the corpus); the CLI trains and evaluates on them."""
  path = files["sentencepiece"]
  config = _lm_config(path)
  task = tasks.build_task(config)
  batch = task.batch_at(0)
  tok = tokenizers.load(path)
  assert batch["x"].max() < tok.vocab_size
  np.testing.assert_array_equal(batch["x"][:, 1:], batch["y"][:, :-1])
  piece = tok.decode(batch["x"][0][batch["x"][0] != tok.end_id])
  corpus = " ".join(tokenizer_files.training_texts(400).__iter__())
  assert " ".join(piece.split()[1:-1]) in " ".join(corpus.split())
  summary = train_lib.train_and_evaluate(config, str(tmp_path))
  assert np.isfinite(summary["eval"]["perplexity"])
  # A resume checks the tokenizer by its contents: the same file moved is
  # the same model; other contents at the same path are not.
  identity = run.fingerprint(config)["tokenizer"]
  assert identity.startswith("sha256:") and path not in identity
  moved = tmp_path / "moved.model"
  moved.write_bytes(open(path, "rb").read())
  config.data.tokenizer = str(moved)
  assert run.fingerprint(config)["tokenizer"] == identity
  moved.write_bytes(open(files["huggingface"], "rb").read())
  assert run.fingerprint(config)["tokenizer"] != identity


@pytest.mark.slow
def test_span_corruption_on_huggingface_ids(files, tmp_path):
  """Sentinels come after the tokenizer's ids (shifted by one: its id 0
  is a token, 0 pads)."""
  path = files["huggingface"]
  config = _smaller(_short(_get_config("t5")))
  config.data.tokenizer = path
  _, spans, _, _ = sequences.span_lengths(
    config.data.sequence_length,
    config.data.noise_density,
    config.data.mean_span_length,
  )
  first_sentinel = tokenizer_files.VOCAB + 1
  config.model.kwargs.vocab_size = first_sentinel + spans
  task = tasks.build_task(config)
  batch = task.batch_at(0)
  sentinels = batch["inputs"][batch["inputs"] >= first_sentinel]
  assert len(sentinels) and sentinels.max() < first_sentinel + spans
  summary = train_lib.train_and_evaluate(config, str(tmp_path))
  assert np.isfinite(summary["eval"]["loss"])
  config.model.kwargs.vocab_size = first_sentinel + spans - 1
  with pytest.raises(UsageError, match=f"use >= {first_sentinel + spans}"):
    tasks.build_task(config)


def test_too_small_a_vocabulary_or_a_bad_file_fails_before_work(files):
  config = _lm_config(files["sentencepiece"], vocab=256)
  with pytest.raises(UsageError, match="cannot hold the 320 ids"):
    tasks.build_task(config)
  config = _lm_config("/no/such/spiece.model")
  with pytest.raises(UsageError, match="config.data.tokenizer: no tokenizer"):
    config_check.check(config)
