"""The packed-state benchmark end to end, shrunk to seconds (a
subprocess: its absl flags share names with other experiment scripts')."""

import json
import os
import subprocess
import sys

import jax

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(__file__)))


def test_writes_the_paired_table_of_tree_and_packed_states(tmp_path):
  subprocess.run(
    [
      sys.executable,
      "-m",
      "experiments.runtime.packed_state",
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
    check=True,
    env=dict(os.environ, JAX_PLATFORMS="cpu"),
  )
  platform = jax.devices()[0].platform
  record = json.loads((tmp_path / f"packed_state_{platform}.json").read_text())
  assert record["commit"] and record["date"] and record["jax"]
  (row,) = record["rows"]
  assert row["actions"] == 24
  # Adam over a tiny GPT's leaves (all below 16 KiB). The plan puts the
  # 2 layers on stage 0; stage 1 holds only the tied embedding's
  # replica, which stage 0 steps: as trees 36 leaves' two moments and a
  # count, plus stage 1's count; packed, stage 0's one f32 buffer and
  # its count's int32 one, plus stage 1's count.
  tree, packed = row["tree"]["state_arrays"], row["packed"]["state_arrays"]
  assert tree == [74] and packed == [3]
  assert row["params_max_abs_difference"] < 0.05
  table = (tmp_path / f"packed_state_{platform}.md").read_text()
  assert "| 2 | 4 | adam | 24 | 74 -> **3** |" in table
