"""The re-partitioning controller on a real pipeline with injected
slowdowns (sleeps): it moves layers off a slowed device within two
windows, moves them back when the slowdown ends (a plan seen before: no
new build), and DynPipe's policy keeps to its candidate cuts."""

import pytest

import jpipe
from jpipe import dynamic
from tests.dynamic import mlp_pipeline
from tests.dynamic.mlp_pipeline import WINDOW
from tests.partition import flax_models


def _run(policy, inject="1:4:6:16", steps=24, horizon_steps=50):
  dp, params, batch = mlp_pipeline.build(policy, inject, horizon_steps)
  start = dp.boundaries
  state = dp.init(params)
  reported = []
  for _ in range(steps):
    state, metrics = dp.step(state, batch)
    if "repartition" in metrics:
      reported.append(metrics["repartition"])
  return dp, start, reported


@pytest.mark.slow
def test_jpipe_policy_moves_off_the_slowed_device_and_back():
  dp, start, reported = _run("jpipe")
  assert reported == dp.history and len(reported) == 2
  onset, end = reported
  # Device 1 slows 4x from step 6: the switch comes at the second window
  # that measured it (step 10: two in a row confirm), nodes leave stage 1.
  assert onset["step"] == 6 + 2 * WINDOW
  assert onset["new"][1] > start[1]
  assert onset["sigma"][1] == pytest.approx(4.0, rel=0.25)
  assert onset["predicted_new_seconds"] < onset["predicted_old_seconds"]
  # It ends before step 16: back to the first plan, built before.
  assert end["step"] == 16 + 2 * WINDOW
  assert tuple(end["new"]) == start and not end["compiled"]
  # The measured slowdown follows the injection.
  sigma = {w.step: w.sigma[1] for w in dp.windows}
  assert sigma[4] == pytest.approx(1.0, abs=0.3)
  assert sigma[12] == pytest.approx(4.0, rel=0.25)


def test_dynpipe_policy_picks_among_its_candidate_cuts():
  dp, start, reported = _run("dynpipe", steps=12)  # Its first switch.
  assert reported
  first = reported[0]
  cuts = dynamic.candidate_cuts(
    dynamic.node_weights(dp.forward, dp.backward), start, 2
  )
  assert first["new"][1] in cuts and first["new"][1] > start[1]


def test_static_policy_measures_but_never_switches():
  dp, start, reported = _run("static", steps=12)
  assert reported == [] and dp.boundaries == start
  # Seen (over the 2x trigger; 4x injected, less measured: the unslowed
  # dispatch of each action counts in the stage's time).
  assert max(w.sigma[1] for w in dp.windows) > 2.5


def test_no_switch_when_the_gain_cannot_pay_for_it():
  """One step of horizon: the slowdown is seen, but the predicted gain
  over one step is below the cost of a new pipeline."""
  dp, start, reported = _run("jpipe", steps=12, horizon_steps=1)
  assert reported == [] and dp.boundaries == start
  assert max(w.sigma[1] for w in dp.windows) > 2.5  # (As above.)


def test_interference_sleeps_the_stages_share_times_the_factor():
  hooks = dynamic.Interference(
    dynamic.parse_inject("1:3:5:9"), simulated_seconds=0.01
  )
  hooks.stage_shares = ((0.1, 0.2), (0.3, 0.4))
  hooks.stage_devices = (0, 1)
  assert [hooks.factor(1, s) for s in (4, 5, 8, 9)] == [1, 3, 3, 1]
  from jpipe.schedule import Action

  hooks.step = 6
  hooks.before_compute(Action("F", 1, 0))
  hooks.before_compute(Action("B", 0, 0))
  slept = hooks.take_slept()
  assert slept[1] == pytest.approx(0.01 * 0.3 * 3)
  assert slept[0] == pytest.approx(0.01 * 0.2)
  assert hooks.take_slept() == {}


def test_bad_inject_strings_name_the_format():
  assert dynamic.parse_inject("2:3.0:100, 0:1.5:10:20") == (
    dynamic.Slowdown(2, 3.0, 100, None),
    dynamic.Slowdown(0, 1.5, 10, 20),
  )
  for bad in ("2:3.0", "x:3:1", "1:3:10:5", "1:0:1"):
    with pytest.raises(ValueError, match="DEVICE"):
      dynamic.parse_inject(bad)
  with pytest.raises(ValueError, match="unknown policy"):
    loss_fn, params, batch, _ = flax_models.mlp_case()
    dynamic.DynamicPipeline(
      jpipe.PipelineBuilder.of(loss_fn, params, batch), policy="magic"
    )
