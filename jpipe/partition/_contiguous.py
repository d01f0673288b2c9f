"""Exact min-max contiguous partition of a topologically ordered graph.

Nodes 0..N-1 in a topological order are cut into ``num_stages`` contiguous
runs, each stage priced by the cost model of ``_cost_model`` (compute,
transfers under ``"overlapped"`` or ``"ftpipe"``, memory). The dynamic
program over (stage count, prefix) is exact for either transfer model: it
returns the minimum bottleneck over all contiguous splits of the order,
subject to a per-stage memory limit.
"""

import dataclasses
from collections.abc import Sequence

import numpy as np

from jpipe.partition._cost_model import (
  COMM_MODELS,
  GraphCosts,
  MemoryLimitError,
  MemoryModel,
  TooFewNodes,
  stage_seconds,
)

__all__ = [
  "COMM_MODELS",
  "ContiguousSolution",
  "solve_contiguous",
  "stage_seconds",
]


def stage_of_node(boundaries: Sequence[int]) -> list[int]:
  """Stage index of every node from run boundaries (0, b1, ..., N)."""
  return np.repeat(
    np.arange(len(boundaries) - 1), np.diff(np.asarray(boundaries))
  ).tolist()


@dataclasses.dataclass(frozen=True)
class ContiguousSolution:
  """Stage boundaries and costs (seconds, bytes).

  ``boundaries[s]:boundaries[s+1]`` are the nodes of stage s.
  """

  boundaries: tuple[int, ...]
  stage_seconds: tuple[float, ...]
  compute_seconds: tuple[float, ...]
  memory_bytes: tuple[float, ...]
  bottleneck_seconds: float

  def stage_of_node(self) -> list[int]:
    return stage_of_node(self.boundaries)


def solve_contiguous(
  costs: GraphCosts,
  num_stages: int,
  *,
  memory: MemoryModel | None = None,
  stage_slowdown: Sequence[float] | None = None,
) -> ContiguousSolution:
  """Min-max bottleneck split of N ordered nodes into ``num_stages`` runs.

  Args:
    costs: the nodes' compute, edges and transfers (``GraphCosts``).
    num_stages: stages, 1 <= num_stages <= N.
    memory: each node's bytes and the per-stage limit (``MemoryModel``);
      None: no limit, and nothing counted.
    stage_slowdown: per stage slot, a factor on its compute (its device
      runs that much slower, e.g. under interference), [num_stages];
      default 1 everywhere.

  Returns:
    The optimal split.
  """
  n_nodes = costs.num_nodes
  if not 1 <= num_stages <= n_nodes:
    raise TooFewNodes(
      f"cannot split {n_nodes} nodes into {num_stages} stages: use between "
      f"1 and {n_nodes} stages, or trace the model at a larger depth to get "
      "more nodes"
    )
  runs = _Runs(costs, memory or MemoryModel(), num_stages, stage_slowdown)
  best, arg = _min_max(runs.objective, num_stages, n_nodes)
  if not np.isfinite(best[num_stages, n_nodes]):
    raise MemoryLimitError(_nothing_fits(runs, num_stages, n_nodes))
  bounds = _backtrack(arg, num_stages, n_nodes)
  pairs = list(enumerate(zip(bounds[:-1], bounds[1:], strict=True)))
  return ContiguousSolution(
    boundaries=bounds,
    stage_seconds=tuple(float(runs.time(s)[a, b]) for s, (a, b) in pairs),
    compute_seconds=tuple(
      float(runs.own_compute(s)[a, b]) * runs.slowdown[s] for s, (a, b) in pairs
    ),
    memory_bytes=tuple(float(runs.memory(s)[a, b]) for s, (a, b) in pairs),
    bottleneck_seconds=float(best[num_stages, n_nodes]),
  )


class _Runs:
  """Every run of nodes [start, end) priced as each stage s: tables
  [N+1, N+1] indexed [start, end] (inf where end <= start)."""

  def __init__(self, costs, memory, num_stages, stage_slowdown):
    n = costs.num_nodes
    self.costs, self.limit, self.num_stages = costs, memory.limit, num_stages
    self.recompute = memory.recompute
    node = memory.nodes(n)
    self.flight = memory.flight(num_stages)
    self.extra = memory.versions(num_stages) - 1.0  # Stashed copies.
    self.slowdown = np.asarray(
      [1.0] * num_stages if stage_slowdown is None else stage_slowdown,
      np.float64,
    )
    if self.slowdown.shape != (num_stages,) or np.any(self.slowdown <= 0):
      raise ValueError(f"stage_slowdown needs {num_stages} factors > 0")
    idx = np.arange(n + 1)
    self.starts, self.ends = idx[:, None], idx[None, :]
    self.valid = self.ends > self.starts
    self.compute = np.where(
      self.valid, self._sums(costs.compute_seconds), np.inf
    )
    self.last_compute = self.compute
    if costs.last_stage_compute is not None:
      self.last_compute = np.where(
        self.valid, self._sums(costs.last_stage_compute), np.inf
      )
    self.static = self._sums(node["static_bytes"])
    self.acts = self._sums(node["activation_bytes"])
    self.params = self._sums(node["param_bytes"])
    # (Added as prefixes, in the order the memory model always summed.)
    self.working_prefix = np.concatenate(
      [[0.0], np.cumsum(node["working_bytes"])]
    )
    self.cut_in, self.cut_out = _crossing_bytes(costs.edges, n)

  def _sums(self, values):
    """Each run's sum of ``values`` [N] (prefix differences)."""
    prefix = np.concatenate([[0.0], np.cumsum(values)])
    return prefix[self.ends] - prefix[self.starts]

  def own_compute(self, s):
    """Each run's compute seconds as stage s, before its slowdown."""
    return self.last_compute if s == self.num_stages - 1 else self.compute

  def time(self, s):
    """Each run's seconds as stage s."""
    slowed = self.own_compute(s) * self.slowdown[s]
    bandwidth = self.costs.bandwidth
    if bandwidth is None:
      return slowed
    return stage_seconds(
      slowed,
      2.0 * self.cut_in / bandwidth,
      2.0 * self.cut_out / bandwidth,
      self.costs.comm_model,
    )

  def memory(self, s):
    """Each run's bytes as stage s."""
    kept = self.cut_in if self.recompute else self.acts
    return (
      self.static
      + self.extra[s] * self.params
      + self.flight[s] * kept
      + self.working_prefix[self.ends]
      - self.working_prefix[self.starts]
    )

  def objective(self, s):
    """Each run's seconds as stage s; inf where it does not fit."""
    t = np.where(self.valid, self.time(s), np.inf)
    if self.limit is not None:
      t = np.where(self.memory(s) <= self.limit, t, np.inf)
    return t

  def memory_only(self, s):
    return np.where(self.valid, self.memory(s), np.inf)


def _min_max(objective, num_stages, n_nodes):
  """The DP over (stages, prefix): ``best[k, j]``, the least bottleneck of
  nodes [0, j) in k stages, and ``arg[k, j]``, its last stage's start."""
  idx = np.arange(n_nodes + 1)
  best = np.full((num_stages + 1, n_nodes + 1), np.inf)
  arg = np.zeros((num_stages + 1, n_nodes + 1), np.int64)
  best[0, 0] = 0.0
  for k in range(1, num_stages + 1):
    cand = np.maximum(best[k - 1][:, None], objective(k - 1))
    arg[k] = np.argmin(cand, axis=0)
    best[k] = cand[arg[k], idx]
  return best, arg


def _backtrack(arg, num_stages, n_nodes) -> tuple[int, ...]:
  bounds = [n_nodes]
  for k in range(num_stages, 0, -1):
    bounds.append(int(arg[k, bounds[-1]]))
  return tuple(reversed(bounds))


def _nothing_fits(runs: _Runs, num_stages, n_nodes) -> str:
  """The error when no split fits the limit: the least the model needs,
  and which stage of the split that needs least sets it."""
  mem_best, mem_arg = _min_max(runs.memory_only, num_stages, n_nodes)
  need = mem_best[num_stages, n_nodes]
  cuts = _backtrack(mem_arg, num_stages, n_nodes)
  held = [
    float(runs.memory(s)[a, b])
    for s, (a, b) in enumerate(zip(cuts[:-1], cuts[1:], strict=True))
  ]
  worst = int(np.argmax(held))
  return (
    f"no split into {num_stages} stages fits memory_limit="
    f"{runs.limit:.4g} bytes; the smallest limit that fits is "
    f"{need:.4g} bytes, set by stage {worst} (nodes {cuts[worst]}-"
    f"{cuts[worst + 1] - 1}, {held[worst]:.4g} bytes, in the split that "
    "needs least): use more stages, recomputation, a smaller microbatch "
    "or an optimizer with less state"
  )


def _crossing_bytes(edges, n_nodes):
  """Bytes into and out of each run [a, b): two (N+1, N+1) tables."""
  e = np.zeros((n_nodes, n_nodes))
  for (u, v), w in edges.items():  # (GraphCosts checked they go forward.)
    e[u, v] += w
  # s[i, j] = sum of e[:i, :j] (2-D prefix sums).
  s = np.zeros((n_nodes + 1, n_nodes + 1))
  s[1:, 1:] = e.cumsum(0).cumsum(1)
  a = np.arange(n_nodes + 1)[:, None]
  b = np.arange(n_nodes + 1)[None, :]
  a_b = np.broadcast_to(a, (n_nodes + 1, n_nodes + 1))
  b_b = np.broadcast_to(b, (n_nodes + 1, n_nodes + 1))
  n = n_nodes
  # into [a, b): u < a, a <= v < b.
  into = s[a_b, b_b] - s[a_b, a_b]
  # out of [a, b): a <= u < b, v >= b.
  out = (s[b_b, n] - s[a_b, n]) - (s[b_b, b_b] - s[a_b, b_b])
  return into, out
