"""The memory experiment runs and its predictions equal XLA's bytes."""

import json

import pytest

from experiments.runtime import memory


@pytest.mark.slow
def test_memory_table_matches_xla_where_exact(tmp_path):
  rows = memory.run((2,), width=32, layers=2)
  assert len(rows) == 2 * len(memory.SETTINGS)
  for row in rows:
    pred, xla = row["predicted"], row["xla"]
    assert abs(pred["opt_state"] - xla["opt_state"]) <= 8 * 64
    assert pred["working"] >= xla["temp"]
  memory.write(rows, str(tmp_path))
  saved = json.loads((tmp_path / "memory_cpu.json").read_text())
  assert saved["date"] and len(saved["rows"]) == len(rows)
  assert "| 2 | gpipe |" in (tmp_path / "memory_cpu.md").read_text()
