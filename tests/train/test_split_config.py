"""Plans from the config (issue 65, item 2): ``pipeline.split`` and
``pipeline.replicas`` give the plan training builds and the plan CLI
prints, recorded in plan.json; their mistakes are one line."""

import json
import os
import sys

import pytest

from jpipe.train import config_check, config_plan, tasks, train_lib
from jpipe.train import plan as plan_cli
from jpipe.train.errors import UsageError

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(__file__)))
sys.path.insert(0, os.path.join(ROOT, "configs"))
import default as default_config  # noqa: E402


def _config(split="1,2", replicas="1,2", **overrides):
  config = default_config.get_config()
  config.model.kwargs.hidden = (32, 32)  # 3 nodes: layer_0, layer_1, head.
  config.pipeline.num_stages = 2
  config.pipeline.split = split
  config.pipeline.replicas = replicas
  config.train.steps = 2
  config.data.batch_size = 32
  config.update_from_flattened_dict(overrides)
  return config


def test_training_builds_the_split_and_records_it(tmp_path):
  train_lib.train_and_evaluate(_config(), str(tmp_path))
  plan = json.loads((tmp_path / "plan.json").read_text())
  assert plan["method"] == "split"
  assert plan["stage_of_node"] == [0, 1, 1]
  assert plan["stage_devices"] == [[0], [1, 2]]


def test_the_plan_cli_prints_the_config_split(capsys, tmp_path):
  path = tmp_path / "split_config.py"
  path.write_text(
    "import sys\n"
    f"sys.path.insert(0, {os.path.join(ROOT, 'configs')!r})\n"
    "import default\n\n\n"
    "def get_config():\n"
    "  c = default.get_config()\n"
    "  c.model.kwargs.hidden = (32, 32)\n"
    "  c.pipeline.num_stages = 2\n"
    "  c.pipeline.split = '2,1'\n"
    "  return c\n"
  )
  assert plan_cli.main(["--config", str(path), "--json"]) == 0
  result = json.loads(capsys.readouterr().out)
  assert result["method"] == "split"
  assert result["plan"]["stage_of_node"] == [0, 0, 1]
  # What training would build from the same config.
  config = config_plan.load_config_file(str(path))
  task = tasks.build_task(config)
  lr = train_lib.learning_rate(config)
  pipe = train_lib.build_pipeline(
    config, task, task.batch_at(0), train_lib.build_optimizer(config, lr), lr
  )
  assert list(pipe.plan.stage_of_node) == result["plan"]["stage_of_node"]


@pytest.mark.parametrize(
  "fields, match",
  [
    ({"pipeline.num_stages": 3}, "the split nodes 1-2, replicas 1-2 has 2"),
    ({"pipeline.split": "1,x"}, "pipeline.split"),
    ({"pipeline.replicas": "1,2,1"}, "2 stages of nodes but 3 replica"),
    ({"pipeline.partition": "acyclic"}, "which give the plan themselves"),
    ({"schedule.name": "zbv"}, "place or move stages themselves"),
  ],
)
def test_config_mistakes_are_one_line(fields, match):
  with pytest.raises(UsageError, match=match) as err:
    config_check.check(_config(**fields))
  assert "\n" not in str(err.value)


def test_counts_the_model_does_not_have_are_one_line(tmp_path):
  with pytest.raises(UsageError, match="covers 4 nodes, but this model has 3"):
    train_lib.train_and_evaluate(_config("2,2", ""), str(tmp_path))
