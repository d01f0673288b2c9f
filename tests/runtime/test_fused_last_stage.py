"""The last stage's forward and backward as one program change nothing but
the program: same params, same loss, same params used by every action."""

import jax
import numpy as np
import optax
import pytest

import jpipe
from jpipe import schedule as schedule_lib
from tests.partition import flax_models
from tests.tiers import slow

F, B, S = schedule_lib.FORWARD, schedule_lib.BACKWARD, schedule_lib.UPDATE


def _run(case, schedule, fuse, **kwargs):
  loss_fn, params, batch, _ = flax_models.CASES[case]()
  pipe = jpipe.Pipeline(
    loss_fn,
    params,
    batch,
    num_stages=3,
    devices=jax.devices()[:3],
    schedule=schedule,
    num_microbatches=4,
    optimizer=optax.adam(1e-2),
    fuse_last_stage=fuse,
    record_params=True,
    **kwargs,
  )
  state = pipe.init(params)
  losses, used = [], {}
  for _ in range(2):
    fused = _fused_pairs(pipe, state)
    state, metrics = pipe.step(state, batch)
    losses.append(float(metrics["loss"]))
    used = metrics["used_params"]  # The last call's.
  return pipe, state, losses, batch, fused, used


def _fused_pairs(pipe, state):
  """The (stage, microbatch) pairs the next call fuses."""
  fed = state.in_flight.fed if state.in_flight else 0
  return pipe.calls(fed, pipe.num_microbatches).fused


@pytest.mark.parametrize(
  "case, schedule, kwargs",
  [
    slow("gpt_tied", "gpipe", {}),
    slow("encoder_decoder", "1f1b", {"recompute": False}),
    slow("gpt_tied", "async", {"weight_stashing": True, "prediction": "msnag"}),
    ("mlp", "async", {"prediction": "msnag", "recompute": True}),
    ("mlp", "2bw", {"step_every": 4}),
  ],
)
def test_fused_equals_unfused(case, schedule, kwargs):
  fused, fused_state, fused_losses, _, pairs, fused_used = _run(
    case, schedule, True, **kwargs
  )
  # The same stages (fusing changes how the partitioner prices the last
  # stage: without recomputation, FTPipe's async meta-algorithm).
  _, plain_state, plain_losses, _, no_pairs, plain_used = _run(
    case, schedule, False, partition=fused.plan, **kwargs
  )
  last = fused.stages.num_stages - 1
  # The last call's microbatches (a stream's second call: 4 .. 7).
  first = 4 if schedule in ("async", "2bw") else 0
  assert pairs == {(last, k) for k in range(first, first + 4)}
  assert no_pairs == frozenset()
  np.testing.assert_allclose(fused_losses, plain_losses, rtol=1e-6)
  for a, b in zip(
    jax.tree.leaves(fused_state.stage_params),
    jax.tree.leaves(plain_state.stage_params),
    strict=True,
  ):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
  assert set(fused_used) == set(plain_used)
  for key, theta in plain_used.items():
    for a, b in zip(fused_used[key], theta, strict=True):
      np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


def test_profiled_timeline_keeps_every_fused_backward():
  """A fused B is still an action of the measured timeline, after its F."""
  pipe, state, _, batch, pairs, _ = _run("mlp", "gpipe", True)
  _, metrics = pipe.step(state, batch, profile=True)
  timeline = metrics["timeline"]
  actions = pipe.call_actions(state, pipe.num_microbatches).actions()
  assert set(timeline.start) == actions
  assert pairs
  for s, k in pairs:
    f, b = schedule_lib.Action(F, s, k), schedule_lib.Action(B, s, k)
    assert timeline.end[f] <= timeline.start[b] <= timeline.end[b]


def test_a_step_between_forward_and_backward_prevents_fusion():
  """F1 ... S ... B1: B1's gradient belongs to a later step than the one
  F1's fused program would have fed, so only microbatch 0 fuses."""
  actions = [
    schedule_lib.Action(F, 0, 0),
    schedule_lib.Action(F, 0, 1),
    schedule_lib.Action(B, 0, 0),
    schedule_lib.Action(S, 0, 0),
    schedule_lib.Action(B, 0, 1),
    schedule_lib.Action(S, 0, 1),
  ]
  schedule = schedule_lib.make_schedule("custom", [actions], [0], 2)
  assert schedule_lib.fusable_pairs(schedule, [True]) == {(0, 0)}
  assert schedule_lib.fusable_pairs(schedule, [False]) == frozenset()
