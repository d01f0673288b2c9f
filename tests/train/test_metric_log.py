"""The run's metrics log (``metric_log.MetricLog``) on resume: the rows up
to the checkpoint kept, damaged lines dropped with a note, an unwritable
log folder one line."""

import json
import os

import pytest

from jpipe.train import metric_log
from jpipe.train.errors import UsageError


def test_a_resume_keeps_the_rows_to_its_step_and_drops_damaged_lines(
  tmp_path, capsys
):
  path = tmp_path / "metrics.jsonl"
  good = [{"step": 1, "train/loss": 2.0}, {"step": 2, "train/loss": 1.5}]
  lines = [json.dumps(good[0]).encode(), b"\xa9\xff binary", b"[1, 2, 3]"]
  lines += [b'{"no_step": 1}', b'{"step": "4"}', json.dumps(good[1]).encode()]
  lines += [
    json.dumps({"step": 3, "train/loss": 1.0}).encode(),
    b'{"step": 4, "tr',
  ]
  path.write_bytes(b"\xef\xbb\xbf" + b"\n".join(lines) + b"\n")  # (A BOM.)
  assert metric_log.read_metrics(str(tmp_path))[:2] == good
  log = metric_log.MetricLog(str(tmp_path), resume_step=2)
  log.close()
  assert metric_log.read_metrics(str(tmp_path)) == good
  assert "5 unreadable lines dropped" in capsys.readouterr().err
  assert os.listdir(tmp_path / "tensorboard")


def test_an_unwritable_log_folder_is_one_line(tmp_path):
  """(A file where the events folder goes: unwritable even for root.)"""
  (tmp_path / "tensorboard").write_text("not a folder")
  with pytest.raises(UsageError, match="cannot write the run's logs in") as e:
    metric_log.MetricLog(str(tmp_path))
  assert "\n" not in str(e.value)
