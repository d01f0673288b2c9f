"""A user's mistakes are each one line before any work (issue 68, 2): more
stages than the model has nodes, text files that cannot make one
sequence, a model whose outputs do not fit the task."""

import os

import pytest

from jpipe.train import plan as plan_cli
from jpipe.train import train_lib
from jpipe.train.errors import UsageError
from tests.train.test_train import ROOT, default_config


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
  config.pipeline.depth = 1
  with pytest.raises(UsageError, match="cannot split 5 nodes into 6 stages"):
    train_lib.train_and_evaluate(config, str(tmp_path / "b"))
