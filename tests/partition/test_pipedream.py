"""PipeDream's optimizer: antichain DAG, branch compression and the DP."""

import itertools
import json
import math
import re
import subprocess
import sys

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jpipe import partition
from jpipe.partition import _antichain, _branches, _plan
from jpipe.partition._graph_txt import (
  ProfileGraph,
  load_pipedream_profile,
  profile_path,
)


def _profile(name):
  """One of PipeDream's 14 published profiles, as jpipe ships them."""
  return load_pipedream_profile(name)


def _graph(costs, edges, descriptions=None, acts=None, params=None):
  n = len(costs)
  return ProfileGraph(
    names=tuple(f"node{i}" for i in range(n)),
    descriptions=tuple(descriptions or ["Layer"] * n),
    forward_seconds=np.asarray(costs, np.float64) / 3,
    backward_seconds=np.asarray(costs, np.float64) * 2 / 3,
    activation_bytes=np.asarray(acts if acts is not None else [0.0] * n),
    parameter_bytes=np.asarray(params if params is not None else [0.0] * n),
    edges=tuple(edges),
  )


def _random_dag(rng, n):
  """A DAG with node 0 its only source: every node has an earlier parent."""
  edges = set()
  for v in range(1, n):
    edges.add((int(rng.integers(v)), v))
    for u in range(v):
      if rng.random() < 0.25:
        edges.add((u, v))
  return _graph(
    rng.uniform(1.0, 10.0, n),
    sorted(edges),
    acts=rng.uniform(1e6, 1e8, n).round(),
    params=rng.uniform(0, 1e8, n).round(),
  )


# An independent reference: every chain of downsets (cuts) and replicas.


def _brute_force(
  graph,
  machines,
  *,
  bandwidth,
  memory=None,
  straight=False,
  fewer=False,
  rc=None,
):
  n = graph.num_nodes
  succ = [set() for _ in range(n)]
  for u, v in graph.edges:
    succ[u].add(v)
  anc = [set() for _ in range(n)]
  for v in range(n):  # nodes are numbered topologically
    for u, w in graph.edges:
      if w == v:
        anc[v] |= anc[u] | {u}
  downsets = [
    frozenset(d)
    for size in range(1, n + 1)
    for d in itertools.combinations(range(n), size)
    if all(anc[v] <= set(d) for v in d)
  ]
  full = frozenset(range(n))
  cost = graph.forward_seconds + graph.backward_seconds

  def out_bytes(done):
    # PipeDream's augmented antichain: the maximal nodes, plus the
    # predecessors of each with an edge leaving its own predecessors.
    top = {a for a in done if not succ[a] & done}
    extra = {p for a in top for p in anc[a] if succ[p] - anc[a] - {a}}
    return sum(graph.activation_bytes[x] for x in top | extra)

  def stage_time(prev, done, r, cum):
    nodes = done - prev
    c = sum(cost[x] for x in nodes)
    p = sum(graph.parameter_bytes[x] for x in nodes)
    a = sum(graph.activation_bytes[x] for x in nodes)
    if memory is not None and math.ceil((machines - cum) / r) * (a + p) > (
      memory
    ):
      return math.inf
    t = (c + 4 * (r - 1) * p / (bandwidth * r)) / r
    if prev and rc is not None:
      t = max(t, 2 * out_bytes(prev) / (bandwidth * r * rc))
      if done != full:
        t = max(t, 2 * out_bytes(done) / (bandwidth * r * rc))
    return t

  best = math.inf

  def walk(prev, cum, worst):
    nonlocal best
    for done in downsets:
      if not prev < done:
        continue
      for r in range(1, min(1 if straight else machines, machines - cum) + 1):
        t = max(worst, stage_time(prev, done, r, cum + r))
        if done == full:
          if cum + r == machines or fewer:
            best = min(best, t)
        else:
          walk(done, cum + r, t)

  walk(frozenset(), 0, 0.0)
  return best


FLAGS = [
  dict(),
  dict(straight=True),
  dict(fewer=True),
  dict(rc=1.0),
  dict(straight=True, rc=2.0),
  dict(memory=2.5e8),
  dict(straight=True, fewer=True),
]


@pytest.mark.parametrize("seed", range(12))
@pytest.mark.parametrize("flags", FLAGS, ids=lambda f: str(f) or "default")
def test_matches_brute_force_on_random_dags(seed, flags):
  rng = np.random.default_rng(seed)
  graph = _random_dag(rng, int(rng.integers(3, 7)))
  machines = int(rng.integers(1, 5))
  bandwidth = float(rng.choice([1e8, 1e9, 1e10]))
  want = _brute_force(graph, machines, bandwidth=bandwidth, **flags)
  kwargs = dict(
    bandwidth=bandwidth,
    straight=flags.get("straight", False),
    use_fewer_machines=flags.get("fewer", False),
    activation_compression_ratio=flags.get("rc"),
    use_memory_constraint="memory" in flags,
    memory_bytes=flags.get("memory", 16e9),
  )
  if not np.isfinite(want):
    with pytest.raises(ValueError, match="no partition fits|no straight"):
      partition.solve_pipedream(graph, machines, **kwargs)
    return
  sol = partition.solve_pipedream(graph, machines, **kwargs)
  assert sol.bottleneck_seconds == pytest.approx(want, rel=1e-12)
  # The backtracked stages realise the objective.
  assert max(sol.stage_seconds) == pytest.approx(want, rel=1e-9)
  if flags.get("fewer"):
    assert sum(sol.replicas) <= machines
  else:
    assert sum(sol.replicas) == machines
  if flags.get("straight"):
    assert set(sol.replicas) == {1}
  stage = [sol.stage_of[name] for name in graph.names]
  assert all(stage[u] <= stage[v] for u, v in graph.edges)
  assert sorted(set(stage)) == list(range(sol.num_stages))


@settings(max_examples=60, deadline=None)
@given(
  costs=st.lists(st.floats(0.0, 10.0), min_size=1, max_size=14),
  stages=st.integers(1, 6),
)
def test_straight_chain_equals_contiguous(costs, stages):
  stages = min(stages, len(costs))
  graph = _graph(costs, [(i, i + 1) for i in range(len(costs) - 1)])
  _, compute, _ = graph.ordered()
  want = partition.solve_contiguous(
    partition.GraphCosts(compute), stages
  ).bottleneck_seconds
  sol = partition.solve_pipedream(graph, stages, straight=True)
  assert sol.bottleneck_seconds == pytest.approx(want, rel=1e-12, abs=1e-15)
  assert sol.num_stages == stages


def test_antichain_states_of_a_chain_and_a_diamond():
  chain = _antichain.antichain_dag(_graph([1.0] * 4, [(0, 1), (1, 2), (2, 3)]))
  assert chain.num_states == 4
  np.testing.assert_allclose(chain.compute_seconds, [1, 2, 3, 4])
  # 0 -> {1, 2} -> 3: states {0}, {1}, {2}, {1, 2}, {3}, as augmented
  # antichains (plus the predecessors whose outputs leave the done set).
  diamond = _antichain.antichain_dag(
    _graph([1.0] * 4, [(0, 1), (0, 2), (1, 3), (2, 3)], acts=[1, 10, 100, 0])
  )
  assert diamond.num_states == 5
  sets = [frozenset(a) for a in diamond.antichains]
  assert sets[0] == {0} and sets[-1] == {3}
  # BFS finds {1} before {2}; PipeDream's DFS sort then lists {2} first.
  # The state {1, 2} still carries node 0 (augmented through node 1).
  assert sets == [{0}, {0, 2}, {0, 1}, {0, 1, 2}, {3}]
  np.testing.assert_allclose(diamond.compute_seconds, [1, 2, 2, 3, 4])
  np.testing.assert_allclose(diamond.output_bytes, [1, 101, 11, 111, 0])
  np.testing.assert_array_equal(diamond.ancestors.sum(1), [0, 1, 1, 3, 4])


def test_inputs_go_to_stage_zero_and_getitem_sinks_follow_producers():
  graph = _graph(
    [5.0, 1.0, 1.0, 1.0, 0.0],
    [(0, 1), (1, 2), (2, 3), (3, 4)],
    descriptions=["Input0", "Linear", "Linear", "Linear", "Linear"],
  )
  sol = partition.solve_pipedream(graph, 3, straight=True)
  assert sol.stage_of["node0"] == 0
  assert sol.bottleneck_seconds == pytest.approx(1.0)  # input time is free
  sinks = _graph(
    [1.0, 1.0, 0.0],
    [(0, 1), (1, 2)],
    descriptions=["Linear", "Linear", "__getitem__(0)"],
  )
  dag = _antichain.antichain_dag(sinks)
  assert dag.removed_sinks == (2,) and dag.num_states == 2
  sol = partition.solve_pipedream(sinks, 2, straight=True)
  assert sol.stage_of == {"node0": 0, "node1": 1, "node2": 1}


def test_compress_branches_merges_chains_after_a_fork():
  # 0 -> 1 -> 2 -> 4 and 0 -> 3 -> 4: each branch becomes a new node (a
  # chain of one keeps its node's description).
  graph = _graph(
    [1.0, 2.0, 3.0, 4.0, 5.0],
    [(0, 1), (1, 2), (2, 4), (0, 3), (3, 4)],
    acts=[1, 2, 3, 4, 5],
    params=[10, 20, 30, 40, 50],
  )
  comp = _branches.compress_branches(graph)
  assert comp.graph.names == (
    "node0",
    "compressed_node0",
    "compressed_node1",
    "node4",
  )
  assert comp.members == ((0,), (1, 2), (3,), (4,))
  assert comp.graph.descriptions[2] == "Layer"
  i = comp.graph.names.index("compressed_node0")
  assert comp.graph.parameter_bytes[i] == 50.0  # summed
  assert comp.graph.activation_bytes[i] == 3.0  # the last node's
  assert comp.graph.descriptions[i] == "Branch 0"
  assert len(comp.graph.edges) == 4


@pytest.mark.parametrize(
  "name", ["resnet18", "inception_v3", "densenet121", "gnmt"]
)
def test_compress_branches_keeps_every_node_and_cost(name):
  graph = _profile(name)
  comp = _branches.compress_branches(graph)
  members = sorted(i for m in comp.members for i in m)
  assert members == list(range(graph.num_nodes))
  for attr in ("forward_seconds", "backward_seconds", "parameter_bytes"):
    assert getattr(comp.graph, attr).sum() == pytest.approx(
      getattr(graph, attr).sum()
    )
  assert comp.graph.num_nodes < graph.num_nodes


def test_branchy_graphs_need_compression():
  graph = _profile("inception_v3")
  with pytest.raises(ValueError, match="more than 5000 states"):
    partition.solve_pipedream(graph, 4, max_states=5000)
  sol = partition.solve_pipedream(graph, 4, compress_branches=True)
  assert set(sol.stage_of) == set(graph.names)
  assert sol.num_states < 5000


# PipeDream's documented configurations (spec A2, checked-in confs).


def test_vgg16_on_4_machines_is_3_1():
  graph = _profile("vgg16")
  sol = partition.solve_pipedream(graph, 4)  # PipeDream's defaults
  assert sol.config() == "3-1"
  assert sol.speedup_vs_data_parallel > 3.0
  # Against one machine: the whole model's time over the bottleneck's.
  # Against one machine: every node but the input (PipeDream zeroes it),
  # over the bottleneck stage's time.
  fed = {v for _, v in graph.edges}
  whole = sum(
    graph.forward_seconds[i] + graph.backward_seconds[i]
    for i in range(graph.num_nodes)
    if i in fed
  )
  assert sol.speedup_vs_sequential == pytest.approx(
    whole / sol.bottleneck_seconds
  )
  # Stage 0 is the first convolutions; the classifier is in stage 1.
  assert sol.stage_of["node2"] == 0 and sol.stage_of["node40"] == 1
  assert sol.level_stages[0][0][2] == 3


def test_vgg16_published_8_and_16_machine_configs():
  graph = _profile("vgg16")
  assert partition.solve_pipedream(graph, 8, bandwidth=1e10).config() == "7-1"
  assert partition.solve_pipedream(graph, 16, bandwidth=5e9).config() == "15-1"
  # Two levels (4 servers of 4) replicate in whole servers at the top.
  two = partition.solve_pipedream(graph, [4, 4], bandwidth=[1e10, 1.25e9])
  assert two.config() == "12-3-1"
  assert [r for *_, r in two.level_stages[1]] == [3, 1]


def test_gnmt8_on_4_machines_is_straight():
  sol = partition.solve_pipedream(_profile("gnmt"), 4)
  assert sol.config() == "1-1-1-1"
  same = partition.solve_pipedream(_profile("gnmt"), 4, straight=True)
  assert same.bottleneck_seconds == sol.bottleneck_seconds


# Hierarchy, memory, fewer machines, transfers.


def test_one_machine_levels_change_nothing():
  graph = _profile("resnet18")
  flat = partition.solve_pipedream(graph, 4)
  for machines in ([4, 1], [1, 4]):
    sol = partition.solve_pipedream(graph, machines)
    assert sol.bottleneck_seconds == pytest.approx(flat.bottleneck_seconds)
    assert sol.replicas == flat.replicas


def test_hierarchy_uses_every_machine_and_folds_data_parallel_time():
  graph = _profile("alexnet")
  sol = partition.solve_pipedream(graph, [4, 2], bandwidth=[1e10, 1e9])
  assert sum(sol.replicas) == 8
  assert len(sol.level_stages) == 2
  top = sol.level_stages[1]
  assert sum(r for *_, r in top) == 2
  total = sol.sequential_seconds
  params = graph.parameter_bytes.sum()
  dp = (total + 4 * 3 * params / (1e10 * 4)) / 4
  dp = (dp + 4 * 1 * params / (1e9 * 2) / 4) / 2
  assert sol.data_parallel_seconds == pytest.approx(dp)
  with pytest.raises(ValueError, match="2 levels of machines but 3"):
    partition.solve_pipedream(graph, [4, 2], bandwidth=[1e9] * 3)


def test_memory_constraint_names_the_smallest_memory():
  graph = _profile("vgg16")
  with pytest.raises(ValueError, match="smallest memory that fits") as info:
    partition.solve_pipedream(
      graph, 4, straight=True, use_memory_constraint=True, memory_bytes=1e9
    )
  least = float(re.search(r"fits is (\S+) bytes", str(info.value))[1])
  assert least > 1e9
  ok = partition.solve_pipedream(
    graph, 4, straight=True, use_memory_constraint=True, memory_bytes=least
  )
  free = partition.solve_pipedream(graph, 4, straight=True)
  assert ok.bottleneck_seconds >= free.bottleneck_seconds
  with pytest.raises(ValueError, match="smallest memory"):
    partition.solve_pipedream(
      graph,
      4,
      straight=True,
      use_memory_constraint=True,
      memory_bytes=least * (1 - 1e-6),
    )


def test_too_many_straight_machines_and_use_fewer_machines():
  graph = _profile("alexnet")  # 22 states
  with pytest.raises(ValueError, match="at most 22 stages"):
    partition.solve_pipedream(graph, 30, straight=True)
  sol = partition.solve_pipedream(
    graph, 30, straight=True, use_fewer_machines=True
  )
  assert sum(sol.replicas) <= 22
  exact = partition.solve_pipedream(graph, 8, straight=True)
  fewer = partition.solve_pipedream(
    graph, 8, straight=True, use_fewer_machines=True
  )
  assert fewer.bottleneck_seconds <= exact.bottleneck_seconds
  assert sum(fewer.replicas) < 8  # alexnet's last layers don't pay off


def test_activation_compression_ratio_counts_transfers():
  graph = _profile("resnet50")
  kw = dict(straight=True, bandwidth=3e9)
  free = partition.solve_pipedream(graph, 8, **kw)
  raw = partition.solve_pipedream(
    graph, 8, activation_compression_ratio=1, **kw
  )
  quarter = partition.solve_pipedream(
    graph, 8, activation_compression_ratio=4, **kw
  )
  assert free.bottleneck_seconds < quarter.bottleneck_seconds
  assert quarter.bottleneck_seconds < raw.bottleneck_seconds
  fast = partition.solve_pipedream(
    graph, 8, straight=True, bandwidth=1e15, activation_compression_ratio=1
  )
  assert fast.bottleneck_seconds == pytest.approx(free.bottleneck_seconds)


@pytest.mark.parametrize(
  "kwargs, message",
  [
    (dict(num_machines=0), "ints >= 1"),
    (dict(num_machines=[]), "at least one level"),
    (dict(num_machines=4, bandwidth=0.0), "bandwidths must be > 0"),
    (dict(num_machines=4, memory_bytes=-1.0), "memory_bytes must be > 0"),
    (
      dict(num_machines=4, activation_compression_ratio=0.0),
      "activation_compression_ratio must be > 0",
    ),
    (dict(num_machines=[64, 64]), "operations"),
  ],
)
def test_bad_arguments(kwargs, message):
  with pytest.raises(ValueError, match=message):
    partition.solve_pipedream(_profile("gnmt_large"), **kwargs)


# Plans, CLI and the comparison with contiguous splits.


def test_plan_from_pipedream_is_contiguous_devices():
  graph = _profile("vgg16")
  sol = partition.solve_pipedream(graph, 4)
  plan = _plan.plan_from_pipedream(graph, sol)
  assert plan.method == "pipedream"
  assert plan.stage_devices == ((0, 1, 2), (3,))
  assert plan.bottleneck_seconds == sol.bottleneck_seconds
  # The runtime's steady-state delay n - 1 - s: 1 for stage 0, 0 for 1.
  assert plan.stage_stash_bytes == (plan.stage_param_bytes[0], 0.0)
  assert partition.Plan.from_json(plan.to_json()) == plan


def test_plan_traced_pipedream_on_a_chain_matches_contiguous():
  from tests.partition import flax_models

  loss_fn, params, batch, _ = flax_models.mlp_case()
  traced = partition.trace(loss_fn, params, batch)
  costs = partition.profile_nodes(traced, params, batch, method="analytic")
  ours = partition.plan_traced(traced, costs, 3, method="pipedream")
  theirs = partition.plan_traced(traced, costs, 3)
  assert ours.num_stages == 3
  assert ours.bottleneck_seconds <= theirs.bottleneck_seconds * (1 + 1e-12)
  with pytest.raises(ValueError, match="only the 'overlapped'"):
    partition.plan_traced(
      traced, costs, 3, method="pipedream", comm_model="ftpipe"
    )


def _cli(*args):
  return subprocess.run(
    [sys.executable, "-m", "jpipe.partition", *args],
    capture_output=True,
    text=True,
  )


def test_cli_pipedream_json():
  path = profile_path("vgg16")
  run = _cli("--pipedream-profile", path, "--machines", "4", "--json")
  assert run.returncode == 0, run.stderr
  result = json.loads(run.stdout)
  graph = load_pipedream_profile(path)
  assert result["method"] == "pipedream"  # the default
  assert set(result["stage_of"]) == set(graph.names)
  assert result["replicas"] == [3, 1]
  assert result["stage_devices"] == [[0, 1, 2], [3]]
  _, compute, _ = graph.ordered()
  assert sum(result["stage_costs"]) == pytest.approx(float(compute.sum()))
  assert result["bottleneck"] >= result["lower_bound"]
  assert result["solve_seconds"] < 5.0
  run = _cli(
    "--pipedream-profile",
    path,
    "--machines",
    "4",
    "4",
    "--bandwidth",
    "1e10",
    "1.25e9",
    "--json",
  )
  assert json.loads(run.stdout)["replicas"] == [12, 3, 1]


@pytest.mark.slow
def test_cli_pipedream_flags_and_errors():
  path = profile_path("alexnet")
  run = _cli("--pipedream-profile", path, "--stages", "30", "--straight")
  assert run.returncode == 2 and "at most 22 stages" in run.stderr
  # The fixes named as this command line's flags.
  assert "pass --use-fewer-machines, fewer machines, or drop --straight" in (
    run.stderr
  )
  run = _cli(
    "--pipedream-profile", path, "--stages", "90", "--method", "contiguous"
  )
  assert run.returncode == 2
  assert run.stderr.strip().endswith("stages: use between 1 and 23 stages")
  run = _cli(
    "--pipedream-profile",
    path,
    "--stages",
    "30",
    "--straight",
    "--use-fewer-machines",
    "--activation-compression-ratio",
    "1",
  )
  assert run.returncode == 0 and "replication 1-1" in run.stdout
  run = _cli(
    "--pipedream-profile",
    path,
    "--stages",
    "4",
    "--straight",
    "--use-memory-constraint",
    "--memory",
    "1e6",
  )
  assert run.returncode == 2 and "smallest memory that fits" in run.stderr
  run = _cli(
    "--pipedream-profile", path, "--machines", "2", "2", "--method", "mixed"
  )
  assert run.returncode == 2 and "one level of machines" in run.stderr


@pytest.mark.parametrize("n", [2, 4, 8])
def test_straight_pipedream_never_loses_to_one_order(n):
  # resnet18 as profiled; inception_v3 only after compression, compared
  # with the contiguous split of the compressed graph (same cut points).
  graph = _profile("resnet18")
  _, compute, _ = graph.ordered()
  contiguous = partition.solve_contiguous(
    partition.GraphCosts(compute), n
  ).bottleneck_seconds
  ours = partition.solve_pipedream(graph, n, straight=True)
  assert ours.bottleneck_seconds <= contiguous * (1 + 1e-12)
  if n == 8:  # cutting across residual branches pays off here
    assert ours.bottleneck_seconds < 0.96 * contiguous
  comp = _branches.compress_branches(_profile("inception_v3")).graph
  _, compute, _ = comp.ordered()
  contiguous = partition.solve_contiguous(
    partition.GraphCosts(compute), n
  ).bottleneck_seconds
  ours = partition.solve_pipedream(comp, n, straight=True)
  assert ours.bottleneck_seconds <= contiguous * (1 + 1e-12)


def test_edge_bytes_charge_a_cut_what_crosses_it():
  """A traced node may hand a large value to its successor and an 8-byte
  one (an RNG key) to a far node: with ``edge_bytes`` a cut after the
  successor is charged the key, not the node's whole activation."""
  import dataclasses

  acts = [1e9, 2e6, 3e6, 0.0]
  graph = _graph(
    [1.0] * 4, [(0, 1), (0, 3), (1, 2), (2, 3)], acts=acts, params=[0.0] * 4
  )
  whole = _antichain.antichain_dag(graph)
  cut = dataclasses.replace(graph, edge_bytes=(1e9, 8.0, 2e6, 3e6))
  per_edge = _antichain.antichain_dag(cut)
  assert whole.antichains == per_edge.antichains
  by_state = dict(zip(per_edge.antichains, per_edge.output_bytes, strict=True))
  assert by_state[(0, 1)] == 8.0 + 2e6  # The key and node 1's output.
  assert by_state[(0,)] == 1e9  # Node 0's output to node 1 crosses too.
  assert (
    dict(zip(whole.antichains, whole.output_bytes, strict=True))[(0, 1)]
    == 1e9 + 2e6
  )


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_edge_bytes_of_whole_activations_bound_pipedreams(seed):
  """Each edge carrying its source's whole activation (one output per
  layer, a profile's case): no cut is charged more than PipeDream's sum
  over the augmented antichain (which also counts a node whose every
  edge lands behind the cut, inside another member's predecessors), and
  on a chain exactly as much."""
  import dataclasses

  def whole(graph):
    return dataclasses.replace(
      graph,
      edge_bytes=tuple(
        float(graph.activation_bytes[u]) for u, _ in graph.edges
      ),
    )

  graph = _random_dag(np.random.default_rng(seed), 8)
  a, b = _antichain.antichain_dag(graph), _antichain.antichain_dag(whole(graph))
  assert a.antichains == b.antichains
  assert np.all(b.output_bytes <= a.output_bytes * (1 + 1e-12))
  chain = _graph(
    [1.0] * 6, [(i, i + 1) for i in range(5)], acts=[5.0, 4, 3, 2, 1, 0]
  )
  np.testing.assert_array_equal(
    _antichain.antichain_dag(chain).output_bytes,
    _antichain.antichain_dag(whole(chain)).output_bytes,
  )
