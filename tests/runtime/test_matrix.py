"""One matrix: schedule x mitigation x recompute x placement, each against
its reference -- single-device accumulation for synchronous schedules, the
never-flushed stream (``test_pipeline_async._reference``) for
asynchronous ones. Placement changes where stages run (several stages on
one device; a stage data parallel over a device group), never which
params any action uses."""

import dataclasses

import jax
import pytest

import jpipe
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
  plain = jpipe.Pipeline(loss_fn, params, batch, **kwargs)
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
