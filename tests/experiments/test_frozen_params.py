"""``experiments.runtime.frozen_params`` runs tiny and writes its row."""

import json

import jax
import pytest

pytestmark = pytest.mark.slow


def test_frozen_params_times_both_ways_of_freezing(tmp_path):
  from experiments.runtime import frozen_params

  frozen_params.main(
    [
      f"--out_dir={tmp_path}",
      "--vocab=64",
      "--width=8",
      "--layers=2",
      "--steps=1",
    ]
  )
  name = f"frozen_params_{jax.devices()[0].platform}"
  (row,) = json.loads((tmp_path / f"{name}.json").read_text())["rows"]
  assert row["ms_freeze_by_optimizer"] > 0 and row["ms_frozen_as_state"] > 0
  assert row["gradient_bytes_saved_per_microbatch"] == 64 * 8 * 4
  assert "frozen_loss" in (tmp_path / f"{name}.md").read_text()
