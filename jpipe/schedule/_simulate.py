"""Event simulation of a schedule: makespan and bubble from stage costs."""

import dataclasses
from collections.abc import Sequence

import numpy as np

from jpipe.schedule._schedule import (
  BACKWARD,
  FORWARD,
  INPUT,
  UPDATE,
  WEIGHT,
  WEIGHT_GRADIENT,
  Action,
  ActionLists,
)


@dataclasses.dataclass(frozen=True)
class Timeline:
  """When every action ran (seconds from the start).

  Attributes:
    start, end: per action, keyed by the Action.
    device_of: per action, its device.
    makespan: end of the last action.
    busy: per device, seconds of work.
    bubble: idle fraction, ``1 - sum(busy) / (num_devices * makespan)``.
    arrived: measured timelines of a process of a multi-process pipeline:
      per action whose inputs another process sends, when they were ready
      here (seconds from the start; empty otherwise).
    clock_origin: measured timelines: the start on ``time.perf_counter``'s
      clock (system-wide on Linux: timelines of processes of one host
      line up by it); 0 for a simulated one.
  """

  start: dict
  end: dict
  device_of: dict
  makespan: float
  busy: tuple[float, ...]
  bubble: float
  arrived: dict = dataclasses.field(default_factory=dict)
  clock_origin: float = 0.0


def simulate(
  schedule: ActionLists,
  forward_seconds: Sequence[float] | float,
  backward_seconds: Sequence[float] | float,
  *,
  comm_seconds: Sequence[float] | float = 0.0,
  step_seconds: float = 0.0,
  input_seconds: Sequence[float] | float | None = None,
  weight_seconds: Sequence[float] | float | None = None,
) -> Timeline:
  """Runs the schedule on ideal devices with per-stage costs.

  Each device executes its actions in order; an action starts when its
  device is free and its inputs have arrived (``comm_seconds`` for a value
  crossing devices, 0 within a device). An input whose producer is not in
  the lists (a segment of a stream) is there from the start.

  Args:
    schedule: the schedule (or a segment of a stream).
    forward_seconds, backward_seconds: per stage (or one for all).
    comm_seconds: transfer time of an activation or gradient between
      devices: one for every cut, or per cut [S - 1] (the value crossing
      between stages s and s + 1 takes ``comm_seconds[s]``).
    step_seconds: duration of an optimizer step.
    input_seconds, weight_seconds: per stage (or one for all), the two
      halves of a backward run as I and W; default half the backward
      each (W: the backward less I when only I is given).

  Returns:
    The timeline.
  """
  n = schedule.num_stages
  fwd = np.broadcast_to(np.asarray(forward_seconds, np.float64), (n,))
  bwd = np.broadcast_to(np.asarray(backward_seconds, np.float64), (n,))
  inp = bwd / 2 if input_seconds is None else input_seconds
  inp = np.broadcast_to(np.asarray(inp, np.float64), (n,))
  wgt = bwd - inp if weight_seconds is None else weight_seconds
  wgt = np.broadcast_to(np.asarray(wgt, np.float64), (n,))
  costs = {FORWARD: fwd, BACKWARD: bwd, INPUT: inp, WEIGHT: wgt}
  comm = np.asarray(comm_seconds, np.float64)
  if comm.ndim and comm.shape != (n - 1,):
    raise ValueError(
      f"comm_seconds needs one per cut ({n - 1}), got {comm.shape}"
    )
  dev = schedule.stage_device
  start, end, device_of = {}, {}, {}
  position = [0] * schedule.num_devices
  clock = [0.0] * schedule.num_devices
  pending_b = [[] for _ in range(n)]  # backwards not yet applied
  listed = schedule.actions()
  remaining = sum(len(a) for a in schedule.device_actions)
  while remaining:
    progressed = False
    for d, actions in enumerate(schedule.device_actions):
      while position[d] < len(actions):
        action = actions[position[d]]
        ready = ready_time(action, end, dev, comm, pending_b, n, listed)
        if ready is None:
          break
        t0 = max(clock[d], ready)
        cost = costs.get(action.kind)
        duration = step_seconds if cost is None else cost[action.stage]
        start[action], end[action], device_of[action] = t0, t0 + duration, d
        clock[d] = t0 + duration
        if action.kind in WEIGHT_GRADIENT:
          pending_b[action.stage].append(action)
        elif action.kind == UPDATE:
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
  makespan = max(end.values(), default=0.0)
  busy = [0.0] * schedule.num_devices
  for action, d in device_of.items():
    busy[d] += end[action] - start[action]
  bubble = 1.0 - sum(busy) / (schedule.num_devices * makespan or 1.0)
  return Timeline(start, end, device_of, makespan, tuple(busy), bubble)


def ready_time(action: Action, end, dev, comm, pending_b, n, listed):
  """When ``action``'s inputs are available (seconds), or None if not yet
  known.

  Args:
    action: the action.
    end: end time of every action that ran so far.
    dev: the device of every stage.
    comm: seconds a value takes to cross devices (a scalar, or per cut:
      ``comm[s]`` between stages s and s + 1).
    pending_b: per stage, backwards its next step applies.
    n: stages.
    listed: the actions of the lists being run; inputs from actions
      outside them (earlier segments of a stream) are ready at 0.
  """
  s, m = action.stage, action.microbatch

  def arrival(src, src_stage):
    if src not in listed:
      return 0.0
    if src not in end:
      return None
    if dev[src_stage] == dev[s]:
      return end[src]
    return end[src] + float(
      comm if np.ndim(comm) == 0 else comm[min(s, src_stage)]
    )

  if action.kind == FORWARD:
    return 0.0 if s == 0 else arrival(Action(FORWARD, s - 1, m), s - 1)
  if action.kind in (BACKWARD, INPUT):
    own = arrival(Action(FORWARD, s, m), s)
    if own is None or s == n - 1:
      return own
    # The next stage's input gradient: its I where it splits, else its B.
    made_by = Action(INPUT, s + 1, m)
    if made_by not in listed:
      made_by = Action(BACKWARD, s + 1, m)
    src = arrival(made_by, s + 1)
    return None if src is None else max(own, src)
  if action.kind == WEIGHT:
    return arrival(Action(INPUT, s, m), s)
  # A step waits for the backwards it applies (all issued before it).
  return max((end[b] for b in pending_b[s]), default=0.0)
