"""The GPU campaign's one command, at --quick size on the CPU, so it
cannot break unseen between GPU sessions."""

import json
import os
import subprocess
import sys

import jax
import numpy as np
import optax
import pytest

from experiments.gpu_campaign import __main__ as campaign
from experiments.gpu_campaign import _common
from jpipe.models import gpt

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(__file__)))
META = ("date", "device", "platform", "jax", "commit")


def _load(out, part):
  return json.loads((out / f"{part}.json").read_text())


def _check_overhead(out):
  record = _load(out, "overhead")
  for row in record["rows"]:
    assert row["ratio"] > 0 and row["actions"] > 0
    assert row["reference_recomputes"] == row["recompute"]
    expected = (row["pipeline_ms"] - row["reference_ms"]) * 1e3
    m = record["settings"]["microbatches"]
    assert row["fixed_us_per_microbatch"] == pytest.approx(expected / m)


def _check_mfu(out):
  rows = _load(out, "mfu")["rows"]
  assert [r["dtype"] for r in rows] == ["bfloat16", "float32"]
  for row in rows:
    # tokens/s restated from the step time; MFU None on a CPU (no peak).
    assert row["pipeline_tokens_per_s"] == pytest.approx(
      row["tokens_per_step"] / (row["pipeline_ms"] / 1e3)
    )
    assert row["reference_mfu"] is None and row["size"] == "quick"


def _check_memory(out):
  memory = {
    (r["schedule"], r["recompute"]): r for r in _load(out, "memory")["rows"]
  }
  for row in memory.values():
    assert all(d["predicted_bytes"] > 0 for d in row["per_device"])
  # The stash: stage s of 4 holds 4 - s versions (PipeDream's d + 1).
  stash = memory[("async", False)]
  assert stash["stash_versions_predicted"] == stash["stash_versions_pipedream"]
  assert stash["stash_versions_pipedream"] == [4, 3, 2, 1]


def _check_stage_times(out):
  rows = _load(out, "stage_times")["rows"]
  assert [r["method"] for r in rows] == ["analytic", "xla", "measured"]
  for row in rows:
    assert sum(row["predicted_share"]) == pytest.approx(1.0)


def _check_driver(out):
  driver = _load(out, "driver")
  assert driver["host_profile"]["top_own_time"]
  assert driver["grad_buffers"]["results"]
  for row in driver["rows"]:  # The host's time per action, split.
    parts = ("driver", "dispatch", "run")
    assert all(row[f"{part}_us_per_action"] >= 0 for part in parts)
    # The run is the rest of the host's time (no wall-clock comparison:
    # on a loaded machine a replayed step may take longer than a real one).
    rest = row["host_us_per_action"] - sum(
      row[f"{part}_us_per_action"] for part in parts[:2]
    )
    assert row["run_us_per_action"] == pytest.approx(max(0.0, rest))
  # The stream measured with its steps apart and in their backwards.
  calls = {
    (r["schedule"], r["fuse_step"]): r["program_calls_per_step"]
    for r in driver["rows"]
  }
  assert calls[("async", True)] < calls[("async", False)]


def _check_multi_device(out):
  # conftest gives the children 8 CPU devices: the multi-device part runs.
  rows = {r["schedule"]: r for r in _load(out, "multi_device")["rows"]}
  assert set(rows) == {"1f1b", "async", "zbh1", "zbv"}
  assert all(r["devices"] == 2 and r["speedup"] > 0 for r in rows.values())
  # ZB-V: two stages per device, in a V.
  assert rows["zbv"]["stages"] == 4 and rows["zbh1"]["stages"] == 2


def _check_profile(out):
  profile = _load(out, "profile")["rows"]
  assert [r["leaves"] for r in profile if r["what"] == "dispatch"] == [1, 16]
  traces = {r["run"]: r for r in profile if r["what"] == "trace"}
  assert set(traces) == {"reference_async", "async"}
  assert {"F", "B", "S"} <= set(traces["async"]["ops"])
  assert (out / "profile_trace_async.json.gz").exists()


CHECKS = {
  "overhead": _check_overhead,
  "mfu": _check_mfu,
  "memory": _check_memory,
  "stage_times": _check_stage_times,
  "driver": _check_driver,
  "multi_device": _check_multi_device,
  "profile": _check_profile,
}


def test_every_part_has_its_checks():
  assert list(CHECKS) == list(campaign.PARTS)


# One test per part (the command with --parts=<part>): the suite's
# workers run them side by side instead of one 5-10 minute test; the
# parts one after another in one command are test_a_failing_part_...,
# which runs and checks the quickest part, profile.
@pytest.mark.slow
@pytest.mark.parametrize("part", [p for p in campaign.PARTS if p != "profile"])
def test_quick_campaign_part_runs_and_writes_its_rows(tmp_path, part):
  subprocess.run(
    [
      sys.executable,
      "-m",
      "experiments.gpu_campaign",
      "--quick",
      f"--parts={part}",
      f"--out={tmp_path}",
    ],
    cwd=ROOT,
    check=True,
    # Quick compiles (inherited, tests/quick_compiles.py): the code paths
    # are under test here, not the timings.
    env=dict(os.environ, JAX_PLATFORMS="cpu", JPIPE_COMMIT="test"),
    timeout=900,
  )
  summary = json.loads((tmp_path / "campaign.json").read_text())
  assert [p["part"] for p in summary["parts"]] == [part]
  assert summary["parts"][0]["status"] == "ok", summary
  _check_part(tmp_path, part)


def _check_part(out, part):
  """The part's record: finished, stamped (commit "test"), with rows that
  pass the part's own checks."""
  record = _load(out, part)
  assert record["finished"] and record["commit"] == "test"
  assert all(record[k] for k in META)
  assert record["rows"], part
  CHECKS[part](out)


@pytest.mark.slow
def test_a_failing_part_is_recorded_and_the_next_one_runs(
  tmp_path, monkeypatch
):
  # The child does not know "broken": it exits with a usage error.
  monkeypatch.setitem(campaign.PARTS, "broken", 10)
  monkeypatch.chdir(ROOT)
  monkeypatch.setenv("JAX_PLATFORMS", "cpu")
  monkeypatch.setenv("JPIPE_COMMIT", "test")
  code = campaign.main(
    [
      "--quick",
      f"--out={tmp_path}",
      "--parts=broken,profile",  # (profile: the quickest part.)
      "--budget_scale=0.1",
    ]
  )
  assert code == 1
  parts = json.loads((tmp_path / "campaign.json").read_text())["parts"]
  assert [(p["part"], p["status"]) for p in parts] == [
    ("broken", "failed"),
    ("profile", "ok"),
  ]
  assert "broken" in parts[0]["error"]
  _check_part(tmp_path, "profile")  # (No test of its own: this one.)


def test_unknown_part_is_refused_before_anything_runs(tmp_path, capsys):
  with pytest.raises(SystemExit):
    campaign.main([f"--out={tmp_path}", "--parts=overhead,mfuu"])
  assert "mfuu" in capsys.readouterr().err
  assert not (tmp_path / "campaign.json").exists()


@pytest.mark.slow
def test_training_flops_match_xla_count_of_the_forward():
  # XLA's own count of one forward's FLOPs (the matmuls dominate) against
  # the formula's forward third.
  size = dict(layers=2, width=64, length=32, vocab=512)
  model = gpt.Model(
    vocab_size=size["vocab"],
    width=size["width"],
    num_layers=size["layers"],
    num_heads=4,
    max_length=size["length"],
  )
  tokens = np.zeros((4, size["length"]), np.int32)
  params = model.init(jax.random.key(0), tokens)
  compiled = jax.jit(model.apply).lower(params, tokens).compile()
  xla = compiled.cost_analysis()["flops"]
  formula = _common.training_flops(**size, tokens=tokens.size) / 3
  assert formula == pytest.approx(xla, rel=0.1)


@pytest.mark.slow
def test_the_recomputing_reference_runs_the_forward_again_to_the_same_step():
  loss_fn, params, batch, _ = _common.language_model(
    layers=2, width=16, heads=2, length=8, batch=4, dtype="float32"
  )
  runs = {
    r: _common.reference_step(
      loss_fn, params, batch, 2, optax.sgd(0.1), False, recompute=r
    )
    for r in (False, True)
  }
  for run in runs.values():
    run()
  plain, again = (runs[r].state["p"] for r in (False, True))
  jax.tree.map(
    lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6),
    plain,
    again,
  )

  def dots(run):
    state = run.state
    text = run.step.lower(state["p"], state["o"], state["b"]).as_text()
    return text.count("dot_general")

  # Forward, backward (two per forward dot) and the forward again.
  assert dots(runs[True]) > dots(runs[False])
