"""A user's mistakes are each one line before any work (issue 68, 2): more
stages than the model has nodes, text files that cannot make one
sequence, a model whose outputs do not fit the task."""

import os

import flax.linen as nn
import pytest

from configs import default as default_config
from configs import gpt_lm
from jpipe.train import input_pipeline, tasks, train_lib
from jpipe.train import plan as plan_cli
from jpipe.train.errors import UsageError
from tests.train.test_train import ROOT


def _one_line(err) -> str:
  message = str(err.value)
  assert "\n" not in message
  return message


def test_more_stages_than_nodes_is_the_plan_clis_line(tmp_path, capsys):
  """The train CLI refuses 6 stages of the 5-node default model with the
  line ``python -m jpipe.train.plan`` prints (was a traceback); so does a
  fixed trace depth (the solver's line)."""
  config_file = os.path.join(ROOT, "configs", "default.py")
  assert plan_cli.main(["--config", config_file, "--stages", "6"]) == 2
  plan_line = capsys.readouterr().err.strip()
  assert plan_line.startswith("error: cannot split the model into 6 stages")
  config = default_config.get_config()
  config.pipeline.num_stages = 6
  with pytest.raises(UsageError) as err:
    train_lib.train_and_evaluate(config, str(tmp_path / "a"))
  assert f"error: {_one_line(err)}" == plan_line
  # jpipe's MLP: more layers, not the partitioner's fixes for a model of
  # one's own (named scopes, opened control flow).
  assert plan_line.endswith(
    "use at most 5 stages, or more layers (config.model.kwargs.hidden="
    "(128, 128, 128, 128) now: a width per hidden layer)"
  ), plan_line
  config.pipeline.depth = 1
  with pytest.raises(UsageError, match="cannot split 5 nodes into 6 stages"):
    train_lib.train_and_evaluate(config, str(tmp_path / "b"))


@pytest.mark.parametrize(
  "name, kwargs, want",
  [
    ("gpt", {}, ", or a deeper model (config.model.kwargs.num_layers=4 now)"),
    ("resnet", {"depth": 10}, "(config.model.kwargs.depth=10 now)"),
    ("mlp", {"hidden": (8,)}, "(config.model.kwargs.hidden=(8,) now: a width"),
    ("flax.linen:Dense", {"features": 3}, None),  # A model of the user's.
  ],
)
def test_too_few_nodes_in_a_jpipe_model_says_which_field_adds_layers(
  name, kwargs, want
):
  from jpipe import partition

  config = default_config.get_config()
  config.model.name = name
  config.model.kwargs = kwargs
  error = partition.TooFewNodes("cause; fixes", "cause", 3)
  line = tasks.too_few_nodes(config, error)
  if want is None:
    assert line == "cause; fixes"
  else:
    assert line.startswith("cause; use at most 3 stages, or ") and want in line


def _text_files_config(tmp_path, train, test):
  """A byte-level GPT on text files ``train`` / ``test`` (bytes, written
  to tmp_path), 16-byte sequences."""
  config = gpt_lm.get_config()
  config.data.name = input_pipeline.TEXT_FILES
  for key, name, data in (
    ("train", "train.txt", train),
    ("eval", "eval.txt", test),
  ):
    if data is not None:
      (tmp_path / name).write_bytes(data)
    config.data[f"{key}_split"] = str(tmp_path / name)
  config.data.sequence_length = 16
  config.model.kwargs.update(width=8, num_layers=1, num_heads=1, max_length=16)
  return config


TEXT = b"the quick brown fox jumps over the lazy dog. " * 4


@pytest.mark.parametrize(
  "train, test, match",
  [
    (TEXT, b"", r"eval_split: \S*eval.txt is empty \(0 bytes\)"),
    (b"", TEXT, r"train_split: \S*train.txt is empty \(0 bytes\)"),
    (
      b"hello",
      TEXT,
      r"train_split='\S*train.txt' holds 5 bytes, 5 tokens \(bytes\): "
      r"fewer than the 17 of one sequence at config.data.sequence_length=16;",
    ),
    (
      TEXT,
      b"0123456789abcdef",
      r"eval_split='\S*eval.txt' holds 16 bytes, 16 tokens .* fewer than "
      "the 17",
    ),
    (TEXT, None, r"eval_split: \S*eval.txt is a directory; name the text"),
    (
      TEXT[:20] + b"\x1f\x8b\x08" + TEXT,
      TEXT,
      r"train.txt is not UTF-8 text \(byte 21 of 203: b'\\x8b\\x08th'\)",
    ),
  ],
  ids=["empty eval", "empty train", "tiny train", "tiny eval", "dir", "binary"],
)
def test_text_files_that_cannot_serve_are_refused_when_opened(
  tmp_path, train, test, match
):
  """Each as the data is read, before the model is initialised (was: a
  traceback from the batch or evaluation windows -- the CLI's, after
  training, where the evaluation came late; a binary file trained on
  unnoticed)."""
  if test is None:
    (tmp_path / "eval.txt").mkdir()
  config = _text_files_config(tmp_path, train, test)
  with pytest.raises(UsageError, match=match) as err:
    tasks.build_task(config)
  _one_line(err)


def test_utf8_is_checked_across_blocks(tmp_path, monkeypatch):
  """A large file is decoded block by block: a character split by a
  block's end is UTF-8, and a bad byte's offset is the file's."""
  monkeypatch.setattr(input_pipeline, "_BLOCK", 4)
  path = tmp_path / "a.txt"
  path.write_bytes("abc\u00e9d\u20ac".encode())  # é, € straddle blocks.
  assert input_pipeline._text_file("k", str(path)) == path.read_bytes()
  path.write_bytes("abc\u00e9d\u20ac".encode() + b"\xffz")
  with pytest.raises(UsageError, match=r"not UTF-8 text \(byte 9 of 11:"):
    input_pipeline._text_file("k", str(path))
  path.write_bytes("abc\u20ac".encode()[:-1])  # Cut inside its last one.
  with pytest.raises(UsageError, match=r"\(byte 3 of 5:"):
    input_pipeline._text_file("k", str(path))


class Logits(nn.Module):
  """A user's module: ``outputs`` scores per image (rank 2), flattened to
  rank 1 (``flat``), or per byte of a sequence (``per_token``)."""

  outputs: int = 7
  flat: bool = False
  per_token: bool = False

  @nn.compact
  def __call__(self, x):
    if self.per_token:
      return nn.Dense(self.outputs)(nn.Embed(256, 8)(x))
    out = nn.Dense(self.outputs)(x.reshape(x.shape[0], -1))
    return out.reshape(-1) if self.flat else out


HERE = "tests.train.test_bad_inputs"


@pytest.mark.parametrize(
  "model, kwargs, match",
  [
    (
      f"{HERE}:Logits",
      {},
      rf"config.model \({HERE}:Logits\) gives logits of shape \(1, 7\) for 1 "
      r"image; classifying digits needs \[batch, classes\] = \[1, 10\] \(its "
      rf"labels run 0..9\): give {HERE}:Logits 10 outputs, one per class",
    ),
    (f"{HERE}:Logits", {"flat": True}, r"gives logits of shape \(7,\)"),
    ("mlp", {"num_classes": 7}, r"set config.model.kwargs.num_classes=10$"),
  ],
  ids=["7 classes", "rank 1", "jpipe's mlp"],
)
def test_a_classifier_with_the_wrong_logits_is_refused_at_build(
  model, kwargs, match
):
  """Too few classes trained to a non-finite loss ("lower the learning
  rate": the wrong cause); a rank-1 output failed inside optax."""
  config = default_config.get_config()
  config.model.name = model
  config.model.kwargs = kwargs
  with pytest.raises(UsageError, match=match) as err:
    tasks.build_task(config)
  _one_line(err)
  config.model.kwargs = {"outputs": 12} if model != "mlp" else {}
  tasks.build_task(config)  # More outputs than classes: fine.


def test_a_language_model_with_too_few_logits_is_refused_at_build(tmp_path):
  config = _text_files_config(tmp_path, TEXT, TEXT)
  config.model.name = f"{HERE}:Logits"
  config.model.kwargs = {"outputs": 100, "per_token": True}
  with pytest.raises(
    UsageError,
    match=r"gives logits of shape \(1, 16, 100\) for 1 sequence of 16 tokens; "
    r"a language model needs \[batch, length, vocab\] = \[1, 16, 256\] "
    r"\(bytes ids run 0..255\): give \S+ 256 outputs per token",
  ) as err:
    tasks.build_task(config)
  _one_line(err)
  config.model.kwargs = {"outputs": 256, "per_token": True}
  tasks.build_task(config)


def test_an_optimizer_that_cannot_run_per_stage_is_one_line(tmp_path):
  """optax.lbfgs reads the loss at each update, which a stage steps
  without: refused at the pipeline's build, before any program compiles,
  as the config's line (was a TypeError's traceback at the first step)."""
  config = default_config.get_config()
  config.optimizer.name = "lbfgs"
  with pytest.raises(
    UsageError, match=r"^config.optimizer.name='lbfgs': the optimizer's"
  ) as err:
    train_lib.train_and_evaluate(config, str(tmp_path))
  assert "read the loss (value=)" in _one_line(err)
