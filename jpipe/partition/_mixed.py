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
``_cost_model.stage_seconds`` with ``C = C_dev``, the compute of all stages
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

Memory (a ``MemoryModel`` with a limit): as FTPipe's best fit, a block goes to the least
loaded device that still fits it, and a refinement move that overfills a
device is not taken. A device holds, under ``_contiguous``'s model, the
sum over its stages of the static bytes (params, gradients, optimizer
state), stashed param versions and the activations of the microbatches
in flight at the stage (1F1B over all S stages in program order: S - s,
the bound without FTPipe's virtual-stage cap), plus the largest of its
stages' working memory (one program runs at a time). A candidate over the limit on any device is dropped; when none
fits, the error names the device, its stages and the bytes.
"""

import dataclasses
from collections.abc import Sequence

import numpy as np

from jpipe.partition import _contiguous
from jpipe.partition._contiguous import solve_contiguous
from jpipe.partition._cost_model import (
  GraphCosts,
  MemoryLimitError,
  MemoryModel,
  StageBytes,
  stage_seconds,
)


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
  costs: GraphCosts,
  num_devices: int,
  *,
  memory: MemoryModel | None = None,
  block_counts: Sequence[int] | None = None,
  max_refine_rounds: int = 100,
  min_gain: float = 0.01,
) -> MixedSolution:
  """Mixed-pipe partition of N ordered nodes onto ``num_devices`` devices.

  Args:
    costs: the nodes' compute, edges and transfers (``GraphCosts``;
      FTPipe's objective is its ``comm_model="ftpipe"``); the last stage's
      nodes are priced at its ``last_stage_compute`` when given.
    num_devices: devices P, 1 <= P <= N.
    memory: each node's bytes and the bytes a device may hold
      (``MemoryModel``; it chooses the stage count, so its in-flight
      counts are S - s over the S stages and its versions one, or the
      in-flight counts with ``stashing``).
    block_counts: the L values to try (each P <= L <= N); default
      P, 2P, 3P, 4P (and 6P, 8P, 12P, 16P with a memory limit) capped at N.
    max_refine_rounds: passes of border-node moves.
    min_gain: a candidate with more stages replaces a better-ranked one only
      if it is faster by at least this fraction (stages cost transfers and
      bookkeeping the model does not see).

  Returns:
    The best solution found; its objective is never above the exact
    straight P-stage split's (it is among the candidates).
  """
  n = costs.num_nodes
  if not 1 <= num_devices <= n:
    raise ValueError(
      f"cannot place {n} nodes on {num_devices} devices: use between 1 and "
      f"{n} devices, or trace the model at a larger depth"
    )
  memory = memory or MemoryModel()
  if memory.in_flight is not None or memory.param_versions is not None:
    raise ValueError(
      "solve_mixed chooses the stage count: give the memory model no "
      "per-stage in_flight or param_versions (stashing=True for a version "
      "per microbatch in flight)"
    )
  limited = memory.limit is not None
  if block_counts is None:
    # With a memory limit, finer blocks too: a block's bytes cannot be
    # split by placing it, only by cutting it smaller.
    factors = (1, 2, 3, 4) + ((6, 8, 12, 16) if limited else ())
    block_counts = sorted({min(k * num_devices, n) for k in factors})
  for count in block_counts:
    if not num_devices <= count <= n:
      raise ValueError(f"block count {count} must lie in [{num_devices}, {n}]")
  evaluate = _Evaluator(costs, num_devices)
  fits = _Fits(memory if limited else None, costs.edges, num_devices)
  candidates = []
  try:
    straight = solve_contiguous(costs, num_devices, memory=memory)
    candidates.append((list(straight.boundaries), list(range(num_devices))))
  except ValueError:  # No straight split fits; mixed ones may.
    pass
  for count in block_counts:
    blocks = solve_contiguous(costs.uniform(), count).boundaries
    block_device = _best_fit(costs.compute_seconds, blocks, num_devices, fits)
    bounds, devices = _merge_runs(blocks, block_device)
    candidates.append(
      _refine(evaluate, list(bounds), list(devices), max_refine_rounds, fits)
    )
  return _best(candidates, evaluate, fits, min_gain)


def _best(candidates, evaluate, fits, min_gain) -> MixedSolution:
  """The fastest candidate that fits (more stages must win by
  ``min_gain``), or the error naming the closest one's fullest device."""
  best = None
  for bounds, devices in candidates:
    if not fits(bounds, devices):
      continue
    value = evaluate.objective(bounds, devices)
    # (The straight split comes first: more stages must win by min_gain.)
    if best is None or value < best[0] * (1.0 - min_gain):
      best = (value, bounds, devices)
  if best is None:
    raise MemoryLimitError(fits.why_not(candidates))
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

  def __init__(self, costs: GraphCosts, num_devices: int):
    self.comm_model = costs.comm_model
    self.prefix = np.concatenate([[0.0], np.cumsum(costs.compute_seconds)])
    # The last stage's nodes at their own price (None: the same).
    last_cost = costs.last_stage_compute
    self.last_prefix = (
      None
      if last_cost is None
      else np.concatenate([[0.0], np.cumsum(last_cost)])
    )
    self.edges = [(u, v, w) for (u, v), w in costs.edges.items()]
    self.bandwidth = costs.bandwidth
    self.num_devices = num_devices

  def stage_times(self, bounds, devices):
    num = len(devices)
    compute = np.diff(self.prefix[np.asarray(bounds)])
    if self.last_prefix is not None:
      compute[-1] = self.last_prefix[bounds[-1]] - self.last_prefix[bounds[-2]]
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
    times = stage_seconds(c_dev, comm_in, comm_out, self.comm_model)
    return times, device_compute

  def objective(self, bounds, devices):
    times, _ = self.stage_times(bounds, devices)
    return float(times.max())


class _Fits:
  """Whether a (boundaries, stage devices) pair fits the memory limit."""

  def __init__(self, memory, edges, num_devices):
    self.memory, self.edges, self.num_devices = memory, edges, num_devices
    self.limit = None if memory is None else memory.limit

  def device_bytes(self, bounds, devices) -> np.ndarray:
    held = self.memory.stage_bytes(bounds, self.edges).per_device(devices)
    return np.array([held.get(d, 0.0) for d in range(self.num_devices)])

  def __call__(self, bounds, devices) -> bool:
    if self.memory is None:
      return True
    return bool(self.device_bytes(bounds, devices).max() <= self.limit)

  def block_bytes(self, blocks) -> StageBytes:
    """Each block's bytes as a stage of its own, in flight as at its
    place in a pipeline of one stage per device (block b of L: P -
    floor(b P / L)); an estimate for placing blocks, the candidates are
    checked on their real stages."""
    count = len(blocks) - 1
    if self.memory is None:
      return StageBytes(np.zeros(count), np.zeros(count))
    p = self.num_devices
    flight = p - np.floor(np.arange(count) * p / count)
    return self.memory.stage_bytes(blocks, self.edges, flight)

  def why_not(self, candidates) -> str:
    """The error when no candidate fits: the closest one's fullest device."""
    best = min(
      candidates, key=lambda c: self.device_bytes(*c).max(), default=None
    )
    load = self.device_bytes(*best)
    d = int(np.argmax(load))
    stages = [s for s, dev in enumerate(best[1]) if dev == d]
    per_stage = self.memory.stage_bytes(best[0], self.edges).total
    return (
      f"no mixed-pipe placement on {self.num_devices} devices fits "
      f"memory_limit={self.limit:.4g} bytes: the closest puts "
      f"{load[d]:.4g} bytes on device {d} (stages {stages}: "
      + ", ".join(f"{per_stage[s]:.3g}" for s in stages)
      + " bytes); use more devices, recomputation, a smaller microbatch "
      "or an optimizer with less state (adafactor, sgd)"
    )


def _best_fit(cost, blocks, num_devices, fits=None):
  """Largest block first onto the least loaded device that still has
  memory for it (the least loaded of all when none has)."""
  sizes = [
    float(cost[a:b].sum()) for a, b in zip(blocks[:-1], blocks[1:], strict=True)
  ]
  zeros = np.zeros(len(sizes))
  need = fits.block_bytes(blocks) if fits is not None else None
  kept, work = (
    (zeros, zeros) if need is None else (need.persistent, need.working)
  )
  limit = np.inf if fits is None or fits.limit is None else fits.limit
  load = np.zeros(num_devices)
  held = np.zeros(num_devices)  # Persistent bytes placed on each device.
  peak = np.zeros(num_devices)  # Its largest working bytes.
  device = [0] * len(sizes)
  for i in sorted(range(len(sizes)), key=lambda i: -sizes[i]):
    room = held + kept[i] + np.maximum(peak, work[i]) <= limit
    order = np.argsort(load, kind="stable")
    d = int(next((d for d in order if room[d]), order[0]))
    device[i] = d
    load[d] += sizes[i]
    held[d] += kept[i]
    peak[d] = max(peak[d], work[i])
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


def _refine(evaluate, bounds, devices, max_rounds, fits=None):
  """Move single border nodes between neighbouring stages while it helps
  (and the devices keep within memory)."""
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
        if value < current - 1e-15 and (fits is None or fits(trial, devices)):
          bounds, current, improved = trial, value, True
    if not improved:
      break
  return bounds, devices
