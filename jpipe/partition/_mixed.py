"""FTPipe's mixed pipe: more stages than devices, balanced per device.

Nodes in a topological order are cut into L contiguous blocks (the exact
min-max split), blocks are placed on devices by longest-processing-time
best fit (largest block to the least loaded device), runs of consecutive
blocks on one device merge into stages, and border nodes then move between
neighbouring stages while that lowers the objective. The best of several L
(by default P, 2P, 3P, 4P) wins. A device may hold several non-adjacent
stages (e.g. the first and the last), which balances models whose cost is
uneven along the order.

Objective: the maximum over stages of the stage time of
``_contiguous.stage_seconds`` with ``C = C_dev``, the compute of all stages
on that stage's device, and ``t_in``/``t_out`` the stage's transfers to or
from other devices (2 x bytes / bandwidth: activations and gradients).
With ``comm_model="ftpipe"`` that is FTPipe's ``mpipe`` refinement
objective ``C_dev + max(0, t_in - C_dev) + max(0, t_out - C_dev)``.
Transfers between stages on one device are free. The exact straight split
(one stage per device) under the same model is always a candidate, so the
result is never worse than it.

FTPipe's greedy pops the *smallest* block first (a quirk of popitem on a
descending dict, spec §7); jpipe places the largest first, as best fit
intends.
"""

import dataclasses
from collections.abc import Mapping, Sequence

import numpy as np

from jpipe.partition import _contiguous
from jpipe.partition._contiguous import COMM_MODELS, solve_contiguous


@dataclasses.dataclass(frozen=True)
class MixedSolution:
  """Stages (contiguous node runs) and the device of each.

  ``boundaries[s]:boundaries[s+1]`` are the nodes of stage s.
  """

  boundaries: tuple[int, ...]
  stage_device: tuple[int, ...]
  device_compute_seconds: tuple[float, ...]
  stage_seconds: tuple[float, ...]
  objective_seconds: float

  def stage_of_node(self) -> list[int]:
    return _contiguous.stage_of_node(self.boundaries)


def solve_mixed(
  compute_seconds: Sequence[float],
  num_devices: int,
  *,
  edges: Mapping[tuple[int, int], float] | None = None,
  bandwidth: float | None = None,
  block_counts: Sequence[int] | None = None,
  max_refine_rounds: int = 100,
  comm_model: str = "ftpipe",
  min_gain: float = 0.01,
) -> MixedSolution:
  """Mixed-pipe partition of N ordered nodes onto ``num_devices`` devices.

  Args:
    compute_seconds: forward + backward time of each node, [N].
    num_devices: devices P, 1 <= P <= N.
    edges: (src, dst) -> bytes, src < dst in the order.
    bandwidth: bytes/s between devices; None ignores communication.
    block_counts: the L values to try (each P <= L <= N); default
      P, 2P, 3P, 4P capped at N.
    max_refine_rounds: passes of border-node moves.
    comm_model: "ftpipe" (default, FTPipe's) or "overlapped" (PipeDream's).
    min_gain: a candidate with more stages replaces a better-ranked one only
      if it is faster by at least this fraction (stages cost transfers and
      bookkeeping the model does not see).

  Returns:
    The best solution found; its objective is never above the exact
    straight P-stage split's (it is among the candidates).
  """
  cost = np.asarray(compute_seconds, np.float64)
  n = cost.shape[0]
  if not 1 <= num_devices <= n:
    raise ValueError(
      f"cannot place {n} nodes on {num_devices} devices: use between 1 and "
      f"{n} devices, or trace the model at a larger depth"
    )
  if bandwidth is not None and bandwidth <= 0:
    raise ValueError(f"bandwidth must be > 0 bytes/s, got {bandwidth}")
  if comm_model not in COMM_MODELS:
    raise ValueError(f"unknown comm_model {comm_model!r}: one of {COMM_MODELS}")
  edges = dict(edges or {})
  if block_counts is None:
    block_counts = sorted({min(k * num_devices, n) for k in (1, 2, 3, 4)})
  for count in block_counts:
    if not num_devices <= count <= n:
      raise ValueError(f"block count {count} must lie in [{num_devices}, {n}]")
  evaluate = _Evaluator(cost, edges, bandwidth, num_devices, comm_model)
  straight = solve_contiguous(
    cost, num_devices, edges=edges, bandwidth=bandwidth, comm_model=comm_model
  )
  bounds = list(straight.boundaries)
  best = (
    evaluate.objective(bounds, list(range(num_devices))),
    bounds,
    list(range(num_devices)),
  )
  for count in block_counts:
    blocks = solve_contiguous(cost, count).boundaries
    block_device = _best_fit(cost, blocks, num_devices)
    bounds, devices = _merge_runs(blocks, block_device)
    bounds, devices = _refine(
      evaluate, list(bounds), list(devices), max_refine_rounds
    )
    value = evaluate.objective(bounds, devices)
    if value < best[0] * (1.0 - min_gain):
      best = (value, bounds, devices)
  value, bounds, devices = best
  stage_times, device_compute = evaluate.stage_times(bounds, devices)
  return MixedSolution(
    boundaries=tuple(int(b) for b in bounds),
    stage_device=tuple(int(d) for d in devices),
    device_compute_seconds=tuple(float(c) for c in device_compute),
    stage_seconds=tuple(float(t) for t in stage_times),
    objective_seconds=float(value),
  )


class _Evaluator:
  """The mixed-pipe objective of a (boundaries, stage devices) pair."""

  def __init__(self, cost, edges, bandwidth, num_devices, comm_model):
    self.comm_model = comm_model
    self.prefix = np.concatenate([[0.0], np.cumsum(cost)])
    self.edges = [(u, v, w) for (u, v), w in edges.items()]
    for u, v, _ in self.edges:
      if not 0 <= u < v < len(cost):
        raise ValueError(f"edge {(u, v)} does not go forward in the order")
    self.bandwidth = bandwidth
    self.num_devices = num_devices

  def stage_times(self, bounds, devices):
    num = len(devices)
    compute = np.diff(self.prefix[np.asarray(bounds)])
    device_compute = np.zeros(self.num_devices)
    np.add.at(device_compute, np.asarray(devices), compute)
    comm_in, comm_out = np.zeros(num), np.zeros(num)
    if self.bandwidth is not None and self.edges:
      stage_of = np.repeat(np.arange(num), np.diff(np.asarray(bounds)))
      for u, v, w in self.edges:
        su, sv = stage_of[u], stage_of[v]
        if devices[su] != devices[sv]:
          comm_out[su] += 2.0 * w / self.bandwidth
          comm_in[sv] += 2.0 * w / self.bandwidth
    c_dev = device_compute[np.asarray(devices)]
    times = _contiguous.stage_seconds(c_dev, comm_in, comm_out, self.comm_model)
    return times, device_compute

  def objective(self, bounds, devices):
    times, _ = self.stage_times(bounds, devices)
    return float(times.max())


def _best_fit(cost, blocks, num_devices):
  """Largest block first onto the least loaded device."""
  sizes = [
    float(cost[a:b].sum()) for a, b in zip(blocks[:-1], blocks[1:], strict=True)
  ]
  load = np.zeros(num_devices)
  device = [0] * len(sizes)
  for i in sorted(range(len(sizes)), key=lambda i: -sizes[i]):
    d = int(np.argmin(load))
    device[i] = d
    load[d] += sizes[i]
  return device


def _merge_runs(blocks, block_device):
  """Consecutive blocks on one device become one stage."""
  bounds, devices = [blocks[0]], []
  for i, d in enumerate(block_device):
    if devices and devices[-1] == d:
      bounds[-1] = blocks[i + 1]
    else:
      devices.append(d)
      bounds.append(blocks[i + 1])
  return bounds, devices


def _refine(evaluate, bounds, devices, max_rounds):
  """Move single border nodes between neighbouring stages while it helps."""
  current = evaluate.objective(bounds, devices)
  for _ in range(max_rounds):
    improved = False
    for i in range(1, len(bounds) - 1):
      for step in (-1, 1):
        trial = list(bounds)
        trial[i] += step
        if not trial[i - 1] < trial[i] < trial[i + 1]:
          continue
        value = evaluate.objective(trial, devices)
        if value < current - 1e-15:
          bounds, current, improved = trial, value, True
    if not improved:
      break
  return bounds, devices
