"""The measured timeline and the weight versions a stage holds."""

import json

import jax
import optax
import pytest

import jpipe
from jpipe import schedule as schedule_lib
from tests.partition import flax_models


def _pipe(schedule, num_stages=3, num_micro=6, **kwargs):
  loss_fn, params, batch, _ = flax_models.mlp_case()
  batch = jax.tree.map(lambda x: x[: 2 * num_micro], _tile(batch, num_micro))
  pipe = jpipe.Pipeline(
    loss_fn,
    params,
    batch,
    num_stages=num_stages,
    devices=jax.devices()[:num_stages],
    schedule=schedule,
    num_microbatches=num_micro,
    optimizer=optax.sgd(0.1, momentum=0.9),
    **kwargs,
  )
  return pipe, params, batch


def _tile(batch, num_micro):
  return jax.tree.map(
    lambda x: jax.numpy.concatenate([x] * (1 + 2 * num_micro // len(x))),
    batch,
  )


@pytest.mark.parametrize("schedule", ["1f1b", "async"])
def test_profiled_timeline_is_consistent(schedule, tmp_path):
  pipe, params, batch = _pipe(schedule)
  state = pipe.init(params)
  state, _ = pipe.step(state, batch)  # compile first
  programs = _compiled(pipe)
  lists = pipe.call_actions(state, pipe.num_microbatches)
  state, metrics = pipe.step(state, batch, profile=True)
  # Profiling runs the programs already compiled: nothing new.
  assert _compiled(pipe) == programs
  timeline = metrics["timeline"]
  actions = lists.actions()
  assert set(timeline.start) == actions
  for acts in lists.device_actions:  # in order, no overlap
    for a, b in zip(acts, acts[1:], strict=False):
      assert timeline.start[a] <= timeline.end[a] <= timeline.start[b]
  for a in actions:  # data dependencies
    if a.kind == "F" and a.stage > 0:
      src = schedule_lib.Action("F", a.stage - 1, a.microbatch)
      assert timeline.start[a] >= timeline.end[src]
    src = schedule_lib.Action("B", a.stage + 1, a.microbatch)
    if a.kind == "B" and src in actions:  # (else it ran in an earlier call)
      assert timeline.start[a] >= timeline.end[src]
  assert 0.0 <= timeline.bubble < 1.0
  schedule_lib.write_chrome_trace(timeline, tmp_path / "trace.json")
  events = json.loads((tmp_path / "trace.json").read_text())["traceEvents"]
  assert sum(e["ph"] == "X" for e in events) == len(actions)
  schedule_lib.plot_timeline(timeline, tmp_path / "timeline.png")
  assert (tmp_path / "timeline.png").stat().st_size > 1000


@pytest.mark.parametrize(
  "kwargs, expected",
  [
    # PipeDream: stage s keeps d + 1 = n - s versions (live included).
    ({"weight_stashing": True}, (3, 2, 1)),
    # With prediction every in-flight forward has its own predicted
    # version, plus the live params: d + 2 on stages with a delay.
    ({"weight_stashing": True, "prediction": "msnag"}, (4, 3, 1)),
  ],
)
def test_weight_versions_held_follow_the_d_plus_one_model(kwargs, expected):
  pipe, params, batch = _pipe("async", **kwargs)
  state = pipe.init(params)
  for _ in range(3):  # The stream's steady state holds as many.
    state, metrics = pipe.step(state, batch)
    assert metrics["param_versions"] == expected
    # Between calls stage s keeps its d = n - 1 - s in-flight microbatches'
    # inputs (d + 1 at most while one more runs): PipeDream's 1F1B bound.
    saved = [s for s, _ in state.in_flight.saved]
    assert [saved.count(s) for s in range(3)] == [2, 1, 0]


def _compiled(pipe) -> dict:
  """How many programs each jitted stage function has compiled."""
  jitted = {**pipe.stages._jitted, **pipe.programs._cache}
  return {k: f._cache_size() for k, f in jitted.items()}
