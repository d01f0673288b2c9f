"""experiments/seeds/plans.py: the seeds' full-size plans beside their
figures, as a table and JSON."""

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(__file__)))


@pytest.mark.slow
def test_writes_the_table_and_rows(tmp_path):
  done = subprocess.run(
    [
      sys.executable,
      "-m",
      "experiments.seeds.plans",
      "--configs=ftpipe_wrn28x10.py,ftpipe_bert_large.py",
      f"--out={tmp_path}",
    ],
    cwd=ROOT,
    capture_output=True,
    text=True,
    timeout=300,
    env=dict(os.environ, PYTHONPATH=ROOT),
  )
  assert done.returncode == 0, done.stderr[-3000:]
  rows = json.loads((tmp_path / "plans.json").read_text())["rows"]
  assert [r["config"] for r in rows] == [
    "ftpipe_wrn28x10.py",
    "ftpipe_bert_large.py",
  ]
  bert = rows[1]
  assert bert["method"] == "mixed" and bert["devices"] == 8
  assert bert["max_device_gib"] <= bert["limit_gib"] == 11
  assert "6.69x" in bert["seed"]
  table = (tmp_path / "plans.md").read_text()
  assert (
    table.count("\n") == 4 and "| ftpipe_wrn28x10.py | pipedream |" in table
  )


@pytest.mark.slow
def test_memory_model_bounds_xla_at_full_size(tmp_path):
  """experiments/seeds/memory.py: BERT-large's largest stage compiled on
  shapes at full size; the partitioner's prediction for its backward
  program bounds XLA's arguments + outputs + temporaries from above, and
  its working bytes bound XLA's temporaries."""
  done = subprocess.run(
    [
      sys.executable,
      "-m",
      "experiments.seeds.memory",
      "--configs=ftpipe_bert_large.py",
      "--stages=1",
      f"--out={tmp_path}",
    ],
    cwd=ROOT,
    capture_output=True,
    text=True,
    timeout=300,
    env=dict(os.environ, PYTHONPATH=ROOT),
  )
  assert done.returncode == 0, done.stderr[-3000:]
  (row,) = json.loads((tmp_path / "memory.json").read_text())["rows"]
  assert row["config"] == "ftpipe_bert_large.py"
  assert row["xla_program_bytes"] > 2**30  # Full size: BERT-large at 384.
  assert row["predicted_program_bytes"] >= row["xla_program_bytes"]
  assert row["predicted_working_bytes"] >= row["xla_temp_bytes"]
  assert (tmp_path / "memory.md").read_text().count("\n") == 3
