"""An evaluation-only run (issue 65, item 4; FTPipe's eval mode):
``train.steps=0`` evaluates the workdir's checkpoint (or the initial
params), prints and logs it, trains and saves nothing."""

import json
import os
import sys

import pytest

from jpipe.train import train_lib
from jpipe.train.errors import UsageError

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(__file__)))
sys.path.insert(0, os.path.join(ROOT, "configs"))
import default as default_config  # noqa: E402


def _config(steps):
  config = default_config.get_config()
  config.train.steps = steps
  config.train.eval_every = 4
  config.train.checkpoint_every = 4
  config.model.kwargs.hidden = (32, 32)
  config.pipeline.num_stages = 2
  config.data.batch_size = 32
  return config


def _rows(workdir):
  with open(os.path.join(workdir, "metrics.jsonl")) as f:
    return [json.loads(line) for line in f]


def test_a_checkpoint_evaluates_as_its_run_did(tmp_path, capsys):
  trained = train_lib.train_and_evaluate(_config(4), str(tmp_path))
  before = sorted(os.listdir(tmp_path / "checkpoints"))
  summary = train_lib.train_and_evaluate(_config(0), str(tmp_path))
  # The state the run evaluated at its end, evaluated again.
  assert summary["eval"] == pytest.approx(trained["eval"])
  out = capsys.readouterr().out
  assert "Evaluation of the checkpoint of step 4: eval accuracy" in out
  assert sorted(os.listdir(tmp_path / "checkpoints")) == before
  last = _rows(tmp_path)[-1]
  assert last == {
    "step": 4,
    **{f"eval/{k}": v for k, v in summary["eval"].items()},
  }


def test_without_a_checkpoint_the_initial_params_are_evaluated(
  tmp_path, capsys
):
  summary = train_lib.train_and_evaluate(_config(0), str(tmp_path))
  assert 0.0 <= summary["eval"]["accuracy"] <= 1.0
  assert "Evaluation of the initial params" in capsys.readouterr().out
  assert not os.path.exists(tmp_path / "checkpoints" / "0")
  assert _rows(tmp_path)[-1]["step"] == 0


def test_negative_steps_are_refused():
  config = _config(-1)
  with pytest.raises(UsageError, match=r"train.steps.*>= 0"):
    train_lib.train_and_evaluate(config, "/tmp/unused")
