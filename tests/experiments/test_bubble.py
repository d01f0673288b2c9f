"""The measured-bubble experiment: its analysis against a hand-made
timeline, and the script end to end, shrunk (two processes, short
sleeps)."""

import json
import os
import subprocess
import sys

import pytest

from experiments.distributed import bubble
from tests.distributed.processes import without_proxies

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(__file__)))


def test_analysis_of_a_hand_made_1f1b_timeline():
  """1F1B, 2 stages, 2 microbatches, F = 1 s, B = 2 s, transfers 0.5 s,
  worked out by hand: device 0 runs F0.0 [0, 1], F0.1 [1, 2], B0.0
  [5, 7] (B1.0 ends at 4.5), B0.1 [8, 10]; device 1 F1.0 [1.5, 2.5],
  B1.0 [2.5, 4.5], F1.1 [4.5, 5.5], B1.1 [5.5, 7.5]. Makespan 10, busy
  12 of 2 x 10; three inputs were waited for, each 0.5 s after its
  producer ended; the simulator, given those costs, predicts the same."""
  spans = {
    "F0.0": [0.0, 1.0],
    "F0.1": [1.0, 2.0],
    "F1.0": [1.5, 2.5],
    "B1.0": [2.5, 4.5],
    "B0.0": [5.0, 7.0],
    "F1.1": [4.5, 5.5],
    "B1.1": [5.5, 7.5],
    "B0.1": [8.0, 10.0],
  }
  row = bubble.analyse("1f1b", 2, 2, [spans], [0, 1])
  assert row["measured_ms"] == pytest.approx(10_000.0)
  assert row["measured_bubble"] == pytest.approx(1 - 12 / 20)
  assert row["transfer_ms"] == pytest.approx(500.0)
  assert row["cost_ms"] == {"F": 1000.0, "B": 2000.0}
  assert row["predicted_ms"] == pytest.approx(10_000.0)
  assert row["predicted_bubble"] == pytest.approx(row["measured_bubble"])


def test_gains_compare_each_schedule_with_1f1b_of_the_same_size():
  rows = [
    {
      "schedule": "1f1b",
      "p": 2,
      "microbatches": 8,
      "measured_ms": 550.0,
      "predicted_ms": 548.0,
    },
    {
      "schedule": "zbh1",
      "p": 2,
      "microbatches": 8,
      "measured_ms": 510.0,
      "predicted_ms": 508.0,
    },
  ]
  (gain,) = bubble.gains(rows)
  assert gain["measured_gain_ms"] == 40.0 and gain["predicted_gain_ms"] == 40.0
  assert gain["gain_ratio"] == 1.0


@pytest.mark.slow
def test_the_script_measures_and_predicts_each_schedule(tmp_path):
  env = without_proxies()
  done = subprocess.run(
    [
      sys.executable,
      "-m",
      "experiments.distributed.bubble",
      "--procs=2",
      "--microbatches=4",
      "--schedules=1f1b,zbv",
      "--forward_ms=4",
      "--input_ms=4",
      "--weight_ms=4",
      "--steps=1",
      f"--out_dir={tmp_path}",
    ],
    cwd=ROOT,
    env=env,
    capture_output=True,
    text=True,
    timeout=600,
  )
  assert done.returncode == 0, done.stdout + done.stderr
  with open(tmp_path / "bubble.json") as f:
    out = json.load(f)
  assert [(r["schedule"], r["p"]) for r in out["rows"]] == [
    ("1f1b", 2),
    ("zbv", 2),
  ]
  for r in out["rows"]:
    assert r["measured_ms"] > 0 and 0 <= r["predicted_bubble"] < 1
    assert set(r["cost_ms"]) >= {"F"}
  assert out["gains"][0]["schedule"] == "zbv"
  assert "zbv p=2 m=4: gain over 1f1b" in done.stdout
