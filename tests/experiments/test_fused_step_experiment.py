"""The fused-step benchmark end to end, shrunk to seconds (a subprocess:
its absl flags share names with other experiment scripts')."""

import json
import os
import subprocess
import sys

import jax

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(__file__)))


def test_writes_the_paired_table_of_pipelines_that_train_alike(tmp_path):
  subprocess.run(
    [
      sys.executable,
      "-m",
      "experiments.runtime.fused_step",
      "--stages=2",
      "--microbatches=4",
      "--layers=2",
      "--rounds=1",
      "--warm=2",
      "--repeats=2",
      "--optimizers=adam",
      f"--out_dir={tmp_path}",
    ],
    cwd=ROOT,
    check=True,  # The script raises if the two settings train apart.
    env=dict(os.environ, JAX_PLATFORMS="cpu"),
  )
  platform = jax.devices()[0].platform
  record = json.loads((tmp_path / f"fused_step_{platform}.json").read_text())
  assert record["commit"] and record["date"] and record["jax"]
  (row,) = record["rows"]
  # async, p = 2, m = 4: 24 actions; the 4 forward-and-backward programs
  # of the last stage and the 4 backwards of the first (the tied
  # embedding's owner, its holder's gradient added) take their step in,
  # so 8 program calls fewer a step.
  assert row["actions"] == 24
  apart, fused = row["apart"], row["fused"]
  assert apart["program_calls_per_step"] == [20]
  assert fused["program_calls_per_step"] == [12]
  table = (tmp_path / f"fused_step_{platform}.md").read_text()
  assert "| 2 | 4 | adam | 24 | 20 -> **12** |" in table
