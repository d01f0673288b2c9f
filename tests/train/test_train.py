"""The training CLI: runs, logs, resumes exactly, refuses bad input."""

import glob
import json
import os
import signal
import subprocess
import sys
import time

import pytest
import tensorflow_datasets as tfds

from jpipe.train import checkpoint as checkpoint_lib
from jpipe.train import train_lib

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(__file__)))
sys.path.insert(0, os.path.join(ROOT, "configs"))
import default as default_config  # noqa: E402

pytestmark = pytest.mark.usefixtures("fast_compiles")


def _config(**overrides):
  config = default_config.get_config()
  config.train.steps = 6
  config.train.log_every = 1
  config.train.eval_every = 3
  config.train.checkpoint_every = 3
  config.model.kwargs.hidden = (32, 32)
  config.pipeline.num_stages = 2
  config.data.batch_size = 32
  for key, value in overrides.items():
    node = config
    *path, last = key.split(".")
    for part in path:
      node = node[part]
    node[last] = value
  return config


def _losses(workdir):
  with open(os.path.join(workdir, "metrics.jsonl")) as f:
    rows = [json.loads(line) for line in f]
  return {r["step"]: r["loss"] for r in rows if "loss" in r}


def test_default_config_trains_logs_and_draws(tmp_path):
  summary = train_lib.train_and_evaluate(_config(), str(tmp_path))
  assert 0.0 <= summary["eval"]["accuracy"] <= 1.0
  assert sorted(_losses(tmp_path)) == [1, 2, 3, 4, 5, 6]
  assert glob.glob(str(tmp_path / "tensorboard" / "events.out.tfevents.*"))
  assert (tmp_path / "timeline.png").stat().st_size > 1000
  assert set(summary["stage_time_split"]) == {0, 1}
  assert os.listdir(tmp_path / "checkpoints") == ["3", "6"] or sorted(
    os.listdir(tmp_path / "checkpoints")
  ) == ["3", "6"]


def test_resume_follows_the_same_trajectory(tmp_path, capsys):
  straight = tmp_path / "straight"
  resumed = tmp_path / "resumed"
  train_lib.train_and_evaluate(_config(**{"train.steps": 6}), str(straight))
  train_lib.train_and_evaluate(_config(**{"train.steps": 3}), str(resumed))
  train_lib.train_and_evaluate(_config(**{"train.steps": 6}), str(resumed))
  assert "Resuming from step 3" in capsys.readouterr().out
  a, b = _losses(straight), _losses(resumed)
  for step in (4, 5, 6):
    assert a[step] == pytest.approx(b[step], rel=1e-6)


def test_a_different_partition_resumes_the_checkpoint(tmp_path):
  train_lib.train_and_evaluate(_config(**{"train.steps": 3}), str(tmp_path))
  config = _config(
    **{
      "train.steps": 5,
      "pipeline.num_stages": 3,
      "pipeline.partition": "pipedream_hybrid",
      "schedule.name": "async",
      "staleness.stashing": True,
    }
  )
  train_lib.train_and_evaluate(config, str(tmp_path))
  assert sorted(_losses(tmp_path)) == [1, 2, 3, 4, 5]


def test_async_with_every_mitigation_runs(tmp_path):
  config = _config(
    **{
      "schedule.name": "async",
      "pipeline.num_stages": 3,
      "pipeline.recompute": True,
      "staleness.stashing": True,
      "staleness.prediction": "msnag",
      "staleness.gap_aware": "ga",
    }
  )
  summary = train_lib.train_and_evaluate(config, str(tmp_path))
  assert summary["eval"]["accuracy"] is not None


def test_user_tfds_dataset_through_mock_data(tmp_path):
  config = _config(**{"data.name": "cifar10", "data.batch_size": 8})
  config.pipeline.num_microbatches = 2
  config.train.steps = 2
  with tfds.testing.mock_data(num_examples=16):
    summary = train_lib.train_and_evaluate(config, str(tmp_path))
  assert summary["eval"]["accuracy"] is not None


def test_missing_tfds_dataset_is_a_clear_error(tmp_path):
  config = _config(
    **{"data.name": "cifar10", "data.data_dir": str(tmp_path / "none")}
  )
  with pytest.raises(ValueError, match="tfds build cifar10"):
    train_lib.train_and_evaluate(config, str(tmp_path / "work"))


@pytest.mark.parametrize(
  "key, value, message",
  [
    ("schedule.name", "zb", "config.schedule.name: 'zb' is not one of"),
    ("pipeline.num_microbatches", 5, "5 does not divide data.batch_size"),
    ("staleness.stashing", True, "apply to schedule.name='async' only"),
    ("optimizer.name", "lion", "config.optimizer.name"),
    ("pipeline.bandwidth", -1.0, "config.pipeline.bandwidth: must be >= 0"),
    # async, no stashing, recompute False (the default): it would stash.
    ("schedule.name", "async", "config.pipeline.recompute: an async"),
  ],
)
def test_bad_config_values_fail_before_work(tmp_path, key, value, message):
  with pytest.raises(ValueError, match=message):
    train_lib.train_and_evaluate(_config(**{key: value}), str(tmp_path))
  assert not (tmp_path / "metrics.jsonl").exists()


def test_corrupt_or_foreign_checkpoint_is_an_error(tmp_path):
  train_lib.train_and_evaluate(_config(**{"train.steps": 3}), str(tmp_path))
  with pytest.raises(checkpoint_lib.CheckpointError, match="another model"):
    train_lib.train_and_evaluate(
      _config(**{"model.kwargs.hidden": (16, 16)}), str(tmp_path)
    )
  for path in glob.glob(
    str(tmp_path / "checkpoints" / "3" / "state" / "**"), recursive=True
  ):
    if os.path.isfile(path) and os.path.getsize(path) > 0:
      with open(path, "wb") as f:
        f.write(b"garbage")
  with pytest.raises(checkpoint_lib.CheckpointError, match="delete"):
    train_lib.train_and_evaluate(_config(), str(tmp_path))


def _cli(workdir, *overrides):
  return [
    sys.executable,
    "-m",
    "jpipe.train",
    "--config",
    os.path.join(ROOT, "configs", "default.py"),
    "--workdir",
    str(workdir),
    "--config.model.kwargs.hidden=(32,32)",
    "--config.pipeline.num_stages=2",
    "--config.train.log_every=1",
    *overrides,
  ]


def test_cli_rejects_unknown_key_and_wrong_type(tmp_path):
  env = dict(os.environ, PYTHONPATH=ROOT)
  for flag, message in [
    ("--config.train.stepz=3", "stepz"),
    ("--config.train.steps=many", "steps"),
  ]:
    result = subprocess.run(
      _cli(tmp_path, flag), capture_output=True, text=True, env=env
    )
    assert result.returncode != 0
    assert message in result.stderr
    assert not (tmp_path / "metrics.jsonl").exists()


@pytest.mark.slow
def test_kill_9_then_resume_matches_an_uninterrupted_run(tmp_path):
  env = dict(os.environ, PYTHONPATH=ROOT)
  steps = ["--config.train.steps=40", "--config.train.checkpoint_every=5"]
  straight = tmp_path / "straight"
  subprocess.run(
    _cli(straight, *steps), check=True, env=env, capture_output=True
  )
  killed = tmp_path / "killed"
  process = subprocess.Popen(
    _cli(killed, *steps),
    env=env,
    stdout=subprocess.DEVNULL,
    stderr=subprocess.DEVNULL,
  )
  deadline = time.time() + 300
  while time.time() < deadline:
    done = glob.glob(str(killed / "checkpoints" / "1[05]"))
    if done:
      break
    time.sleep(0.05)
  process.send_signal(signal.SIGKILL)
  process.wait()
  result = subprocess.run(
    _cli(killed, *steps), env=env, capture_output=True, text=True
  )
  assert result.returncode == 0, result.stderr
  assert "Resuming from step" in result.stdout
  a, b = _losses(straight), _losses(killed)
  for step in range(36, 41):
    assert a[step] == pytest.approx(b[step], rel=1e-6)
