"""The own-buffer size sweep end to end, shrunk to seconds (a subprocess:
its absl flags are experiments.runtime.overhead's too)."""

import json
import os
import subprocess
import sys

import jax
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(__file__)))


@pytest.mark.slow
def test_writes_the_ratio_per_round_of_each_size_with_the_default_marked(
  tmp_path,
):
  subprocess.run(
    [
      sys.executable,
      "-m",
      "experiments.runtime.pack_threshold",
      "--size=tiny",
      "--stages=2",
      "--kib=16,inf",
      "--rounds=2",
      "--pairs=1",
      f"--out_dir={tmp_path}",
    ],
    cwd=ROOT,
    check=True,
    # Quick compiles (inherited, tests/quick_compiles.py): the code path
    # is under test, not the timings.
    env=dict(os.environ, JAX_PLATFORMS="cpu"),
  )
  platform = jax.devices()[0].platform
  name = f"pack_threshold_{platform}"
  record = json.loads((tmp_path / f"{name}.json").read_text())
  assert record["commit"] and record["date"] and record["jax"]
  rows = record["rows"]
  assert [r["own_buffer_bytes"] for r in rows] == [16384, float("inf")]
  assert [r["default"] for r in rows] == [True, False]  # The CPU's 16 KiB.
  for row in rows:
    assert len(row["ratio_per_round"]) == 2
    assert all(r > 0 for r in row["ratio_per_round"])
  table = (tmp_path / f"{name}.md").read_text()
  assert "| 2 | 2 | **16 KiB (default)** |" in table
  assert "| 2 | 2 | none (all packed) |" in table
