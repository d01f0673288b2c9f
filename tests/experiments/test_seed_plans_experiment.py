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


@pytest.mark.slow
def test_vgg16_memory_table_compares_the_two_models(tmp_path):
  """experiments/seeds/vgg16_memory.py --quick: 15-1, 8-5-3 and jpipe's
  plan under both memory models; PipeDream's term is one stash of a
  stage's activations and params (none on the last stage), below
  jpipe's, which adds gradients, optimizer state and two microbatches in
  flight; at 4e9 bytes/s PipeDream's flat DP picks 15-1, at 10 Gbps it
  does not; charging a cut whole node activations made jpipe's 8-5-3."""
  done = subprocess.run(
    [
      sys.executable,
      "-m",
      "experiments.seeds.vgg16_memory",
      "--quick",
      f"--out={tmp_path}",
    ],
    cwd=ROOT,
    capture_output=True,
    text=True,
    timeout=600,
    env=dict(os.environ, PYTHONPATH=ROOT),
  )
  assert done.returncode == 0, done.stderr[-3000:]
  result = json.loads((tmp_path / "vgg16_memory.json").read_text())
  split, old, hybrid = result["plans"]
  assert split["replicas"] == [15, 1] and old["replicas"] == [8, 5, 3]
  assert hybrid["replicas"] == [14, 1, 1]
  for plan in (split, old, hybrid):
    assert plan["pipedream_gib"][-1] == 0.0
    assert plan["jpipe_gib"][0] > plan["pipedream_gib"][0]
  assert split["rr_in_flight"] == [2, 1]
  assert old["rr_in_flight"] == hybrid["rr_in_flight"] == [2, 2, 1]
  flat = {
    r["bandwidth"]: r["replicas"]
    for r in result["pipedream_dp"]
    if r["machines"] == "16"
  }
  assert flat[4e9] == "15-1" and flat[1.25e9] != "15-1"
  assert result["pipedream_profile_15_1"]["replicas"] == [15, 1]
  chosen = {
    (r["variant"], r["bandwidth"]): r["replicas"]
    for r in result["traced_dp_variants"]
  }
  assert chosen["transfers as whole node activations", 1.25e9] == "8-5-3"
  assert chosen["transfers per edge (jpipe)", 4e9] == "15-1"
  assert (
    "| 15-1 (PipeDream's, Split) | 15-1 |"
    in (tmp_path / "vgg16_memory.md").read_text()
  )
