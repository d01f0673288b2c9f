"""experiments/seeds/plans.py: the seeds' full-size plans beside their
figures, as a table and JSON."""

import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(__file__)))


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
