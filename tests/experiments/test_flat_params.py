"""The flat-params benchmark end to end, shrunk to seconds (a subprocess:
its absl flags share names with other experiment scripts')."""

import json
import os
import subprocess
import sys

import jax
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(__file__)))


@pytest.mark.slow
def test_writes_the_table_and_json_of_programs_that_agree(tmp_path):
  subprocess.run(
    [
      sys.executable,
      "-m",
      "experiments.runtime.flat_params",
      "--width=16",
      "--blocks=2",
      "--rows=2,4",
      "--repeats=2",
      f"--out_dir={tmp_path}",
    ],
    cwd=ROOT,
    check=True,  # The script raises if flat and leaf programs disagree.
    env=dict(os.environ, JAX_PLATFORMS="cpu"),
  )
  platform = jax.devices()[0].platform
  record = json.loads((tmp_path / f"flat_params_{platform}.json").read_text())
  assert [r["rows"] for r in record["results"]] == [2, 4]
  assert all(len(r["milliseconds"]) == 4 for r in record["results"])
  table = (tmp_path / f"flat_params_{platform}.md").read_text()
  assert table.count("\n| 2 |") == table.count("\n| 4 |") == 1
