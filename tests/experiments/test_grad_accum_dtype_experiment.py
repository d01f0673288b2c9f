"""The float32-accumulation experiment end to end, shrunk to seconds."""

import json
import os
import subprocess
import sys

import jax
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(__file__)))


@pytest.mark.slow
def test_writes_both_errors_bytes_times_and_losses(tmp_path):
  subprocess.run(
    [
      sys.executable,
      "-m",
      "experiments.runtime.grad_accum_dtype",
      "--size=tiny",
      "--microbatches=2,8",
      "--pairs=1",
      "--train_steps=1",
      f"--out_dir={tmp_path}",
    ],
    cwd=ROOT,
    check=True,
    env=dict(os.environ, JAX_PLATFORMS="cpu"),
  )
  name = f"grad_accum_dtype_{jax.devices()[0].platform}"
  record = json.loads((tmp_path / f"{name}.json").read_text())
  assert record["commit"] and record["date"] and record["jax"]
  rows = record["rows"]
  assert [r["microbatches"] for r in rows] == [2, 8]
  for r in rows:
    # The float32 sum is nearer the exact mean; its accumulator twice.
    assert 0 <= r["float32_error"] < r["bfloat16_error"]
    assert 0 < r["float32_vs_one_device"]
    assert r["float32_grad_bytes"] == 2 * r["bfloat16_grad_bytes"]
    assert r["time_ratio"] > 0
    assert {"bfloat16_loss", "float32_loss"} <= set(r)
  table = (tmp_path / f"{name}.md").read_text()
  assert "| m | sum error, bf16 / f32 | against one device" in table
