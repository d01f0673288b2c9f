"""``--config.schedule.name=auto`` in training and ``--schedule auto`` in
the plan CLI: the table printed and recorded in plan.json, the same
choice in both, and auto's refusals as one line."""

import json
import os
import sys

import pytest

from jpipe import partition
from jpipe.train import config_check, train_lib
from jpipe.train import plan as plan_cli
from jpipe.train.errors import UsageError

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(__file__)))
sys.path.insert(0, os.path.join(ROOT, "configs"))
import default as default_config  # noqa: E402


def _config(**overrides):
  config = default_config.get_config()
  config.model.kwargs.hidden = (32, 32)  # 3 nodes: layer_0, layer_1, head.
  config.pipeline.num_stages = 2
  config.schedule.name = "auto"
  config.train.steps = 1
  config.data.batch_size = 32
  config.update_from_flattened_dict(overrides)
  return config


def test_training_prints_and_records_the_table_the_plan_cli_prints(
  tmp_path, capsys
):
  train_lib.train_and_evaluate(_config(), str(tmp_path))
  out = capsys.readouterr().out
  text = (tmp_path / "plan.json").read_text()
  choice = json.loads(text)["schedule_choice"]
  rows = choice["rows"]
  assert choice["chosen"] == rows[0]["schedule"]
  assert {"gpipe", "1f1b", "zbh1", "zbh2"} <= {r["schedule"] for r in rows}
  for r in rows:
    assert r["fits"] and r["step_seconds"] > 0 and 0 <= r["bubble"] < 1
    assert r["peak_bytes"] == max(r["device_bytes"])
    assert r["peak_device"] in ("device 0", "device 1")
  assert f"schedule=auto chose {choice['chosen']!r} from" in out
  assert f"schedule {choice['chosen']}, " in out  # The pipeline's line.
  assert partition.Plan.from_json(text).num_stages == 2  # Still a Plan.
  # The plan CLI, on the same config's shapes, ranks alike.
  config = _config()
  spec = tmp_path / "auto_config.py"
  spec.write_text(
    "import sys\n"
    f"sys.path.insert(0, {os.path.join(ROOT, 'configs')!r})\n"
    "import default\n"
    "def get_config():\n"
    "  c = default.get_config()\n"
    f"  c.model.kwargs.hidden = {tuple(config.model.kwargs.hidden)}\n"
    f"  c.data.batch_size = {config.data.batch_size}\n"
    "  return c\n"
  )
  argv = ["--config", str(spec), "--stages", "2", "--schedule", "auto"]
  assert plan_cli.main([*argv, "--json"]) == 0
  planned = json.loads(capsys.readouterr().out)["schedule_choice"]
  assert planned["chosen"] == choice["chosen"]
  for got, want in zip(planned["rows"], rows, strict=True):
    assert got["schedule"] == want["schedule"]
    assert got["step_seconds"] == pytest.approx(want["step_seconds"])
    assert got["peak_bytes"] == pytest.approx(want["peak_bytes"])


def test_a_memory_limit_no_schedule_fits_is_one_line(tmp_path):
  with pytest.raises(UsageError) as error:
    train_lib.train_and_evaluate(
      _config(**{"pipeline.memory_limit": "1KiB"}), str(tmp_path)
    )
  text = str(error.value)
  assert "\n" not in text
  assert "no schedule fits the memory limit of 1.00 KiB" in text
  assert "the smallest need is '" in text and "raise the limit" in text


@pytest.mark.parametrize(
  "overrides, says",
  [
    (
      {"staleness.stashing": True},
      "'auto' chooses among the synchronous schedules",
    ),
    ({"dynamic.enabled": True}, "'auto' chooses a schedule for one plan"),
  ],
)
def test_auto_refuses_what_it_cannot_choose_for(overrides, says):
  with pytest.raises(UsageError, match=says) as error:
    config_check.check(_config(**overrides))
  assert "\n" not in str(error.value).strip()
