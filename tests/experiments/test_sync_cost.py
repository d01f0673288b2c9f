"""The cross-process operations' cost script end to end, shrunk (two
processes, a few calls): it prints its table and writes its JSON."""

import json
import os
import subprocess
import sys

import pytest

from tests.distributed.processes import without_proxies

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(__file__)))


@pytest.mark.slow
def test_times_every_operation(tmp_path):
  env = without_proxies()
  done = subprocess.run(
    [
      sys.executable,
      "-m",
      "experiments.distributed.sync_cost",
      "--calls=5",
      f"--out_dir={tmp_path}",
    ],
    cwd=ROOT,
    env=dict(env, JAX_PLATFORMS="cpu"),
    capture_output=True,
    text=True,
    timeout=300,
  )
  assert done.returncode == 0, done.stdout + done.stderr
  assert "stop agreement (host exchange)" in done.stdout
  with open(tmp_path / "sync_cost.json") as f:
    out = json.load(f)
  assert out["nprocs"] == 2 and len(out["rows"]) == 4
  assert all(r["median_us"] > 0 for r in out["rows"])
