"""Every config in configs/ (and its variants) trains a few steps."""

import json
import math
import os
import signal
import subprocess
import sys

import numpy as np
import pytest
import tensorflow_datasets as tfds

from jpipe.train import (
  base_config,
  config_check,
  config_options,
  config_plan,
  stopping,
  tasks,
  train_lib,
)

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(__file__)))
CONFIG_DIR = os.path.join(ROOT, "configs")
CONFIGS = sorted(f[:-3] for f in os.listdir(CONFIG_DIR) if f.endswith(".py"))


def _get_config(name, *variant):
  """The config as the CLIs load it, unlocked so tests may add kwargs."""
  path = os.path.join(CONFIG_DIR, f"{name}.py")
  config = config_plan.load_config_file(":".join([path, *variant]))
  config.unlock()
  return config


def _short(config):
  config.train.steps = 2
  config.train.log_every = 1
  config.train.eval_every = 2
  config.train.checkpoint_every = 2
  config.train.profile_last_step = False
  if "eval_sequences" in config.data:
    config.data.eval_sequences = 8
  return config


# Configs that are image seeds' :small variants (configs/seeds/).
SEED_SMALLS = (
  "wrn_stale",
  "pipedream_vgg",
  "pipedream_resnet",
  "sdpipe",
  "dynpipe",
)


def test_the_configs_are_the_ones_the_issue_names():
  assert set(CONFIGS) >= {
    "default",
    "wrn_stale",
    "pipedream_vgg",
    "pipedream_resnet",
    "gpt_lm",
    "t5",
  }


@pytest.mark.parametrize(
  "name, variant",
  # (gpt_finetune needs a pretrained run: test_finetune_experiment;
  # text_tasks a TFDS dataset: test_text_tasks, on mock data; the image
  # seeds' :small variants -- these configs -- train 40 steps in
  # tests/train/test_seed_plans.py.)
  [
    (name, ())
    for name in CONFIGS
    if name not in ("gpt_finetune", "text_tasks", *SEED_SMALLS)
  ]
  + [
    ("wrn_stale", ("ws+wp+ga",)),
    ("wrn_stale", ("ws+pm+dnag",)),
    ("pipedream_vgg", ("2bw",)),
    ("pipedream_resnet", ("1f1b",)),
  ],
)
@pytest.mark.slow
def test_config_trains_and_evaluates(tmp_path, name, variant):
  config = _get_config(name, *variant)
  config_check.check(config)
  summary = train_lib.train_and_evaluate(_short(config), str(tmp_path))
  assert summary["eval"], summary
  for value in summary["eval"].values():
    assert math.isfinite(value)
  if "perplexity" in summary["eval"]:
    # Two steps from random init: below the uniform distribution's.
    assert summary["eval"]["perplexity"] < 400


def test_every_config_documents_its_run_command_and_result():
  for name in CONFIGS:
    with open(os.path.join(CONFIG_DIR, f"{name}.py")) as f:
      source = f.read()
    assert f"--config configs/{name}.py" in source, name
    assert "Expected:" in source, name


def test_variants_without_stashing_recompute():
  """A stale / wp / ga variant recomputes at the current params unless
  it asks for FTPipe's nr; ws variants keep residuals."""
  for variant, recompute in (
    ("stale", True),
    ("wp+ga", True),
    ("ws", False),
    ("stale+nr", False),
    ("wp+nr", False),
  ):
    config = _get_config("wrn_stale", variant)
    assert config.pipeline.recompute == recompute, variant
    config_check.check(config)
    value = config_options.staleness(config, 0.1)
    assert value.residuals_from_current_params("async") == ("nr" in variant)


def _assert_nesterov_sgd_step(tx, lr, mu):
  """``tx`` is Nesterov momentum SGD (rate ``lr``, momentum ``mu``):
  v = mu v + g, update -lr (g + mu v), restated on one step from v = 0."""
  g = {"w": np.array([1.0, -2.0])}
  updates, _ = tx.update(g, tx.init(g), g)
  np.testing.assert_allclose(updates["w"], -lr * (g["w"] + mu * g["w"]))


def test_ftpipe_variant_options_reach_the_pipeline():
  config = _get_config("wrn_stale", "wp+nag+nesterov")
  config_check.check(config)
  value = config_options.staleness(config, 0.1)
  assert value.nag_with_predictor and value.prediction == "msnag"
  # Nesterov momentum SGD on the last stage (weight decay off).
  config.optimizer.weight_decay = 0.0
  value = config_options.staleness(config, 0.1)
  _assert_nesterov_sgd_step(value.last_stage_optimizer, 0.1, 0.9)
  config = _get_config("wrn_stale", "wp+nag+nesterov")
  config.optimizer.name = "adam"
  with pytest.raises(ValueError, match="nesterov_last_stage"):
    config_check.check(config)
  config = _get_config("wrn_stale", "stale+nag")
  with pytest.raises(ValueError, match="nag_with_predictor"):
    config_check.check(config)
  # FTPipe's virtual_stages_1f1b cap, by config.
  config = _get_config("wrn_stale", "stale")
  for text, value in (("", None), ("auto", "auto"), ("4", 4)):
    config.schedule.supremum_staleness = text
    config_check.check(config)
    assert config_options.staleness(config).supremum_staleness == value
  config.schedule.supremum_staleness = "some"
  with pytest.raises(ValueError, match="supremum_staleness 'some'"):
    config_check.check(config)
  config = _get_config("wrn_stale", "gpipe")
  config.schedule.supremum_staleness = "auto"
  with pytest.raises(ValueError, match="supremum_staleness caps"):
    config_check.check(config)


def test_delay_correction_variants_reach_the_pipeline():
  config = _get_config("wrn_stale", "ws+pm+dnag")
  config_check.check(config)
  value = config_options.staleness(config, 0.1)
  optimizer_steps = config.train.steps * config_options.steps_per_call(config)
  assert value.pipemare_anneal_steps == optimizer_steps // 4
  assert value.weight_stashing
  # Stage of delay 2 of 4 with momentum SGD (0.9): Nesterov SGD with the
  # authors' adaptive momentum 0.9 + 2 (0.99 - 0.9) / 4.
  assert config.optimizer.name == "sgd" and config.optimizer.momentum == 0.9
  config.optimizer.weight_decay = 0.0
  tx = config_options.staleness(config, 0.1).stage_optimizer(2, 4)
  _assert_nesterov_sgd_step(tx, 0.1, 0.9 + 2 * (0.99 - 0.9) / 4)
  config = _get_config("wrn_stale", "ws+dnag")
  config.staleness.delay_nesterov = "fixed"
  with pytest.raises(ValueError, match="use 'adaptive'"):
    config_check.check(config)
  config = _get_config("wrn_stale", "wp+pm")
  with pytest.raises(ValueError, match="prediction replays"):
    config_check.check(config)
  config = _get_config("wrn_stale", "gpipe")
  config.staleness.pipemare_anneal_steps = 100
  with pytest.raises(ValueError, match=r"pipemare_anneal_steps'\] apply to"):
    config_check.check(config)


def test_unknown_variant_is_a_clear_error():
  with pytest.raises(ValueError, match="unknown config variant 'wz'"):
    base_config.apply_variant(base_config.base_config(), "wz")


def test_a_config_without_data_or_with_a_misspelled_field_is_named():
  """``base_config()`` alone has no data section; a field set in a file
  under a name jpipe does not know would be ignored: each refused in one
  line naming the fix (model.kwargs is the model's own: free)."""
  with pytest.raises(
    ValueError, match=r"has no data: .* \(c.data = image_data"
  ):
    config_check.check(base_config.base_config())
  config = _get_config("default")
  config.model.kwargs.anything = 1
  config_check.check(config)
  config.train.stepz = 5
  config.pipeline.shedule = "1f1b"
  with pytest.raises(
    ValueError,
    match=r"know: pipeline.shedule; train.stepz \(did you mean train.steps\?\)",
  ):
    config_check.check(config)


def test_too_small_t5_vocabulary_is_a_clear_error(tmp_path):
  config = _short(_get_config("t5"))
  config.model.kwargs.vocab_size = 260
  with pytest.raises(ValueError, match="vocab_size=260 cannot hold"):
    train_lib.train_and_evaluate(config, str(tmp_path))


@pytest.mark.slow
def test_cli_takes_a_config_variant(tmp_path):
  result = subprocess.run(
    [
      sys.executable,
      "-m",
      "jpipe.train",
      "--config",
      os.path.join(CONFIG_DIR, "wrn_stale.py") + ":ws+ga",
      "--workdir",
      str(tmp_path),
      "--config.train.steps=1",
      "--config.train.profile_last_step=False",
      "--config.pipeline.num_stages=2",
    ],
    capture_output=True,
    text=True,
    env=dict(os.environ, PYTHONPATH=ROOT),
  )
  assert result.returncode == 0, result.stderr[-3000:]
  assert "schedule async" in result.stdout
  assert "eval accuracy" in result.stdout


@pytest.mark.slow
def test_user_tfds_text_dataset_through_mock_data(tmp_path):
  config = _short(_get_config("gpt_lm"))
  # (The data's path is under test: the smallest model that splits in 2.)
  config.model.kwargs.update({"width": 32, "num_layers": 2})
  config.data.name = "lm1b"
  config.data.sequence_length = 16
  config.data.batch_size = 8
  config.pipeline.num_stages = 2
  with tfds.testing.mock_data(num_examples=40):
    summary = train_lib.train_and_evaluate(config, str(tmp_path))
  assert math.isfinite(summary["eval"]["perplexity"])


def _losses(workdir):
  with open(os.path.join(workdir, "metrics.jsonl")) as f:
    rows = [json.loads(line) for line in f]
  return {r["step"]: r["train/loss"] for r in rows if "train/loss" in r}


class _StopAfter(stopping.StopRequest):
  """A SIGTERM that arrives during step ``steps`` (in-process)."""

  def __init__(self, steps):
    super().__init__()
    self._checks = steps

  @property
  def signal(self):
    self._checks -= 1
    return "SIGTERM" if self._checks <= 0 else None

  @signal.setter
  def signal(self, value):
    del value


@pytest.mark.slow
def test_async_adamw_prediction_run_resumes_on_its_trajectory(
  tmp_path, monkeypatch
):
  """Adam moments, the learning-rate schedule's step, the asynchronous
  pipeline's weight-prediction state and dropout's randomness all come
  back from the checkpoint a SIGTERM leaves. The stream drains before
  every checkpoint, so the uninterrupted run checkpoints (and drains) at
  the step the signal arrives too."""
  config = _short(_get_config("gpt_lm"))
  config.model.kwargs.dropout = 0.1
  config.model.kwargs.width = 32
  config.model.kwargs.num_layers = 2
  config.data.sequence_length = 16
  config.data.batch_size = 8
  config.train.steps = 4
  config.train.checkpoint_every = 2
  config.optimizer.warmup_steps = 4
  straight, resumed = tmp_path / "straight", tmp_path / "resumed"
  train_lib.train_and_evaluate(config, str(straight))
  monkeypatch.setattr(stopping, "StopRequest", lambda: _StopAfter(2))
  with pytest.raises(SystemExit) as stopped:
    train_lib.train_and_evaluate(config, str(resumed))
  # Not finished: a scheduler must not take it for a finished job.
  assert stopped.value.code == 128 + signal.SIGTERM
  assert os.listdir(resumed / "checkpoints") == ["2"]
  assert sorted(os.listdir(straight / "checkpoints")) == ["2", "4"]
  monkeypatch.undo()
  train_lib.train_and_evaluate(config, str(resumed))
  a, b = _losses(straight), _losses(resumed)
  for step in (1, 2, 3, 4):
    assert a[step] == pytest.approx(b[step], rel=1e-6)


@pytest.mark.slow
def test_dropout_keys_ride_in_the_batch_and_change_the_loss():
  config = _short(_get_config("gpt_lm"))
  config.model.kwargs.update({"width": 32, "num_layers": 1})
  config.data.sequence_length = 16
  plain = tasks.build_task(config)
  config.model.kwargs.dropout = 0.3
  task = tasks.build_task(config)
  batch = task.batch_at(5)
  assert batch["dropout_key"].shape == (32, 2)
  assert not np.array_equal(
    batch["dropout_key"], task.batch_at(6)["dropout_key"]
  )
  np.testing.assert_array_equal(
    batch["dropout_key"], task.batch_at(5)["dropout_key"]
  )
  # Same params and tokens: dropout masks change the loss, per key.
  loss = float(task.loss_fn(task.params, batch))
  assert loss != float(plain.loss_fn(task.params, plain.batch_at(5)))
  other = dict(batch, dropout_key=task.batch_at(6)["dropout_key"])
  assert loss != float(task.loss_fn(task.params, other))
  assert loss == float(task.loss_fn(task.params, batch))


def test_gpu_command_buffers_config_reaches_the_pipeline_keywords():
  config = _get_config("wrn_stale", "stale")
  for text, value in (("auto", None), ("on", True), ("off", False)):
    config.pipeline.gpu_command_buffers = text
    config_check.check(config)
    assert config_options.command_buffers(text) is value
  config.pipeline.gpu_command_buffers = "yes"
  with pytest.raises(ValueError, match="gpu_command_buffers: 'yes'"):
    config_check.check(config)
