"""Event simulation of a schedule: makespan and bubble from stage costs."""

import dataclasses
from collections.abc import Sequence

import numpy as np

from jpipe.schedule._schedule import BACKWARD, FORWARD, STEP, Action, Schedule


@dataclasses.dataclass(frozen=True)
class Timeline:
  """When every action ran (seconds from the start).

  Attributes:
    start, end: per action, keyed by the Action.
    device_of: per action, its device.
    makespan: end of the last action.
    busy: per device, seconds of work.
    bubble: idle fraction, ``1 - sum(busy) / (num_devices * makespan)``.
  """

  start: dict
  end: dict
  device_of: dict
  makespan: float
  busy: tuple[float, ...]
  bubble: float


def simulate(
  schedule: Schedule,
  forward_seconds: Sequence[float] | float,
  backward_seconds: Sequence[float] | float,
  *,
  comm_seconds: float = 0.0,
  step_seconds: float = 0.0,
) -> Timeline:
  """Runs the schedule on ideal devices with per-stage costs.

  Each device executes its actions in order; an action starts when its
  device is free and its inputs have arrived (``comm_seconds`` for a value
  crossing devices, 0 within a device).

  Args:
    schedule: the schedule.
    forward_seconds, backward_seconds: per stage (or one for all).
    comm_seconds: transfer time of an activation or gradient between
      devices.
    step_seconds: duration of an optimizer step.

  Returns:
    The timeline.
  """
  n = schedule.num_stages
  fwd = np.broadcast_to(np.asarray(forward_seconds, np.float64), (n,))
  bwd = np.broadcast_to(np.asarray(backward_seconds, np.float64), (n,))
  dev = schedule.stage_device
  start, end, device_of = {}, {}, {}
  position = [0] * schedule.num_devices
  clock = [0.0] * schedule.num_devices
  pending_b = [[] for _ in range(n)]  # backwards not yet applied
  remaining = sum(len(a) for a in schedule.device_actions)
  while remaining:
    progressed = False
    for d, actions in enumerate(schedule.device_actions):
      while position[d] < len(actions):
        action = actions[position[d]]
        ready = _ready(action, end, dev, comm_seconds, pending_b, n)
        if ready is None:
          break
        t0 = max(clock[d], ready)
        cost = {FORWARD: fwd, BACKWARD: bwd}.get(action.kind)
        duration = step_seconds if cost is None else cost[action.stage]
        start[action], end[action], device_of[action] = t0, t0 + duration, d
        clock[d] = t0 + duration
        if action.kind == BACKWARD:
          pending_b[action.stage].append(action)
        elif action.kind == STEP:
          pending_b[action.stage] = []
        position[d] += 1
        remaining -= 1
        progressed = True
    if not progressed:
      stuck = [
        str(a[p])
        for a, p in zip(schedule.device_actions, position, strict=True)
        if p < len(a)
      ]
      raise ValueError(f"schedule deadlocks; waiting: {stuck}")
  makespan = max(end.values())
  busy = [0.0] * schedule.num_devices
  for action, d in device_of.items():
    busy[d] += end[action] - start[action]
  bubble = 1.0 - sum(busy) / (schedule.num_devices * makespan)
  return Timeline(start, end, device_of, makespan, tuple(busy), bubble)


def _ready(action: Action, end, dev, comm, pending_b, n):
  """When the action's inputs are available, or None if not yet known."""
  s, m = action.stage, action.microbatch
  if action.kind == FORWARD:
    if s == 0:
      return 0.0
    src = Action(FORWARD, s - 1, m)
    if src not in end:
      return None
    return end[src] + (comm if dev[s - 1] != dev[s] else 0.0)
  if action.kind == BACKWARD:
    own = Action(FORWARD, s, m)
    if own not in end:
      return None
    if s == n - 1:
      return end[own]
    src = Action(BACKWARD, s + 1, m)
    if src not in end:
      return None
    return max(end[own], end[src] + (comm if dev[s + 1] != dev[s] else 0.0))
  # A step waits for the backwards it applies (all issued before it).
  return max((end[b] for b in pending_b[s]), default=0.0)
