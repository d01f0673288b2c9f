"""The host-cost breakdown (``experiments.runtime.host_cost``): replaying
returns each program's recorded outputs and runs none, counts every call
the driver makes, restores the pipeline's own methods on exit, and its
parts add up to the host's time."""

import jax
import numpy as np
import optax
import pytest

from experiments.gpu_campaign import _common
from experiments.gpu_campaign.overhead import one_device_pipeline, timed_runner
from experiments.runtime import host_cost

TINY = dict(layers=2, width=8, heads=1, length=4, batch=8)
P, M = 2, 4


def _pipeline(schedule):
  loss_fn, params, batch, _ = _common.language_model(**TINY)
  pipe = one_device_pipeline(
    loss_fn,
    params,
    batch,
    p=P,
    schedule=schedule,
    m=M,
    tx=optax.sgd(0.1),
    recompute=False,
  )
  return pipe, params, batch


def _own_attributes(pipe):
  driver = pipe.driver
  return dict(vars(driver.programs)), [dict(vars(o)) for o in driver.optimizers]


@pytest.mark.slow
def test_a_replayed_step_runs_the_recorded_programs_outputs():
  """gpipe, 2 stages, 4 microbatches, last stage fused: the replayed
  step calls each stage program as often as the schedule says, and
  returns the recorded step's params (a real step moves them)."""
  pipe, params, batch = _pipeline("gpipe")
  state, _ = pipe.step(pipe.init(params), batch)
  before = _own_attributes(pipe)
  replay = host_cost.ProgramReplay()
  with replay.installed(pipe):
    recorded, _ = pipe.step(state, batch)
    replay.replaying = True
    replayed, _ = pipe.step(recorded, batch)
  assert _own_attributes(pipe) == before
  by_kind = {}
  for key, n in replay.calls.items():
    by_kind[key[0]] = by_kind.get(key[0], 0) + n
  assert by_kind["forward"] == by_kind["backward"] == M * (P - 1)
  assert by_kind["forward_backward"] == M
  steps = sum(n for kind, n in by_kind.items() if kind.startswith("update"))
  assert steps == P
  assert set(replay.calls) <= set(replay.outputs) == set(replay.arguments)
  got, want = (jax.device_get(s.stage_params) for s in (replayed, recorded))
  jax.tree.map(np.testing.assert_array_equal, got, want)
  moved, _ = pipe.step(replayed, batch)  # The real programs again.
  changed = jax.tree.map(
    lambda a, b: not np.array_equal(a, b),
    jax.device_get(moved.stage_params),
    got,
  )
  assert any(jax.tree.leaves(changed))


@pytest.mark.slow
@pytest.mark.parametrize("schedule", ["gpipe", "async"])
def test_the_breakdown_adds_up_to_the_host_time(schedule):
  pipe, params, batch = _pipeline(schedule)
  run = timed_runner(pipe, params, batch)
  for _ in range(4):
    run()
  actions = run.actions()
  before = _own_attributes(pipe)
  got = host_cost.host_breakdown(pipe, run, actions, repeats=2)
  assert _own_attributes(pipe) == before
  host, driver = got["host_us_per_action"], got["driver_us_per_action"]
  dispatch, rest = got["dispatch_us_per_action"], got["run_us_per_action"]
  assert host > 0 and driver > 0 and dispatch > 0 and rest >= 0
  if rest > 0:
    assert driver + dispatch + rest == pytest.approx(host)
  # Every action calls a program but the fused backwards (M a step) and,
  # in a stream, the steps that ran in their backward's program (each
  # stage's, the tied embedding's owner's too: P M a step).
  calls = got["program_calls_per_step"]
  if schedule == "async":
    assert calls == actions - M - P * M
  else:  # (Its synchronous steps unpack the tied stages' gradients too.)
    assert calls >= actions - M


def test_a_stream_replays_its_backward_and_step_programs():
  """async: the last stage's step runs in its forward-and-backward
  program, the first's (which owns the tied embedding) in its backward's;
  replayed, each stage ends with the params its step program returned
  when recorded (no program ran for real)."""
  pipe, params, batch = _pipeline("async")
  state, _ = pipe.step(pipe.init(params), batch)
  replay = host_cost.ProgramReplay()
  with replay.installed(pipe):
    recorded, _ = pipe.step(state, batch)
    replay.replaying = True
    replayed, _ = pipe.step(recorded, batch)
  # One program per donate_state (the call's first step keeps the state
  # it was given; later ones consume the state their call made).
  fused = {
    key[1:3] + (key[4],): key for key in replay.calls if key[0] == "with_step"
  }
  assert {key[:2] for key in fused} == {
    ("forward_backward", P - 1),
    ("backward", 0),
  }
  assert not [key for key in replay.calls if key[0].startswith("update")]
  got = jax.device_get(replayed.stage_params)
  # (*results, params, opt_state, replica gradients, input cotangents);
  # the params as the driver holds them, packed.
  want = [
    replay.outputs[fused[("backward", 0, True)]][-4],
    replay.outputs[fused[("forward_backward", P - 1, True)]][-4],
  ]
  for g, w in zip(got, jax.device_get(want), strict=True):
    jax.tree.map(np.testing.assert_array_equal, tuple(g), w.unpack())


def test_dispatch_seconds_takes_numbers_none_and_arrays():
  """Every argument kind a program takes (arrays, None, Python numbers,
  a bool option dropped) goes through the empty program."""
  shapes = host_cost._shapes(((jax.numpy.ones((3, 2)), None, 0.5), {"x": 1}))
  args, kwargs = shapes
  assert isinstance(args[0], jax.ShapeDtypeStruct) and args[0].shape == (3, 2)
  seconds = host_cost.dispatch_seconds(
    (args, {**kwargs, "donate_state": True}), repeats=10
  )
  assert 0 < seconds < 1
  many = host_cost.dispatch_seconds((args, kwargs), repeats=10, outputs=40)
  assert 0 < many < 1


@pytest.mark.slow
def test_host_calls_counts_the_drivers_calls_per_action(tmp_path):
  """``experiments.runtime.host_calls``: the driver's Python calls per
  action (F, B, S of every microbatch and stage) and host µs, written as
  a table and JSON; more than one call per action (the driver's own
  method at least), fewer than a thousand (the host path is not
  traced or compiled again)."""
  import json

  from experiments.runtime import host_calls

  host_calls.main(
    [f"--out_dir={tmp_path}", "--stages=2", "--microbatches=2", "--steps=1",
     "--profiled_steps=1", "--layers=2"]
  )  # fmt: skip
  name = f"host_calls_{jax.devices()[0].platform}"
  (row,) = json.loads((tmp_path / f"{name}.json").read_text())["rows"]
  assert row["actions_per_step"] == 3 * 2 * 2
  assert 1 < row["python_calls_per_action"] < 1000
  assert row["host_us_per_action"] > 0
  assert "Python calls / action" in (tmp_path / f"{name}.md").read_text()


@pytest.mark.slow
def test_caller_check_times_the_state_skipped_and_looked_into(tmp_path):
  """``experiments.runtime.caller_check``: µs per call of the look for a
  caller's arrays over ``step``'s arguments, the state skipped and
  looked into, written as a table and JSON."""
  import json

  from experiments.runtime import caller_check

  caller_check.main(
    [f"--out_dir={tmp_path}", "--stages=2", "--repeats=5", "--layers=2"]
  )
  name = f"caller_check_{jax.devices()[0].platform}"
  (row,) = json.loads((tmp_path / f"{name}.json").read_text())["rows"]
  assert row["stages"] == 2 and row["state_leaves"] > 2
  assert row["us_state_skipped"] > 0 and row["us_state_looked_into"] > 0
  assert "state skipped" in (tmp_path / f"{name}.md").read_text()
