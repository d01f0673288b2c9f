"""Exact min-max contiguous partition of a topologically ordered graph.

Nodes 0..N-1 in a topological order are cut into ``num_stages`` contiguous
runs. With ``t_in = 2 * bytes_in / bandwidth`` and ``t_out`` likewise (the
factor 2: activations forward, their gradients backward; bytes crossing a
cut include long skips, so an edge from stage 1 to stage 4 counts as input
of stage 4 and output of stage 1), a stage with compute C takes

- ``"overlapped"`` (PipeDream): ``max(C, t_in, t_out)``;
- ``"ftpipe"`` (FTPipe's partitioner): ``C + max(0, t_in - C) +
  max(0, t_out - C)``, the communication that computation cannot hide.

The dynamic program over (stage count, prefix) is exact for either: it
returns the minimum bottleneck over all contiguous splits of the order,
subject to a per-stage memory limit.
"""

import dataclasses
from collections.abc import Mapping, Sequence

import numpy as np

COMM_MODELS = ("overlapped", "ftpipe")


def stage_of_node(boundaries: Sequence[int]) -> list[int]:
  """Stage index of every node from run boundaries (0, b1, ..., N)."""
  return np.repeat(
    np.arange(len(boundaries) - 1), np.diff(np.asarray(boundaries))
  ).tolist()


def stage_seconds(compute, t_in, t_out, comm_model: str):
  """A stage's time from compute and transfer seconds (arrays broadcast)."""
  if comm_model == "overlapped":
    return np.maximum(compute, np.maximum(t_in, t_out))
  with np.errstate(invalid="ignore"):  # inf - inf for empty runs
    return (
      compute
      + np.maximum(0.0, t_in - compute)
      + np.maximum(0.0, t_out - compute)
    )


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
  compute_seconds: Sequence[float],
  num_stages: int,
  *,
  edges: Mapping[tuple[int, int], float] | None = None,
  bandwidth: float | None = None,
  static_bytes: Sequence[float] | None = None,
  activation_bytes: Sequence[float] | None = None,
  memory_limit: float | None = None,
  in_flight: Sequence[int] | None = None,
  comm_model: str = "overlapped",
  param_bytes: Sequence[float] | None = None,
  param_versions: Sequence[int] | None = None,
  recompute: bool = False,
  working_bytes: Sequence[float] | None = None,
  stage_slowdown: Sequence[float] | None = None,
  last_stage_compute: Sequence[float] | None = None,
) -> ContiguousSolution:
  """Min-max bottleneck split of N ordered nodes into ``num_stages`` runs.

  Args:
    compute_seconds: forward + backward time of each node, [N].
    num_stages: stages, 1 <= num_stages <= N.
    edges: (src, dst) -> bytes, with src < dst in the order.
    bandwidth: bytes/s between stages; None ignores communication.
    static_bytes: per node, memory that does not scale with microbatches in
      flight (params, gradients, optimizer state), [N].
    activation_bytes: per node, activations kept per microbatch in flight.
    memory_limit: bytes per stage (device); None for no limit.
    in_flight: microbatches in flight per stage, [num_stages]; default
      ``num_stages - s`` (1F1B).
    comm_model: "overlapped" or "ftpipe" (see the module docstring).
    param_bytes: per node, its params' bytes, [N]; with
      ``param_versions`` (per stage, default 1) a stage also holds
      ``versions - 1`` extra copies of them (weight stashing).
    recompute: a microbatch in flight keeps the bytes entering the stage
      (``edges``), else its ``activation_bytes``.
    working_bytes: per node, memory one microbatch's programs need while
      they run (counted once per stage), [N].
    stage_slowdown: per stage slot, a factor on its compute (its device
      runs that much slower, e.g. under interference), [num_stages];
      default 1 everywhere.
    last_stage_compute: per node, its time when on the last stage, [N]
      (FTPipe's async pipelines: the last stage runs forward and backward
      together and never recomputes); default ``compute_seconds``.

  Returns:
    The optimal split.
  """
  cost = np.asarray(compute_seconds, np.float64)
  n_nodes = cost.shape[0]
  if not 1 <= num_stages <= n_nodes:
    raise ValueError(
      f"cannot split {n_nodes} nodes into {num_stages} stages: use between "
      f"1 and {n_nodes} stages, or trace the model at a larger depth to get "
      "more nodes"
    )
  if bandwidth is not None and bandwidth <= 0:
    raise ValueError(f"bandwidth must be > 0 bytes/s, got {bandwidth}")
  if comm_model not in COMM_MODELS:
    raise ValueError(f"unknown comm_model {comm_model!r}: one of {COMM_MODELS}")
  static = _per_node(static_bytes, n_nodes, "static_bytes")
  acts = _per_node(activation_bytes, n_nodes, "activation_bytes")
  flight = np.asarray(
    in_flight
    if in_flight is not None
    else [num_stages - s for s in range(num_stages)],
    np.float64,
  )
  if flight.shape != (num_stages,):
    raise ValueError(f"in_flight needs {num_stages} entries")
  params = _per_node(param_bytes, n_nodes, "param_bytes")
  working = _per_node(working_bytes, n_nodes, "working_bytes")
  versions = np.asarray(
    [1] * num_stages if param_versions is None else param_versions, np.float64
  )
  if versions.shape != (num_stages,) or np.any(versions < 1):
    raise ValueError(f"param_versions needs {num_stages} entries >= 1")
  extra = versions - 1.0  # Stashed copies beside the live params.
  slowdown = np.asarray(
    [1.0] * num_stages if stage_slowdown is None else stage_slowdown,
    np.float64,
  )
  if slowdown.shape != (num_stages,) or np.any(slowdown <= 0):
    raise ValueError(f"stage_slowdown needs {num_stages} factors > 0")

  prefix = np.concatenate([[0.0], np.cumsum(cost)])
  static_prefix = np.concatenate([[0.0], np.cumsum(static)])
  act_prefix = np.concatenate([[0.0], np.cumsum(acts)])
  param_prefix = np.concatenate([[0.0], np.cumsum(params)])
  work_prefix = np.concatenate([[0.0], np.cumsum(working)])
  cut_in, cut_out = _crossing_bytes(edges or {}, n_nodes)
  idx = np.arange(n_nodes + 1)
  starts, ends = idx[:, None], idx[None, :]  # stage = nodes [start, end)
  valid = ends > starts
  compute = np.where(valid, prefix[ends] - prefix[starts], np.inf)
  last_compute = compute
  if last_stage_compute is not None:
    last_cost = _per_node(last_stage_compute, n_nodes, "last_stage_compute")
    last_prefix = np.concatenate([[0.0], np.cumsum(last_cost)])
    last_compute = np.where(
      valid, last_prefix[ends] - last_prefix[starts], np.inf
    )

  def stage_time(s):
    """Every run's time as stage s, [N+1, N+1]."""
    own = last_compute if s == num_stages - 1 else compute
    slowed = own * slowdown[s]
    if bandwidth is None:
      return slowed
    return stage_seconds(
      slowed, 2.0 * cut_in / bandwidth, 2.0 * cut_out / bandwidth, comm_model
    )

  def memory(s):
    kept = cut_in if recompute else act_prefix[ends] - act_prefix[starts]
    return (
      static_prefix[ends]
      - static_prefix[starts]
      + extra[s] * (param_prefix[ends] - param_prefix[starts])
      + flight[s] * kept
      + work_prefix[ends]
      - work_prefix[starts]
    )

  def run_dp(objective):
    best = np.full((num_stages + 1, n_nodes + 1), np.inf)
    arg = np.zeros((num_stages + 1, n_nodes + 1), np.int64)
    best[0, 0] = 0.0
    for k in range(1, num_stages + 1):
      cand = np.maximum(best[k - 1][:, None], objective(k - 1))
      arg[k] = np.argmin(cand, axis=0)
      best[k] = cand[arg[k], idx]
    return best, arg

  def time_objective(s):
    t = np.where(valid, stage_time(s), np.inf)
    if memory_limit is not None:
      t = np.where(memory(s) <= memory_limit, t, np.inf)
    return t

  best, arg = run_dp(time_objective)
  if not np.isfinite(best[num_stages, n_nodes]):
    mem_best, mem_arg = run_dp(lambda s: np.where(valid, memory(s), np.inf))
    need = mem_best[num_stages, n_nodes]
    # The split that needs least: its fullest stage is the one to relieve.
    cuts = [n_nodes]
    for k in range(num_stages, 0, -1):
      cuts.append(int(mem_arg[k, cuts[-1]]))
    cuts = cuts[::-1]
    held = [
      float(memory(s)[a, b])
      for s, (a, b) in enumerate(zip(cuts[:-1], cuts[1:], strict=True))
    ]
    worst = int(np.argmax(held))
    raise ValueError(
      f"no split into {num_stages} stages fits memory_limit="
      f"{memory_limit:.4g} bytes; the smallest limit that fits is "
      f"{need:.4g} bytes, set by stage {worst} (nodes {cuts[worst]}-"
      f"{cuts[worst + 1] - 1}, {held[worst]:.4g} bytes, in the split that "
      "needs least): use more stages, recomputation, a smaller microbatch "
      "or an optimizer with less state"
    )
  bounds = [n_nodes]
  for k in range(num_stages, 0, -1):
    bounds.append(int(arg[k, bounds[-1]]))
  bounds = tuple(reversed(bounds))
  pairs = list(zip(bounds[:-1], bounds[1:], strict=True))
  return ContiguousSolution(
    boundaries=bounds,
    stage_seconds=tuple(
      float(stage_time(s)[a, b]) for s, (a, b) in enumerate(pairs)
    ),
    compute_seconds=tuple(
      float((last_compute if s == num_stages - 1 else compute)[a, b])
      * slowdown[s]
      for s, (a, b) in enumerate(pairs)
    ),
    memory_bytes=tuple(
      float(memory(s)[a, b]) for s, (a, b) in enumerate(pairs)
    ),
    bottleneck_seconds=float(best[num_stages, n_nodes]),
  )


def _per_node(values, n_nodes, name):
  if values is None:
    return np.zeros(n_nodes)
  arr = np.asarray(values, np.float64)
  if arr.shape != (n_nodes,):
    raise ValueError(f"{name} needs {n_nodes} entries, got {arr.shape}")
  return arr


def _crossing_bytes(edges, n_nodes):
  """Bytes into and out of each run [a, b): two (N+1, N+1) tables."""
  e = np.zeros((n_nodes, n_nodes))
  for (u, v), w in edges.items():
    if not 0 <= u < v < n_nodes:
      raise ValueError(
        f"edge {(u, v)} does not go forward in the order of {n_nodes} nodes"
      )
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
