"""The profile parser: interval unions against a plain count, and a traced
pipeline's ops counted per kind as the driver ran them."""

import numpy as np
import optax
import pytest

from experiments.runtime import trace_breakdown
from tests.runtime.test_pipeline_async import NUM_MICRO, mlp_pipeline


def test_union_of_intervals_matches_a_grid_count():
  rng = np.random.default_rng(0)
  for _ in range(50):
    starts = rng.integers(0, 90, size=rng.integers(1, 12))
    ends = starts + rng.integers(0, 15, size=starts.size)
    covered = np.zeros(120, bool)
    for a, b in zip(starts, ends, strict=True):
      covered[a:b] = True
    got = trace_breakdown._union_us(zip(starts, ends, strict=True))
    assert got == covered.sum()


@pytest.mark.slow
def test_a_traced_pipeline_is_broken_down_by_op_kind(tmp_path):
  pipe, params, batch = mlp_pipeline(
    "async", optax.sgd(0.1), 3, num_stages=3, weight_stashing=True
  )
  state = {"s": pipe.init(params)}

  def run():
    state["s"], metrics = pipe.step(state["s"], batch)
    metrics["loss"].block_until_ready()

  for _ in range(3):  # compile; the stream reaches its steady order
    run()
  path = trace_breakdown.capture(run, 2, str(tmp_path))
  summary = trace_breakdown.breakdown(path)
  assert summary["steps"] == 2
  # A call of the stream: each of 3 stages runs a forward, a backward and
  # a step (step_every 1) per microbatch; each of the 2 stage boundaries
  # moves an activation forward and a cotangent back per microbatch.
  m = NUM_MICRO
  got = {k: v["per_step"] for k, v in summary["ops"].items()}
  assert got == {
    "F": 3 * m,
    "B": 3 * m,
    "S": 3 * m,
    "MOVE_F": 2 * m,
    "MOVE_B": 2 * m,
  }
  assert 0 < summary["host_busy_us"] <= summary["wall_us"]
  for kind in summary["ops"].values():
    assert 0 <= kind["dispatch_us_each"] <= kind["us_each"]
  assert summary["devices"] == {}  # a CPU has no device rows
  print(trace_breakdown.table({"async": summary}))
