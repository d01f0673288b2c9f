"""The checkpoint memory script end to end, shrunk (two processes, a
small MLP): it prints its table, writes its JSON, and the per-process
save adds less host memory than the gathered one."""

import json
import os
import subprocess
import sys

import pytest

from tests.distributed import processes

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(__file__)))


@pytest.mark.slow
def test_measures_both_ways_of_saving(tmp_path):
  done = subprocess.run(
    [
      sys.executable,
      "-m",
      "experiments.distributed.checkpoint_memory",
      "--nprocs=2",
      "--width=1024",
      "--layers=4",
      f"--out_dir={tmp_path}",
    ],
    cwd=ROOT,
    env=processes.environment(),
    capture_output=True,
    text=True,
    timeout=300,
  )
  assert done.returncode == 0, done.stdout + done.stderr
  assert "per process" in done.stdout and "gathered" in done.stdout
  with open(tmp_path / "checkpoint_memory.json") as f:
    out = json.load(f)
  assert out["nprocs"] == 2 and len(out["rows"]) == 4
  by = {(r["way"], r["process"]): r for r in out["rows"]}
  for p in (0, 1):
    # The gathered save holds the other process's half too.
    assert (
      by["per process", p]["save_peak_mib"]
      < (by["gathered", p]["save_peak_mib"])
    )
