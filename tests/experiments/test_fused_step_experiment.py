"""The fused-step and packed-state benchmarks end to end, shrunk to seconds (a subprocess:
its absl flags share names with other experiment scripts')."""

import json
import os
import subprocess
import sys

import jax
import pytest

from tests.quick_compiles import production_compiles

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(__file__)))


def _run(module, tmp_path) -> tuple[dict, str]:
  """``experiments.runtime.<module>`` at p = 2, m = 4, a 2-layer GPT,
  one round with Adam, one warm-up call and one timed (the counts are
  under test, not the times); its JSON record and Markdown table."""
  subprocess.run(
    [
      sys.executable,
      "-m",
      f"experiments.runtime.{module}",
      "--stages=2",
      "--microbatches=4",
      "--layers=2",
      "--rounds=1",
      "--warm=1",
      "--repeats=1",
      "--optimizers=adam",
      f"--out_dir={tmp_path}",
    ],
    cwd=ROOT,
    check=True,  # fused_step raises if the two settings train apart.
    # To the bit as a user compiles: XLA's optimisations decide the bits.
    env=production_compiles(dict(os.environ, JAX_PLATFORMS="cpu")),
  )
  out = tmp_path / f"{module}_{jax.devices()[0].platform}"
  return json.loads(out.with_suffix(".json").read_text()), out.with_suffix(
    ".md"
  ).read_text()


@pytest.mark.slow
def test_writes_the_paired_table_of_pipelines_that_train_alike(tmp_path):
  record, table = _run("fused_step", tmp_path)
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
  assert "| 2 | 4 | adam | 24 | 20 -> **12** |" in table


@pytest.mark.slow
def test_writes_the_paired_table_of_tree_and_packed_states(tmp_path):
  record, table = _run("packed_state", tmp_path)
  assert record["commit"] and record["date"] and record["jax"]
  (row,) = record["rows"]
  assert row["actions"] == 24
  # Adam over a tiny GPT's leaves (all below 16 KiB). The plan puts the
  # 2 layers on stage 0; stage 1 holds only the tied embedding's
  # replica, which stage 0 steps: as trees 36 leaves' two moments and a
  # count, plus stage 1's count; packed, stage 0's one 32-bit buffer (its
  # f32 moments and int32 count), plus stage 1's count.
  tree, packed = row["tree"]["state_arrays"], row["packed"]["state_arrays"]
  assert tree == [74] and packed == [2]
  assert row["params_max_abs_difference"] < 0.05
  assert "| 2 | 4 | adam | 24 | 74 -> **2** |" in table


@pytest.mark.slow
def test_writes_the_paired_table_of_leaves_and_packed_params(tmp_path):
  record, table = _run("packed_params", tmp_path)
  (row,) = record["rows"]
  assert row["actions"] == 24
  # Stage 0 holds the 2 layers and the embedding (36 leaves), stage 1
  # the tied embedding's replica; packed, stage 0's one f32 buffer and
  # the embedding apart (tied leaves are swapped one by one), stage 1's
  # replica.
  leaves, packed = row["leaves"]["param_arrays"], row["packed"]["param_arrays"]
  assert leaves == [37] and packed == [3]
  # Slicing params out of a buffer changed no result.
  assert row["params_max_abs_difference"] == 0.0
  assert "| 2 | 4 | adam | 24 | 37 -> **3** |" in table
