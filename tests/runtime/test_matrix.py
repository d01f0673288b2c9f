"""One matrix: schedule x mitigation x recompute x placement, each against
its reference -- single-device accumulation for synchronous schedules, the
never-flushed stream (``test_pipeline_async._reference``) for
asynchronous ones. Placement changes where stages run (several stages on
one device; a stage data parallel over a device group), never which
params any action uses."""

import dataclasses

import jax
import optax
import pytest

import jpipe
from tests.partition import flax_models
from tests.runtime import test_pipeline_async as async_tests
from tests.runtime.test_pipeline_sync import (
  _assert_tree_close,
  _reference_steps,
)
from tests.tiers import slow

PLACEMENTS = {
  "straight": ((0,), (1,), (2,)),
  # Stages 0 and 2 share device 0 (FTPipe's mixed pipe).
  "mixed": ((0,), (1,), (0,)),
  # Stages 0 and 2 data parallel over two devices each (PipeDream's
  # replicated stages).
  "replicated": ((0, 1), (2,), (3, 4)),
}

GA = {"gap_aware": "ga", "gap_aware_options": async_tests.GA_SGD}
CASES = {
  "gpipe": ("gpipe", {"recompute": False}),
  "1f1b-recompute": ("1f1b", {"recompute": True}),
  "seq": ("seq", {}),
  "interleaved": ("interleaved", {}),
  "async-ws": ("async", {"weight_stashing": True, "recompute": False}),
  "async-wp": ("async", {"prediction": "msnag", "recompute": True}),
  "async-ws+aggmsnag-k2": (
    "async",
    {"weight_stashing": True, "prediction": "aggmsnag", "step_every": 2},
  ),
  "async-ga": ("async", {**GA, "recompute": True}),
  "async-ws+ga_jfl": (
    "async",
    {**GA, "gap_aware": "ga_jfl", "weight_stashing": True},
  ),
  "2bw": ("2bw", {"step_every": 3, "recompute": False}),
  "eager1f1b": ("eager1f1b", {}),
  "looped_bfs": ("looped_bfs", {"recompute": False}),
  "zbh1-recompute": ("zbh1", {"recompute": True}),
  "zbh1": ("zbh1", {"recompute": False}),
  "zbh2": ("zbh2", {"recompute": False}),
}


def _pipeline(placement, schedule, opts):
  loss_fn, params, batch = async_tests._mlp()
  kwargs = dict(
    num_stages=3,
    devices=jax.devices()[:6],
    schedule=schedule,
    num_microbatches=async_tests.NUM_MICRO,
    optimizer=async_tests.SGD,
    record_params=schedule in ("async", "2bw"),
    **opts,
  )
  # The plan to place (a loop schedule refuses one stage a device
  # unless a Plan places them; its unlooped schedule plans alike).
  unlooped = jpipe.schedule.lookup(schedule).unlooped
  plain = jpipe.Pipeline(
    loss_fn, params, batch, **(kwargs | {"schedule": unlooped or schedule})
  )
  plan = dataclasses.replace(plain.plan, stage_devices=PLACEMENTS[placement])
  pipe = jpipe.Pipeline(loss_fn, params, batch, partition=plan, **kwargs)
  return pipe, loss_fn, params, batch


# The default tier runs each case on one placement, the placements taking
# turns (every case and every placement at least once); the slow tier
# runs the rest of the product.
MATRIX = [
  (case, placement) if i % len(PLACEMENTS) == j else slow(case, placement)
  for i, case in enumerate(CASES)
  for j, placement in enumerate(PLACEMENTS)
]


@pytest.mark.parametrize("case, placement", MATRIX)
def test_pipeline_matches_its_reference(case, placement):
  schedule, opts = CASES[case]
  pipe, loss_fn, params, batch = _pipeline(placement, schedule, opts)
  assert len(pipe.device_names) == len(set(PLACEMENTS[placement]))
  if schedule in jpipe.schedule.STREAMS:
    calls = (2, 5, "flush", 3, "flush")
    async_tests._check_against_reference(
      pipe, params, async_tests.SGD, dict(opts, schedule=schedule), calls
    )
    return
  state = pipe.init(params)
  for _ in range(2):
    state, metrics = pipe.step(state, batch)
  expected, loss = _reference_steps(
    loss_fn, params, batch, pipe.num_microbatches, async_tests.SGD, steps=2
  )
  _assert_tree_close(pipe.gather_params(state), expected)
  assert float(metrics["loss"]) == pytest.approx(loss, rel=1e-5)
  # A synchronous call flushes: nothing is in flight after it.
  assert state.in_flight is None


# Megatron's virtual stages: 4 stages on 2 devices in a loop (stage s on
# device s mod 2), gpt_tied's embedding shared by stage 0 (device 0) and
# stage 3 (device 1). schedule, optimizer, recompute.
LOOP_CASES = {
  "interleaved-sgd": ("interleaved", "sgd", False),
  "interleaved_zb-sgd": ("interleaved_zb", "sgd", False),
  "interleaved-adam-recompute": ("interleaved", "adam", True),
  "interleaved_zb-adam-recompute": ("interleaved_zb", "adam", True),
}


@pytest.mark.parametrize(
  "case",
  [c if i < 2 else slow(c) for i, c in enumerate(LOOP_CASES)],
)
def test_loop_placement_matches_one_device(case):
  """Two chunks per device: two steps equal single-device accumulation,
  and the call runs the schedule's own lists on the loop."""
  schedule, optimizer, recompute = LOOP_CASES[case]
  tx = {"adam": optax.adam(1e-2), "sgd": optax.sgd(0.1, momentum=0.9)}
  tx = tx[optimizer]
  loss_fn, params, batch, _ = flax_models.CASES["gpt_tied"]()
  pipe = jpipe.Pipeline(
    loss_fn,
    params,
    batch,
    num_stages=4,
    devices=jax.devices()[:2],
    schedule=schedule,
    num_microbatches=4,
    optimizer=tx,
    recompute=recompute,  # The schedule loops the 4 stages over 2 devices.
  )
  assert pipe.plan.stage_devices == ((0,), (1,), (0,), (1,))
  state = pipe.init(params)
  for _ in range(2):
    state, metrics = pipe.step(state, batch)
  expected, loss = _reference_steps(loss_fn, params, batch, 4, tx, steps=2)
  _assert_tree_close(pipe.gather_params(state), expected)
  assert float(metrics["loss"]) == pytest.approx(loss, rel=1e-5)
  lists = pipe.call_actions(state, 4)
  built = jpipe.schedule.build(schedule, 4, 4, stage_device=[0, 1, 0, 1])
  assert lists.device_actions == built.device_actions
