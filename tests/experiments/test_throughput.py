"""The 2-process throughput experiment end to end, shrunk: its rows
restate their own formulas, and the timed steps' transfers are the
schedule's (each microbatch's activation one way, its gradient and each
step's loss the other)."""

import json
import os
import subprocess
import sys

import pytest

from tests.distributed.processes import without_proxies

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(__file__)))


@pytest.mark.slow
def test_the_script_times_two_processes_against_one_core(tmp_path):
  env = without_proxies()
  steps, m, batch = 2, 2, 64
  done = subprocess.run(
    [
      sys.executable,
      "-m",
      "experiments.distributed.throughput",
      f"--steps={steps}",
      "--repeats=1",
      "--layers=2",
      "--width=64",
      f"--batch={batch}",
      "--schedules=async",
      f"--microbatches={m}",
      f"--out_dir={tmp_path}",
    ],
    cwd=ROOT,
    env=env,
    capture_output=True,
    text=True,
    timeout=600,
  )
  assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
  assert "host time per op, async / 2" in done.stdout
  with open(tmp_path / "throughput.json") as f:
    out = json.load(f)
  # Two stages in order (where the cut falls is measured: it may move).
  assert len(out["stage_nodes"]) == 2
  assert sum(out["stage_nodes"], []) == ["dense_0", "dense_1", "head"]
  (row,) = out["rows"]
  assert (row["schedule"], row["microbatches"]) == ("async", m)
  (rate,), (whole,) = (
    row["examples_per_second_runs"],
    (row["whole_model_examples_per_second_runs"]),
  )
  assert row["speedup"] == pytest.approx(rate / whole)
  fixed = 1e6 * (batch / rate - batch / (2 * whole)) / m
  assert row["fixed_us_per_microbatch"] == pytest.approx(fixed)
  assert len(row["breakdown_per_process"]) == 2
  assert len(row["device_waits_per_process"]) == 2
  transfers = row["transfers_ms"]
  assert transfers["0->1"]["count"] == steps * m  # Activations.
  assert transfers["1->0"]["count"] == steps * (m + 1)  # Gradients, loss.
