"""The antichain DAG and range tables against plain restatements.

``_antichain.antichain_dag`` works on bitsets, queues each state once and
finds a successor's nodes by unions of ancestors; ``_pipedream_dp``'s
``RangeTable`` makes entries when indexed. Here each is checked against
PipeDream's own formulation in plain Python sets (``graph/graph.py``:
deaugment by descendants, every visit queued) and the dense table.
"""

import collections
import dataclasses

import numpy as np
import pytest

from jpipe.partition import _antichain
from jpipe.partition._graph_txt import load_pipedream_profile
from jpipe.partition._pipedream_dp import RangeTable
from tests.partition.test_pipedream import _random_dag


def _closure(succ, nodes):
  """Strict descendants of each node, as sets."""
  desc = {}

  def walk(u):
    if u not in desc:
      desc[u] = set()
      for v in succ[u]:
        desc[u] |= {v} | walk(v)
    return desc[u]

  for u in nodes:
    walk(u)
  return desc


def _reference(graph):
  """(augmented antichains in the DAG's order, ancestor sets) by PipeDream's
  set formulation, ascending node order where it iterates a set."""
  keep, _, _ = _antichain.optimizer_nodes(graph)
  nodes = [i for i in range(graph.num_nodes) if keep[i]]
  succ = {u: [] for u in nodes}
  for u, v in graph.edges:
    if keep[u] and keep[v]:
      succ[u].append(v)
  desc = _closure(succ, nodes)
  pred = {u: {p for p in nodes if u in desc[p]} for u in nodes}

  def augment(antichain):
    extra = set()
    for a in antichain:
      inside = pred[a] | {a}
      extra |= {p for p in pred[a] if set(succ[p]) - inside}
    return sorted(extra) + list(antichain)

  def deaugment(listed):
    out = []
    for x in listed:
      if not desc[x] & set(listed) and x not in out:
        out.append(x)
    return out

  source = next(u for u in nodes if not any(u in succ[p] for p in nodes))
  ids, found, edges = {frozenset([source]): 0}, [[source]], [[]]
  queue, expanded = collections.deque([[source]]), set()
  while queue:
    antichain = queue.popleft()
    key = frozenset(antichain)
    if key in expanded:
      continue
    expanded.add(key)
    aug = augment(antichain)
    for u in aug:
      for v in succ[u]:
        if v in antichain or desc[v] & set(aug):
          continue
        nxt = deaugment([v if x == u else x for x in aug])
        if frozenset(nxt) not in ids:
          ids[frozenset(nxt)] = len(found)
          found.append(nxt)
          edges.append([])
        edges[ids[key]].append(ids[frozenset(nxt)])
        queue.append(nxt)
  order = _antichain._dfs_topological(edges)
  reach = _closure(dict(enumerate(edges)), range(len(found)))
  position = {k: i for i, k in enumerate(order)}
  ancestors = [
    {position[k] for k in range(len(found)) if j in reach[k]} for j in order
  ]
  return [augment(found[k]) for k in order], ancestors


def _check(graph):
  dag = _antichain.antichain_dag(graph)
  antichains, ancestors = _reference(graph)
  assert [list(a) for a in dag.antichains] == antichains
  assert [set(np.flatnonzero(row)) for row in dag.ancestors] == ancestors
  # A state's compute: its nodes and their ancestors (inputs removed).
  keep, _, _ = _antichain.optimizer_nodes(graph)
  parents = collections.defaultdict(list)
  for u, v in graph.edges:
    if keep[u]:
      parents[v].append(u)
  compute = graph.forward_seconds + graph.backward_seconds
  for aug, seconds in zip(antichains, dag.compute_seconds, strict=True):
    done, stack = set(aug), list(aug)
    while stack:
      for u in parents[stack.pop()]:
        if u not in done:
          done.add(u)
          stack.append(u)
    assert seconds == pytest.approx(compute[sorted(done)].sum(), rel=1e-12)


@pytest.mark.parametrize("seed", range(8))
def test_antichain_dag_matches_set_formulation_on_random_dags(seed):
  rng = np.random.default_rng(100 + seed)
  _check(_random_dag(rng, int(rng.integers(4, 12))))


@pytest.mark.parametrize("name", ["alexnet", "resnet18", "gnmt"])
def test_antichain_dag_matches_set_formulation_on_profiles(name):
  _check(load_pipedream_profile(name))


def test_bits_lists_set_bits_ascending():
  rng = np.random.default_rng(0)
  for width in (1, 7, 64, 300):
    for _ in range(20):
      want = sorted(rng.choice(width, rng.integers(width + 1), replace=False))
      mask = sum(1 << int(i) for i in want)
      assert _antichain.bits(mask) == [int(i) for i in want]


def test_range_table_equals_the_dense_table():
  rng = np.random.default_rng(0)
  s = 9
  act, par = rng.uniform(0, 1e6, s).cumsum(), rng.uniform(0, 1e6, s).cumsum()
  dense = np.full((s + 1, s), np.nan)  # PipeDream's T[i][j], None as NaN
  for i in range(s + 1):
    for j in range(s):
      if i == 0:
        dense[i, j] = act[j] + par[j]
      elif j >= i:
        dense[i, j] = (act[j] - act[i - 1]) + (par[j] - par[i - 1])
  table = RangeTable((act, par), fill=-1.0)
  want = np.where(np.isnan(dense), -1.0, dense)
  for i in range(s + 1):
    np.testing.assert_array_equal(table[i], want[i])
  rows, cols = rng.integers(0, s + 1, 50), rng.integers(0, s, 50)
  np.testing.assert_array_equal(table[rows, cols], want[rows, cols])


def test_frontiers_the_same_in_blocks():
  graph = load_pipedream_profile("resnet18")
  keep, _, _ = _antichain.optimizer_nodes(graph)
  dag = _antichain._Dag(graph.num_nodes, graph.edges, keep)
  n = graph.num_nodes
  whole = [dag.frontier(a) for a in range(n)]
  assert any(whole)
  blocks, lists = _antichain._frontiers(n, dag.succ, dag.below, 3 * n, 0)
  assert blocks == whole  # the bit matrix, in blocks, as bit by bit
  assert lists == dag.front_lists == [_antichain.bits(f) for f in whole]


@pytest.mark.parametrize("integers", [True, False])
def test_output_bytes_all_at_once_equal_state_by_state(integers):
  """``_output_bytes`` adds every state's activations at once; it equals
  ``_crossing_bytes`` state by state, bit for bit, also where a state's
  augmented antichain holds 8 or more nodes (gnmt_large: up to 11) and
  the bytes are not integers (numpy sums those lists pairwise)."""
  graph = load_pipedream_profile("gnmt_large")
  if not integers:  # magnitudes far apart: the order of the sum shows
    rng = np.random.default_rng(0)
    n = graph.num_nodes
    acts = rng.uniform(1, 2, n) * 10 ** rng.uniform(-8, 8, n)
    graph = dataclasses.replace(graph, activation_bytes=acts)
  dag = _antichain.antichain_dag(graph)
  assert max(map(len, dag.antichains)) >= 8
  want = [
    _antichain._crossing_bytes(graph, a, m)
    for a, m in zip(dag.antichains, dag.done, strict=True)
  ]
  assert dag.output_bytes.tolist() == want
