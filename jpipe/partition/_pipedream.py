"""PipeDream's partitioner: min-max DP over antichains, with replication.

A port of ``optimizer/optimizer_graph_hierarchical.py`` (msr-fiddle/
pipedream). States are the antichain DAG's states (see ``_antichain``);
``T[i][j]`` is the compute of states i..j (after state i-1; row 0 from the
start). ``A[i][j][m]`` is the best time per minibatch of states i..j on
m+1 machines::

  base:  A = (T + 4 (r-1) P / (B r) / g) / r          one stage, r = m+1
  step:  A = max(A[i][k][m-m'], (T[k+1][j] + 4 (m'-1) P / (B m')) / m',
                 [2 out[k] / (B m' c), 2 out[j] / (B m' c)])

over k a predecessor of j and m' machines for the last stage; the bracket
is counted only with an activation compression ratio c (PipeDream's
default, None, ignores point-to-point transfers). ``g`` is the number of
machines of one unit of the level below (1 at the innermost level).
Levels are solved innermost first; each level's ``A[i][j][M-1]`` becomes
the next level's ``T[i][j]``. Seconds and bytes throughout.

Where PipeDream iterates a Python set (predecessor states), candidates are
tried by ascending m' and then state index, so equal-time ties can resolve
differently; the optimal time is the same. A missing entry (PipeDream's
None) is +inf here, so ``use_fewer_machines`` never compares None.
"""

import dataclasses
import math
import time
from collections.abc import Sequence

import numpy as np

from jpipe.partition import _antichain, _branches
from jpipe.partition import _pipedream_dp as _dp
from jpipe.partition._cost_model import MemoryLimitError
from jpipe.partition._graph_txt import ProfileGraph

# Refuse DPs that would run for minutes (element operations, Model.work).
_MAX_WORK = 5e9


@dataclasses.dataclass(frozen=True)
class PipeDreamSolution:
  """PipeDream's partition of a profile, as its optimizer prints it.

  Attributes:
    stage_of: node name -> stage, for every node of the graph (inputs in
      stage 0, removed ``__getitem__`` sinks with their producer).
    replicas: machines per stage (the product over levels), [num_stages];
      stage s runs on machines ``sum(replicas[:s])`` onwards.
    stage_compute_seconds: forward + backward of each stage's nodes on one
      machine (not divided by replicas).
    stage_seconds: each stage's time per minibatch in PipeDream's model
      (compute and all-reduce over its replicas, transfers if counted);
      its max is ``bottleneck_seconds`` for one level, an estimate with
      several.
    bottleneck_seconds: PipeDream's objective, the pipeline's time per
      minibatch (``A[0][S-1][M-1]`` of the outermost level).
    sequential_seconds: forward + backward of the whole graph.
    data_parallel_seconds: time per minibatch of data parallelism on all
      machines, levels folded as PipeDream prints it.
    level_stages: per level (innermost first), PipeDream's printout
      ``((start, end), compute seconds, replication)`` per stage, with
      state ranges [start, end).
    num_states: states of the antichain DAG.
    solve_seconds: wall time of the solve.
  """

  stage_of: dict[str, int]
  replicas: tuple[int, ...]
  stage_compute_seconds: tuple[float, ...]
  stage_seconds: tuple[float, ...]
  bottleneck_seconds: float
  sequential_seconds: float
  data_parallel_seconds: float
  level_stages: tuple[tuple[tuple[tuple[int, int], float, int], ...], ...]
  num_states: int
  solve_seconds: float

  @property
  def num_stages(self) -> int:
    return len(self.replicas)

  @property
  def speedup_vs_data_parallel(self) -> float:
    """PipeDream's "Throughput increase (compared to DP)"."""
    return self.data_parallel_seconds / self.bottleneck_seconds

  @property
  def speedup_vs_sequential(self) -> float:
    return self.sequential_seconds / self.bottleneck_seconds

  def config(self) -> str:
    """Replication per stage as PipeDream's papers write it ("15-1")."""
    return "-".join(str(r) for r in self.replicas)


def solve_pipedream(
  graph: ProfileGraph,
  num_machines: int | Sequence[int],
  *,
  bandwidth: float | Sequence[float] = 1e9,
  memory_bytes: float = 16e9,
  use_memory_constraint: bool = False,
  straight: bool = False,
  use_fewer_machines: bool = False,
  activation_compression_ratio: float | None = None,
  compress_branches: bool = False,
  max_states: int = 10_000,
) -> PipeDreamSolution:
  """PipeDream's optimal (replicated) pipeline for a profile.

  Args:
    graph: a profile (``load_pipedream_profile``).
    num_machines: machines per level, innermost first (``-n``); an int is
      one level. The total is their product.
    bandwidth: bytes/s per level (``-b``); a float applies to all levels.
    memory_bytes: memory per machine (``-s``).
    use_memory_constraint: skip stages whose stashed activations and
      params, ``ceil((M - used) / r) * (act + params)``, exceed
      ``memory_bytes``.
    straight: no replication (``--straight_pipeline``).
    use_fewer_machines: a range may leave machines idle when that is
      faster.
    activation_compression_ratio: None ignores point-to-point transfers
      (PipeDream's default); 1 counts them uncompressed.
    compress_branches: merge single-in/single-out chains first (PipeDream's
      ``compress_graph_branches.py``, needed for Inception-like graphs);
      ``stage_of`` still names the original nodes.
    max_states: refuse antichain DAGs larger than this.

  Returns:
    The solution.

  Raises:
    ValueError: bad arguments, a DAG or DP too large, or no partition
      (the message names the smallest memory that fits, or the most
      stages a straight pipeline can have).
  """
  start = time.perf_counter()
  machines, bandwidths = _levels(num_machines, bandwidth)
  if not memory_bytes > 0:
    raise ValueError(f"memory_bytes must be > 0, got {memory_bytes}")
  if activation_compression_ratio is not None and not (
    activation_compression_ratio > 0
  ):
    raise ValueError(
      "activation_compression_ratio must be > 0 or None, got "
      f"{activation_compression_ratio}"
    )
  original = graph
  compressed = None
  if compress_branches:
    compressed = _branches.compress_branches(graph)
    graph = compressed.graph
  dag = _antichain.antichain_dag(graph, max_states=max_states)
  model = _dp.Model(
    dag,
    machines,
    bandwidths,
    memory_bytes if use_memory_constraint else None,
    straight,
    use_fewer_machines,
    activation_compression_ratio,
  )
  if model.work() > _MAX_WORK:
    raise ValueError(
      f"the DP over {dag.num_states} antichain states with machines "
      f"{machines} needs ~{model.work():.2g} operations (levels below the "
      "outermost grow with states**3): use compress_branches=True, fewer "
      "levels or fewer machines"
    )
  levels = model.solve()
  objective = float(levels[-1][1][0, -1, machines[-1] - 1])
  if not np.isfinite(objective):
    raise MemoryLimitError(_why_infeasible(model, memory_bytes))
  stages = _dp.backtrack(model, levels)
  of = _assign(graph, dag, stages)
  names_stage = dict(zip(graph.names, of.tolist(), strict=True))
  if compressed is not None:
    names_stage = compressed.expand(names_stage, original)
    of = np.array([names_stage[n] for n in original.names])
  sol = _finish(original, model, stages, of, names_stage, objective)
  return dataclasses.replace(sol, solve_seconds=time.perf_counter() - start)


def _levels(num_machines, bandwidth):
  machines = (
    [num_machines]
    if isinstance(num_machines, int | np.integer)
    else list(num_machines)
  )
  if not machines:
    raise ValueError("num_machines needs at least one level")
  for m in machines:
    if not isinstance(m, int | np.integer) or m < 1:
      raise ValueError(f"machines per level must be ints >= 1, got {m!r}")
  if isinstance(bandwidth, int | float | np.number):
    bandwidths = [float(bandwidth)] * len(machines)
  else:
    bandwidths = [float(b) for b in bandwidth]
  if len(bandwidths) != len(machines):
    raise ValueError(
      f"{len(machines)} levels of machines but {len(bandwidths)} "
      "bandwidths: give one per level"
    )
  if not all(b > 0 for b in bandwidths):
    raise ValueError(f"bandwidths must be > 0 bytes/s, got {bandwidths}")
  return [int(m) for m in machines], bandwidths


def _why_infeasible(model, memory):
  """The error message when the outermost A[0][S-1][M-1] is +inf."""
  if model.memory is not None:
    need = model.solve(need=True)
    least = float(need[-1][1][0, -1, model.machines[-1] - 1])
    if np.isfinite(least):
      return (
        f"no partition fits memory_bytes={memory:.10g} under PipeDream's "
        f"memory model; the smallest memory that fits is {least:.10g} "
        "bytes per machine (or drop use_memory_constraint)"
      )
  depth = _dp.max_stages(model.dag.ancestors)
  return (
    f"no straight pipeline uses exactly {model.machines} machines: this "
    f"graph's antichain DAG allows at most {depth} stages; pass "
    "use_fewer_machines=True, fewer machines, or allow replication"
  )


def _assign(graph, dag, stages):
  """Stage of every node, [N]: PipeDream's first-come assignment by the
  predecessors of each stage's last antichain; removed inputs go to stage 0
  and removed sinks (and anything unreached) to their producers' stage."""
  ranges, _ = stages
  stage = np.full(graph.num_nodes, -1, np.int64)
  assigned = 0
  for s, ((_, end), _) in enumerate(ranges):
    new = dag.done[end - 1] & ~assigned
    stage[_antichain.bits(new)] = s
    assigned |= new
  stage[list(dag.removed_inputs)] = 0
  if (stage < 0).any():  # producers before consumers: any order will do
    n = graph.num_nodes
    producers, succ, indeg = (
      [[] for _ in range(n)],
      [[] for _ in range(n)],
      [0] * n,
    )
    for u, v in graph.edges:
      producers[v].append(u)
      succ[u].append(v)
      indeg[v] += 1
    for v in _antichain.topological_order(succ, indeg):
      if stage[v] < 0:
        known = [stage[u] for u in producers[v] if stage[u] >= 0]
        stage[v] = max(known) if known else 0
  return stage


def _finish(graph, model, stages, of, names_stage, objective):
  """The solution; ``of``: the stage of each node, [N]."""
  ranges, printed = stages
  inputs = np.array(
    [
      d[:5] == "Input" and graph.is_input(i)
      for i, d in enumerate(graph.descriptions)
    ]
  )
  compute = np.where(
    inputs, 0.0, graph.forward_seconds + graph.backward_seconds
  )
  n = len(ranges)
  comp = np.bincount(of, compute, minlength=n).tolist()
  par = np.bincount(of, graph.parameter_bytes, minlength=n).tolist()
  dag = model.dag
  stage_seconds = []
  for s, ((start, end), factors) in enumerate(ranges):
    t, g = comp[s], 1
    for r, b, m in zip(factors, model.bandwidths, model.machines, strict=True):
      t = (t + (4 * (r - 1) * par[s]) / (b * r) / g) / r
      g = m
    if model.rc is not None and start > 0:
      scale = model.bandwidths[0] * factors[0] * model.rc
      t = max(t, 2.0 * dag.output_bytes[start - 1] / scale)
      if end < model.num_states:
        t = max(t, 2.0 * dag.output_bytes[end - 1] / scale)
    stage_seconds.append(float(t))
  total = float(dag.compute_seconds[-1])
  total_par = float(dag.parameter_bytes[-1])
  dp, g = total, 1
  for m, b in zip(model.machines, model.bandwidths, strict=True):
    dp = (dp + (4 * (m - 1) * total_par) / (b * m) / g) / m
    g = m
  return PipeDreamSolution(
    stage_of=names_stage,
    replicas=tuple(math.prod(f) for _, f in ranges),
    stage_compute_seconds=tuple(comp),
    stage_seconds=tuple(stage_seconds),
    bottleneck_seconds=objective,
    sequential_seconds=total,
    data_parallel_seconds=float(dp),
    level_stages=printed,
    num_states=model.num_states,
    solve_seconds=0.0,
  )
