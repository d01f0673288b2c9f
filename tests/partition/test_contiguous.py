"""solve_contiguous against brute force over every split."""

import itertools

import numpy as np
import pytest

from jpipe.partition import GraphCosts, MemoryModel, solve_contiguous


def _brute_force(
  cost,
  edges,
  n_stages,
  bandwidth,
  static,
  acts,
  limit,
  comm_model="overlapped",
  params=None,
  versions=None,
  recompute=False,
  working=None,
):
  n = len(cost)
  best = np.inf
  for cuts in itertools.combinations(range(1, n), n_stages - 1):
    bounds = (0, *cuts, n)
    worst = 0.0
    for s in range(n_stages):
      a, b = bounds[s], bounds[s + 1]
      compute = sum(cost[a:b])
      into = sum(w for (u, v), w in edges.items() if u < a <= v < b)
      out = sum(w for (u, v), w in edges.items() if a <= u < b <= v)
      t = compute
      if bandwidth:
        t_in, t_out = 2 * into / bandwidth, 2 * out / bandwidth
        if comm_model == "overlapped":
          t = max(t, t_in, t_out)
        else:
          t = compute + max(0, t_in - compute) + max(0, t_out - compute)
      kept = into if recompute else sum(acts[a:b])  # Per microbatch.
      mem = sum(static[a:b]) + (n_stages - s) * kept
      if working is not None:
        mem += sum(working[a:b])
      if versions is not None:  # Stashed copies of the params.
        mem += (versions[s] - 1) * sum(params[a:b])
      if limit is not None and mem > limit:
        t = np.inf
      worst = max(worst, t)
    best = min(best, worst)
  return best


def _random_instance(rng, n):
  cost = rng.uniform(0.1, 1.0, n)
  edges = {(i, i + 1): float(rng.uniform(0, 5)) for i in range(n - 1)}
  for _ in range(n // 2):  # long skips
    u, v = sorted(rng.choice(n, 2, replace=False))
    edges[(int(u), int(v))] = float(rng.uniform(0, 5))
  return cost, edges


def _solve_as_expected(costs, n_stages, expected, memory):
  """solve_contiguous, checked against the brute force's bottleneck
  (``expected``; inf: no split fits, which must be the error)."""
  if not np.isfinite(expected):
    with pytest.raises(ValueError, match="smallest limit that fits"):
      solve_contiguous(costs, n_stages, memory=memory)
    return None
  sol = solve_contiguous(costs, n_stages, memory=memory)
  np.testing.assert_allclose(sol.bottleneck_seconds, expected, rtol=1e-12)
  return sol


@pytest.mark.parametrize("seed", range(12))
def test_matches_brute_force(seed):
  rng = np.random.default_rng(seed)
  n = int(rng.integers(3, 9))
  cost, edges = _random_instance(rng, n)
  static = rng.uniform(0, 2, n)
  acts = rng.uniform(0, 1, n)
  settings = itertools.product(
    range(1, min(n, 5) + 1), (None, 3.0), ("overlapped", "ftpipe")
  )
  for n_stages, bandwidth, model in settings:
    limit = float(rng.uniform(3, 8)) if seed % 2 else None
    expected = _brute_force(
      cost, edges, n_stages, bandwidth, static, acts, limit, model
    )
    costs = GraphCosts(cost, edges=edges, bandwidth=bandwidth, comm_model=model)
    memory = MemoryModel(
      static_bytes=static, activation_bytes=acts, limit=limit
    )
    sol = _solve_as_expected(costs, n_stages, expected, memory)
    if sol is None:
      continue
    assert max(sol.stage_seconds) == pytest.approx(expected)
    assert sol.boundaries[0] == 0 and sol.boundaries[-1] == n
    assert len(sol.stage_of_node()) == n


@pytest.mark.parametrize("seed", range(8))
@pytest.mark.parametrize("recompute", [False, True])
def test_memory_model_with_stashes_and_recompute_matches_brute_force(
  seed, recompute
):
  rng = np.random.default_rng(100 + seed)
  n = int(rng.integers(3, 8))
  cost, edges = _random_instance(rng, n)
  static, acts, params, working = (rng.uniform(0, 2, n) for _ in range(4))
  for n_stages in range(1, min(n, 4) + 1):
    versions = [n_stages - s for s in range(n_stages)]  # PipeDream's d + 1
    limit = float(rng.uniform(4, 12))
    expected = _brute_force(
      cost,
      edges,
      n_stages,
      None,
      static,
      acts,
      limit,
      params=params,
      versions=versions,
      recompute=recompute,
      working=working,
    )
    memory = MemoryModel(
      static_bytes=static,
      activation_bytes=acts,
      param_bytes=params,
      working_bytes=working,
      recompute=recompute,
      limit=limit,
      param_versions=versions,
    )
    sol = _solve_as_expected(
      GraphCosts(cost, edges=edges), n_stages, expected, memory
    )
    if sol is not None:
      assert max(sol.memory_bytes) <= limit  # The property: it fits.


def test_memory_error_names_the_limit_that_fits():
  cost = [1.0] * 6
  static = [4.0, 1.0, 1.0, 1.0, 1.0, 4.0]
  with pytest.raises(ValueError, match="smallest limit that fits") as err:
    solve_contiguous(
      GraphCosts(cost), 2, memory=MemoryModel(static_bytes=static, limit=5.0)
    )
  need = float(str(err.value).split("fits is ")[1].split(" bytes")[0])
  assert need == pytest.approx(6.0)
  sol = solve_contiguous(
    GraphCosts(cost), 2, memory=MemoryModel(static_bytes=static, limit=need)
  )
  assert max(sol.memory_bytes) <= need


def test_bad_input():
  with pytest.raises(ValueError, match="cannot split 3 nodes into 4 stages"):
    solve_contiguous(GraphCosts([1.0, 1.0, 1.0]), 4)
  with pytest.raises(ValueError, match="bandwidth must be > 0"):
    GraphCosts([1.0, 1.0], bandwidth=0.0)
  with pytest.raises(ValueError, match="does not go forward"):
    GraphCosts([1.0, 1.0], edges={(1, 0): 3.0})
  with pytest.raises(ValueError, match="unknown comm_model 'nccl'"):
    GraphCosts([1.0, 1.0], comm_model="nccl")
  with pytest.raises(ValueError, match="static_bytes needs 2 entries"):
    solve_contiguous(GraphCosts([1.0, 1.0]), 2, memory=MemoryModel([1.0]))
  with pytest.raises(ValueError, match="in_flight needs 2 entries"):
    solve_contiguous(
      GraphCosts([1.0, 1.0]), 2, memory=MemoryModel(in_flight=[1])
    )
