"""The solvers' two values: GraphCosts and MemoryModel (and MemoryBudget)."""

import dataclasses

import numpy as np
import pytest

from jpipe.partition import (
  GraphCosts,
  MemoryBudget,
  MemoryModel,
  solve_contiguous,
)


def _bytes_restated(of, edges, node, flight, versions, recompute):
  """Each stage's (persistent, working) bytes, one node at a time."""
  count = max(of) + 1
  persistent, working = np.zeros(count), np.zeros(count)
  for i, s in enumerate(of):
    persistent[s] += node["static"][i] + (versions[s] - 1) * node["params"][i]
    working[s] += node["working"][i]
    if not recompute:
      persistent[s] += flight[s] * node["acts"][i]
  if recompute:  # A microbatch in flight keeps what enters the stage.
    for (u, v), w in edges.items():
      if of[u] != of[v]:
        persistent[of[v]] += flight[of[v]] * w
  return persistent, working


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("recompute", [False, True])
@pytest.mark.parametrize("stashing", [False, True])
def test_stage_bytes_against_a_restatement(seed, recompute, stashing):
  rng = np.random.default_rng(seed)
  n, count = 9, 3
  node = {
    k: rng.uniform(0, 5, n) for k in ("static", "params", "acts", "working")
  }
  edges = {(i, i + 1): float(rng.uniform(0, 3)) for i in range(n - 1)}
  edges[(0, n - 1)] = 2.0  # A long skip into the last stage.
  of = np.sort(rng.integers(0, count, n))
  of[0], of[-1] = 0, count - 1
  model = MemoryModel(
    static_bytes=node["static"],
    activation_bytes=node["acts"],
    param_bytes=node["params"],
    working_bytes=node["working"],
    recompute=recompute,
    stashing=stashing,
  )
  got = model.bytes_of(of, edges)
  flight = [count - s for s in range(count)]
  versions = flight if stashing else [1] * count
  want = _bytes_restated(of, edges, node, flight, versions, recompute)
  np.testing.assert_allclose(got.persistent, want[0])
  np.testing.assert_allclose(got.working, want[1])
  # Explicit per-stage counts win over the defaults.
  explicit = dataclasses.replace(
    model, in_flight=[1, 1, 1], param_versions=[2, 1, 1]
  )
  got = explicit.bytes_of(of, edges)
  want = _bytes_restated(of, edges, node, [1, 1, 1], [2, 1, 1], recompute)
  np.testing.assert_allclose(got.persistent, want[0])


def test_a_permuted_graph_prices_the_same_stages_alike():
  """Property: solving the graph with its nodes renumbered by another
  topological order, then mapping the stages back, costs what the
  original graph's model says those stages cost."""
  rng = np.random.default_rng(0)
  n = 8
  cost = rng.uniform(0.5, 2.0, n)
  # Two parallel chains joined at the end: 0-2-4-6 and 1-3-5, both -> 7.
  edges = {(0, 2): 1.0, (2, 4): 1.0, (4, 6): 1.0, (6, 7): 1.0}
  edges |= {(1, 3): 2.0, (3, 5): 2.0, (5, 7): 2.0}
  graph = GraphCosts(cost, edges=edges, bandwidth=4.0)
  memory = MemoryModel(static_bytes=rng.uniform(0, 3, n))
  order = np.array([1, 3, 5, 0, 2, 4, 6, 7])  # Another topological order.
  permuted = solve_contiguous(
    graph.permuted(order), 3, memory=memory.permuted(order)
  )
  stage_of = np.empty(n, np.int64)
  stage_of[order] = permuted.stage_of_node()
  times = []
  for s in range(3):
    nodes = stage_of == s
    into = sum(w for (u, v), w in edges.items() if not nodes[u] and nodes[v])
    out = sum(w for (u, v), w in edges.items() if nodes[u] and not nodes[v])
    times.append(max(cost[nodes].sum(), 2 * into / 4.0, 2 * out / 4.0))
  np.testing.assert_allclose(permuted.stage_seconds, times)
  np.testing.assert_allclose(
    permuted.memory_bytes,
    np.bincount(stage_of, memory.static_bytes, 3),
  )


def test_budget_turns_into_the_documented_per_node_model():
  params, values = np.array([1.0, 2.0, 3.0]), np.array([4.0, 0.0, 1.0])
  budget = MemoryBudget(
    limit=100.0,
    optimizer_state_factor=1.0,
    in_flight=(2, 1),
    param_versions=(2, 1),
    recompute=True,
  )
  model = budget.model(params, values)
  np.testing.assert_array_equal(model.static_bytes, params * 3.0)  # p+g+state
  np.testing.assert_array_equal(model.working_bytes, values + params)
  assert (model.limit, model.recompute, model.in_flight) == (
    100.0,
    True,
    (2, 1),
  )
  assert budget.stashing
  # Per-stage counts for another stage count fall back to the defaults.
  other = budget.per_stage_counts_for(3)
  assert other.in_flight is None and other.param_versions is None
  assert budget.per_stage_counts_for(2) == budget


def test_bad_values_named():
  with pytest.raises(ValueError, match="last_stage_compute needs 2 entries"):
    GraphCosts([1.0, 1.0], last_stage_compute=[1.0])
  with pytest.raises(ValueError, match=r"compute_seconds must be \[N\]"):
    GraphCosts([[1.0]])
  with pytest.raises(ValueError, match="param_versions needs 2 entries >= 1"):
    MemoryModel(param_versions=[0, 1]).versions(2)
  with pytest.raises(dataclasses.FrozenInstanceError):
    GraphCosts([1.0]).bandwidth = 2.0
