"""PipeDream's per-stage memory model (``pipedream_stage_memory``)."""

import math
import re

import numpy as np
import pytest

from jpipe import partition
from tests.partition.test_pipedream import _random_dag


def _restated(acts, params, stage_of, replicas):
  """PipeDream's recurrence term, stage by stage: the last stage on m'
  of the m + 1 machines used so far holds ceil((M - (m + 1)) / m')
  copies of its activations and params."""
  total, used, out = sum(replicas), 0, []
  for s, r in enumerate(replicas):
    used += r
    held = sum(
      a + p for a, p, t in zip(acts, params, stage_of, strict=True) if t == s
    )
    out.append(math.ceil((total - used) / r) * held)
  return out


def test_stage_memory_is_pipedreams_term():
  rng = np.random.default_rng(0)
  acts, params = rng.uniform(0, 1e6, 9), rng.uniform(0, 1e6, 9)
  stage_of = [0, 0, 0, 1, 1, 2, 2, 2, 3]
  for replicas in [(1, 1, 1, 1), (15, 1, 1, 1), (8, 5, 2, 1), (3, 1, 4, 2)]:
    got = partition.pipedream_stage_memory(acts, params, stage_of, replicas)
    want = _restated(acts, params, stage_of, replicas)
    np.testing.assert_allclose(got, want, rtol=1e-12)
    assert got[-1] == 0.0  # No machines after the last stage.
  with pytest.raises(ValueError, match="one replica count per stage"):
    partition.pipedream_stage_memory(acts, params, stage_of, (1, 1))


def _held(graph, sol):
  return partition.pipedream_stage_memory(
    graph.activation_bytes,
    graph.parameter_bytes,
    [sol.stage_of[name] for name in graph.names],
    sol.replicas,
  )


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_the_dps_smallest_memory_is_its_plans_largest_stage(seed):
  """Straight, with ``use_memory_constraint`` at the smallest memory the
  DP says fits: its plan's largest stage under this model is that
  memory (the vectorized DP and this restatement agree)."""
  graph = _random_dag(np.random.default_rng(seed), 7)
  flags = dict(straight=True, use_memory_constraint=True)
  with pytest.raises(ValueError, match="smallest memory that fits") as info:
    partition.solve_pipedream(graph, 4, memory_bytes=1.0, **flags)
  least = float(re.search(r"fits is (\S+) bytes", str(info.value))[1])
  sol = partition.solve_pipedream(graph, 4, memory_bytes=least, **flags)
  assert _held(graph, sol).max() == pytest.approx(least, rel=1e-9)


@pytest.mark.parametrize("seed", [2, 4, 9])
def test_a_replicated_plan_under_the_constraint_keeps_to_it(seed):
  """Links slow enough for a straight plan (1e6 bytes/s), then a memory
  just under its largest stage: the DP turns to a replicated plan whose
  every stage, replicas sharing the copies, fits."""
  graph = _random_dag(np.random.default_rng(seed), 7)
  free = partition.solve_pipedream(graph, 6, bandwidth=1e6)
  limit = _held(graph, free).max() * (1 - 1e-6)
  sol = partition.solve_pipedream(
    graph, 6, bandwidth=1e6, use_memory_constraint=True, memory_bytes=limit
  )
  assert max(sol.replicas) > 1
  assert _held(graph, sol).max() <= limit
