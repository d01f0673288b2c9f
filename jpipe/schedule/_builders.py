"""The schedules: seq, gpipe, 1f1b, eager1f1b, async, 2bw, interleaved
(Megatron's interleaved 1F1B) and looped_bfs (zero-bubble ones: ``_zero_bubble.py``).

Each builder returns a :class:`Schedule` for ``num_stages`` stages (stage s
on device s unless said otherwise) and ``num_microbatches`` microbatches.
"""

import numpy as np

from jpipe.schedule._schedule import (
  BACKWARD,
  FORWARD,
  INPUT,
  UPDATE,
  WEIGHT,
  Action,
  Schedule,
  make_schedule,
)
from jpipe.schedule._stream import Stream


def _check(num_stages, num_microbatches):
  if num_stages < 1 or num_microbatches < 1:
    raise ValueError(
      f"need >= 1 stage and microbatch, got {num_stages} stages and "
      f"{num_microbatches} microbatches"
    )


def _devices(stage_device, num_microbatches) -> tuple[list[int], int]:
  """The stages' devices as ints, and how many: numbered 0..k-1, every
  one used (a builder that places stages itself)."""
  stage_device = [int(d) for d in stage_device]
  _check(len(stage_device), num_microbatches)
  num_devices = max(stage_device) + 1
  if set(stage_device) != set(range(num_devices)):
    raise ValueError(f"devices {stage_device} must be 0..{num_devices - 1}")
  return stage_device, num_devices


def seq(num_stages: int, num_microbatches: int) -> Schedule:
  """Naive model parallelism: one microbatch in flight, one step at the end.

  Synchronous: equals single-device gradient accumulation.
  """
  _check(num_stages, num_microbatches)
  devices = [[] for _ in range(num_stages)]
  for s in range(num_stages):
    for m in range(num_microbatches):
      devices[s] += [Action(FORWARD, s, m), Action(BACKWARD, s, m)]
    devices[s].append(Action(UPDATE, s, num_microbatches - 1))
  return make_schedule(
    "seq", devices, list(range(num_stages)), num_microbatches
  )


def gpipe(num_stages: int, num_microbatches: int) -> Schedule:
  """GPipe fill-drain: all forwards, all backwards (LIFO), one step."""
  _check(num_stages, num_microbatches)
  devices = []
  for s in range(num_stages):
    actions = [Action(FORWARD, s, m) for m in range(num_microbatches)]
    actions += [
      Action(BACKWARD, s, m) for m in reversed(range(num_microbatches))
    ]
    actions.append(Action(UPDATE, s, num_microbatches - 1))
    devices.append(actions)
  return make_schedule(
    "gpipe", devices, list(range(num_stages)), num_microbatches
  )


def one_f_one_b(num_stages: int, num_microbatches: int) -> Schedule:
  """PipeDream-Flush (synchronous 1F1B): warm-up, F/B pairs, drain, step.

  Stage s runs ``min(n - 1 - s, m)`` warm-up forwards, so it keeps at most
  ``n - s`` microbatches' activations (GPipe keeps m).
  """
  _check(num_stages, num_microbatches)
  last = num_microbatches - 1
  devices = _unflushed_1f1b(num_stages, num_microbatches, lambda b: b == last)
  return make_schedule(
    "1f1b", devices, list(range(num_stages)), num_microbatches
  )


def eager_1f1b(num_stages: int, num_microbatches: int) -> Schedule:
  """Eager 1F1B (as NVIDIA's JaxPP names it): 1F1B whose stage s runs
  ``n - 1 - s`` more warm-up forwards, ``min(2(n - 1 - s) + 1, m)`` before
  its first backward, so a forward's output is sent while the next stage
  is still busy and transfers overlap compute; stage s then keeps up to
  ``2(n - s) - 1`` microbatches (1F1B: ``n - s``). Same step, same result.
  """
  _check(num_stages, num_microbatches)
  last = num_microbatches - 1
  devices = _unflushed_1f1b(
    num_stages,
    num_microbatches,
    lambda b: b == last,
    warm=lambda s: 2 * (num_stages - 1 - s),
  )
  return make_schedule(
    "eager1f1b", devices, list(range(num_stages)), num_microbatches
  )


def async_1f1b(
  num_stages: int, num_microbatches: int, *, step_every: int = 1
) -> Schedule:
  """PipeDream's asynchronous 1F1B, one call of ``num_microbatches`` and a
  flush: each stage steps after every ``step_every`` backwards (and after
  the last, partial window).

  In steady state with ``step_every=1`` the delay of stage s is
  ``n - 1 - s``; after the warm-up it ramps 0, 1, ..., n - 1 - s. The
  pipeline streams across calls (``Stream``); this is one window of it.
  """
  _check(num_stages, num_microbatches)
  return Stream("async", num_stages, step_every).schedule((num_microbatches,))


def _unflushed_1f1b(num_stages, num_microbatches, steps_after, warm=None):
  """1F1B action lists (``warm(s)`` warm-up forwards, default ``n - 1 -
  s``; F/B pairs; drain) with a step after backward b iff
  ``steps_after(b)``."""
  devices = []
  for s in range(num_stages):
    ahead = num_stages - 1 - s if warm is None else warm(s)
    warm_up = min(ahead, num_microbatches)
    actions = [Action(FORWARD, s, m) for m in range(warm_up)]
    for i in range(num_microbatches - warm_up):
      actions += [Action(FORWARD, s, warm_up + i), Action(BACKWARD, s, i)]
    actions += [
      Action(BACKWARD, s, b)
      for b in range(num_microbatches - warm_up, num_microbatches)
    ]
    with_steps = []
    for a in actions:
      with_steps.append(a)
      if a.kind == BACKWARD and steps_after(a.microbatch):
        with_steps.append(Action(UPDATE, s, a.microbatch))
    devices.append(with_steps)
  return devices


def two_bw(
  num_stages: int, num_microbatches: int, *, minibatch: int
) -> Schedule:
  """PipeDream-2BW, one call of ``num_microbatches`` and a flush: 1F1B
  without flushes, one step per ``minibatch`` microbatches.

  Two weight versions: every microbatch of minibatch t runs forward and
  backward at W(t-1) (the first at W(0)), so
  ``W(t+1) = W(t) - lr * grad f(W(t-1))``. Needs ``minibatch >= n``.
  """
  _check(num_stages, num_microbatches)
  return Stream("2bw", num_stages, minibatch).schedule((num_microbatches,))


def looped_bfs(stage_device, num_microbatches: int) -> Schedule:
  """Breadth-first over the stages of a device (Lamy-Poirier's
  breadth-first pipeline, torch's ScheduleLoopedBFS): with several stages
  per device, each device runs every microbatch's forward of its first
  stage, then of its next, ..., then the backwards stage by stage in
  reverse; one step per stage at the end. One stage per device: GPipe.
  Every microbatch is in flight at once (GPipe's memory), and a device
  finishes a stage's work before moving on, which suits stages whose
  params must be fetched to the device (FSDP-style)."""
  stage_device, num_devices = _devices(stage_device, num_microbatches)
  num_stages = len(stage_device)
  devices: list[list[Action]] = [[] for _ in range(num_devices)]
  for s in range(num_stages):
    devices[stage_device[s]] += [
      Action(FORWARD, s, m) for m in range(num_microbatches)
    ]
  for s in reversed(range(num_stages)):
    devices[stage_device[s]] += [
      Action(BACKWARD, s, m) for m in reversed(range(num_microbatches))
    ]
  for s in range(num_stages):
    devices[stage_device[s]].append(Action(UPDATE, s, num_microbatches - 1))
  return make_schedule("looped_bfs", devices, stage_device, num_microbatches)


def loop_placement(num_stages: int, num_devices: int) -> tuple[int, ...]:
  """Megatron's virtual stages: stage s on device ``s % num_devices``,
  so device d holds stages d, d + p, d + 2p, ... (its model chunks)."""
  if num_devices < 1 or num_stages < num_devices:
    raise ValueError(
      f"a loop needs >= 1 device and >= 1 stage per device, got "
      f"{num_stages} stages on {num_devices} devices"
    )
  return tuple(s % num_devices for s in range(num_stages))


def interleaved_rounds(num_devices: int, num_microbatches: int) -> int | None:
  """Microbatches per round of interleaved 1F1B on ``num_devices``
  devices (torch's ``microbatches_per_round``; Megatron's
  ``microbatch_group_size_per_vp_stage``): ``m / max(1, m // p)`` --
  p where p divides m, m where m < p -- or None where ``m // p`` does not
  divide m (torch refuses those m)."""
  rounds = max(1, num_microbatches // num_devices)
  if num_microbatches % rounds:
    return None
  return num_microbatches // rounds


def interleaved(
  stage_device, num_microbatches: int, *, synchronous: bool = True
) -> Schedule:
  """Interleaved 1F1B: several stages per device.

  On the loop placement (stage s on device ``s % p``: Megatron's virtual
  pipeline, v = ceil(n / p) model chunks per device): Megatron-LM's
  ``forward_backward_pipelining_with_interleaving`` and torch's
  ``ScheduleInterleaved1F1B`` (Narayanan et al. 2021, section 2.2).
  Forwards are taken in rounds of g microbatches (g = p where p divides
  m; ``interleaved_rounds``) over the device's chunks, chunk 0 first;
  backwards in the same rounds, last chunk first. Device d runs
  ``min(2(p - 1 - d) + (v - 1) g, v m)`` warm-up forwards, then one
  forward and one backward at a time, then the remaining backwards, so it
  holds at most one more than its warm-up. With F = 1, B = 2 and free
  transfers the bubble is Narayanan's ``(p - 1) / (v m + p - 1)``. One
  chunk per device (v = 1): 1F1B (Megatron's schedule without virtual
  stages). Where n is not a multiple of p, the last round of chunks is
  short: the missing stages' actions are left out. Where ``m // p`` does
  not divide m, the order of the next multiple of p with the extra
  microbatches' actions left out. (Leaving actions out of a list that
  runs keeps it running: what is left waits on a subset of what it did.)

  Other placements (FTPipe's mixed pipe: any stage on any device): list
  scheduling on unit costs -- each device repeatedly runs its ready
  action with the highest priority: a backward before a forward (1F1B),
  earlier microbatches first, and a forward only while its stage has
  fewer than ``n - s`` microbatches in flight (1F1B's activation bound).

  Synchronous: one step per stage at the end; otherwise a step after
  every backward (asynchronous).
  """
  stage_device, num_devices = _devices(stage_device, num_microbatches)
  num_stages = len(stage_device)
  if tuple(stage_device) == tuple(s % num_devices for s in range(num_stages)):
    devices = loop_lists(num_stages, num_devices, num_microbatches)
  else:
    devices = _list_scheduled(stage_device, num_devices, num_microbatches)
  lists = []
  for actions in devices:
    with_steps = []
    for a in actions:
      with_steps.append(a)
      if not synchronous and a.kind == BACKWARD:
        with_steps.append(Action(UPDATE, a.stage, a.microbatch))
    if synchronous:
      stages = sorted({a.stage for a in actions})
      with_steps += [Action(UPDATE, s, num_microbatches - 1) for s in stages]
    lists.append(with_steps)
  return make_schedule("interleaved", lists, stage_device, num_microbatches)


def loop_lists(num_stages, num_devices, num_microbatches, *, split=False):
  """Per device, the actions (no steps) of interleaved 1F1B on the loop
  placement (stage s on device s % p; ``interleaved``'s docstring).

  ``split``: torch's ScheduleInterleavedZeroBubble (Qi et al.'s ZB1P on
  virtual stages): each backward runs as I, the warm-up is
  ``(v - 1) g + p - 1 - d`` forwards (a backward's input gradient now
  travels as fast as a forward), and device d keeps its last ``d``
  weight gradients deferred: after the input gradient of its k-th
  backward it runs the W of its (k - d)-th, the rest at the end.
  """
  p, m = num_devices, num_microbatches
  v = -(-num_stages // p)  # Chunks per device, the last round short.
  group, padded = interleaved_rounds(p, m), m
  if group is None:  # An m torch refuses: pad to a multiple of p (v = 1:
    group = p  # 1F1B, which takes any m as it is).
    padded = m if v == 1 else -(-m // p) * p
  # The k-th forward of a device: round k // (g v), chunk (k // g) % v.
  order = [
    (k // (group * v) * group + k % group, k // group % v)
    for k in range(v * padded)
  ]
  total = v * padded
  devices = []
  for d in range(p):
    if v == 1 or split:
      warm = (v - 1) * group + p - 1 - d
    else:
      warm = 2 * (p - 1 - d) + (v - 1) * group
    warm = min(warm, total)

    def forward(k, d=d):
      microbatch, chunk = order[k]
      return Action(FORWARD, chunk * p + d, microbatch)

    def backward(k, kind=INPUT if split else BACKWARD, d=d):
      microbatch, chunk = order[k]
      return Action(kind, (v - 1 - chunk) * p + d, microbatch)

    actions = [forward(k) for k in range(warm)]
    weights = 0
    for k in range(total):
      if warm + k < total:
        actions.append(forward(warm + k))
      actions.append(backward(k))
      if split and k >= d:  # Keep d weight gradients deferred.
        actions.append(backward(weights, WEIGHT))
        weights += 1
    if split:
      actions += [backward(k, WEIGHT) for k in range(weights, total)]
    devices.append(
      [a for a in actions if a.stage < num_stages and a.microbatch < m]
    )
  return devices


def _list_scheduled(stage_device, num_devices, num_microbatches):
  """Forwards and backwards of any placement by list scheduling on unit
  costs (``interleaved``), per device."""
  num_stages = len(stage_device)
  done_f = np.zeros(num_stages, np.int64)  # forwards done per stage
  done_b = np.zeros(num_stages, np.int64)
  finished: dict[tuple[str, int, int], float] = {}
  clock = np.zeros(num_devices)
  devices: list[list[Action]] = [[] for _ in range(num_devices)]
  total = 2 * num_stages * num_microbatches
  while len(finished) < total:
    best = None
    for s in range(num_stages):
      d = stage_device[s]
      candidates = []
      b = done_b[s]
      if b < done_f[s]:
        ready = finished.get((FORWARD, s, b))
        if s < num_stages - 1:
          up = finished.get((BACKWARD, s + 1, b))
          ready = None if up is None or ready is None else max(ready, up)
        if ready is not None:
          candidates.append((0, b, ready, Action(BACKWARD, s, b)))
      f = done_f[s]
      if f < num_microbatches and f - done_b[s] < num_stages - s:
        ready = 0.0 if s == 0 else finished.get((FORWARD, s - 1, f))
        if ready is not None:
          candidates.append((1, f, ready, Action(FORWARD, s, f)))
      for prio, m, ready, action in candidates:
        start = max(clock[d], ready)
        key = (start, prio, m, s)
        if best is None or key < best[0]:
          best = (key, d, action)
    if best is None:
      raise RuntimeError("interleaved schedule deadlocked")  # unreachable
    (start, _, _, _), d, action = best
    clock[d] = start + 1.0
    finished[(action.kind, action.stage, action.microbatch)] = clock[d]
    devices[d].append(action)
    if action.kind == FORWARD:
      done_f[action.stage] += 1
    else:
      done_b[action.stage] += 1
  return devices
