"""The schedules' bubble table, shrunk (p = 2 and 4, m = p and 2p): every
built-in schedule has a row, the closed forms hold where they exist, and
interleaved is at most torch's Interleaved1F1B."""

import json

import pytest

from experiments.schedules import bubbles
from jpipe import schedule as sc


def test_every_schedule_beside_its_formula(tmp_path, capsys):
  bubbles.main(["--devices=2,4", "--multiples=1,2", f"--out_dir={tmp_path}"])
  assert "| interleaved | 2 | 2 | 4 | 0.111 | 0.111 | 0.111 |" in (
    capsys.readouterr().out
  )
  rows = json.loads((tmp_path / "bubbles.json").read_text())["rows"]
  named = {r["schedule"] for r in rows}
  assert named == set(sc.SCHEDULES)
  # dualpipev needs m >= 2p: m = 2p only.
  assert sum(r["schedule"] == "dualpipev" for r in rows) == 2
  for r in rows:
    if r["formula"] is not None:
      assert r["bubble"] == pytest.approx(r["formula"]), r
    if r["torch"] is not None:
      assert r["bubble"] <= r["torch"] + 5e-4, r
    assert r["step"] == pytest.approx(1 / (1 - r["bubble"]))
  by = {(r["schedule"], r["p"], r["m"]): r for r in rows}
  # Two chunks per device: less bubble than 1F1B, at most Megatron's
  # warm-up + 1 microbatch-stages held.
  for p, m in ((2, 2), (2, 4), (4, 4), (4, 8)):
    inter = by[("interleaved", p, m)]
    assert inter["bubble"] < by[("1f1b", p, m)]["bubble"]
    assert inter["held"] == [
      min(2 * (p - 1 - d) + p + 1, 2 * m) for d in range(p)
    ]
