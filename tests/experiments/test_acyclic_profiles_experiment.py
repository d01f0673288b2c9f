"""experiments/partition/acyclic_profiles.py: acyclic vs contiguous (vs
PipeDream) on PipeDream's branchy profiles, as a table and JSON."""

import json

from experiments.partition import acyclic_profiles


def test_quick_run_writes_the_table_and_rows(tmp_path):
  acyclic_profiles.main(["--quick", f"--out={tmp_path}"])
  rows = json.loads((tmp_path / "acyclic_profiles.json").read_text())
  assert {r["model"] for r in rows} == {"resnet18", "inception_v3"}
  for r in rows:
    # Acyclic starts from the exact contiguous split: never worse.
    assert r["acyclic_ms"] <= r["contiguous_ms"] * (1 + 1e-9)
    assert r["acyclic_multilevel_ms"] <= r["contiguous_ms"] * (1 + 1e-9)
    assert r["acyclic_ms"] >= r["lower_bound_ms"] * (1 - 1e-9)
  assert "| inception_v3 |" in (tmp_path / "acyclic_profiles.md").read_text()
