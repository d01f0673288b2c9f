"""Schedules a user writes: per-device action lists, checked, then run.

A schedule is written as one line per device of actions
``{stage}{kind}{microbatch}`` -- ``0F1`` is stage 0's forward of
microbatch 1, ``1I0`` stage 1's input gradient of microbatch 0, ``0W1``
a weight gradient, ``2B3`` a whole backward, ``0S3`` a step (applying
the backwards before it) -- as torch.distributed.pipelining writes its
action lists. Without any step, each stage steps once after its last
action (a synchronous schedule). ``check_schedule`` refuses, with one
line naming the action, lists that would deadlock, read a value before
it exists, leave a microbatch's weight gradient unrun, or hold more
microbatches than allowed; every built-in schedule passes it.
"""

import re
from collections.abc import Sequence

from jpipe.schedule._registry import REGISTRY, ScheduleKind
from jpipe.schedule._schedule import (
  BACKWARD,
  FORWARD,
  INPUT,
  UPDATE,
  WEIGHT,
  Action,
  ActionKind,
  ActionLists,
  Schedule,
  make_schedule,
)
from jpipe.schedule._simulate import simulate

_TOKEN = re.compile(r"(\d+)([FBIWS])(\d+)")


class ScheduleError(ValueError):
  """Action lists that cannot run as written (the message says why)."""


def parse_actions(text: str) -> list[list[Action]]:
  """Per device (one non-empty line each, ``#`` starts a comment), its
  actions: ``0F1 1I0 ...`` (module docstring)."""
  devices = []
  text = text.removeprefix("\ufeff")  # (A BOM some editors write.)
  for number, line in enumerate(text.splitlines(), 1):
    line = line.split("#", 1)[0].strip()
    if not line:
      continue
    actions = []
    for token in line.replace(",", " ").split():
      match = _TOKEN.fullmatch(token)
      if match is None:
        raise ScheduleError(
          f"line {number}: {token!r} is not an action: write "
          "{stage}{F|B|I|W|S}{microbatch}, e.g. 0F1 or 1I0"
        )
      stage, kind, microbatch = match.groups()
      actions.append(Action(ActionKind(kind), int(stage), int(microbatch)))
    devices.append(actions)
  if not devices:
    raise ScheduleError("the schedule has no actions")
  return devices


def schedule_from_lists(
  name: str, device_actions: Sequence[Sequence[Action]]
) -> Schedule:
  """The ``Schedule`` of written lists: each stage on the device whose
  list holds its actions, a step per stage at the end when none is
  written; checked (``check_schedule``)."""
  lists = [list(actions) for actions in device_actions]
  stage_device = {}
  for d, actions in enumerate(lists):
    for a in actions:
      if stage_device.setdefault(a.stage, d) != d:
        raise ScheduleError(
          f"{written(a)} is on device {d}, but stage {a.stage}'s other "
          f"actions are on device {stage_device[a.stage]}: a stage runs on "
          "one device"
        )
  n = max(stage_device) + 1
  missing = sorted(set(range(n)) - set(stage_device))
  if missing:
    raise ScheduleError(f"stages {missing} have no actions (stages 0..{n - 1})")
  m = 1 + max(a.microbatch for actions in lists for a in actions)
  if not any(a.kind == UPDATE for actions in lists for a in actions):
    for s in range(n):
      lists[stage_device[s]].append(Action(UPDATE, s, m - 1))
  devices = tuple(stage_device[s] for s in range(n))
  check_schedule(ActionLists(name, n, devices, tuple(map(tuple, lists))))
  try:  # What a step applies: every backward, once.
    return make_schedule(name, lists, devices, m)
  except ValueError as e:
    raise ScheduleError(str(e)) from None


def written(action: Action) -> str:
  """An action as schedule files write it: stage, kind, microbatch
  (``1I0``: stage 1's input gradient of microbatch 0)."""
  return f"{action.stage}{action.kind}{action.microbatch}"


def check_schedule(schedule: ActionLists, max_in_flight: int | None = None):
  """Refuses, with one line naming an action, lists that cannot run:
  a stage's actions on several devices, a microbatch missing an action
  or running one twice, an action before what it reads on its own
  device, a deadlock between devices, or (``max_in_flight``) a stage
  holding more microbatches between F and their weight gradient."""
  n = schedule.num_stages
  m = 1 + max(
    (a.microbatch for acts in schedule.device_actions for a in acts),
    default=-1,
  )
  for d, actions in enumerate(schedule.device_actions):
    for a in actions:
      if schedule.stage_device[a.stage] != d:
        raise ScheduleError(
          f"{written(a)} is on device {d}; stage {a.stage} runs on device "
          f"{schedule.stage_device[a.stage]}"
        )
  for s in range(n):
    actions = schedule.device_actions[schedule.stage_device[s]]
    _check_stage(s, [a for a in actions if a.stage == s], m, max_in_flight)
  try:
    simulate(schedule, 1.0, 1.0)
  except ValueError as e:  # "schedule deadlocks; waiting: [...]"
    waiting = str(e).split("waiting: ", 1)[-1]
    # (The simulator names actions as I1.0: kind, stage, microbatch.)
    waiting = re.sub(r"\b([A-Z])(\d+)\.(\d+)\b", r"\2\1\3", waiting)
    raise ScheduleError(
      f"the lists deadlock: every device waits, at {waiting}"
    ) from None


def _check_stage(s, actions, m, max_in_flight):
  """One stage's own order: each microbatch's F, then B or I then W,
  once each; its weight gradients applied by a step."""
  seen = set()
  for a in actions:
    key = (a.kind, a.microbatch)
    if a.kind != UPDATE and key in seen:
      raise ScheduleError(f"{written(a)} runs twice")
    needs = {
      BACKWARD: FORWARD,
      INPUT: FORWARD,
      WEIGHT: INPUT,
    }.get(a.kind)
    if needs is not None and (needs, a.microbatch) not in seen:
      raise ScheduleError(
        f"{written(a)} reads {written(Action(needs, s, a.microbatch))}'s "
        "values before it runs (it comes later on the device, or never)"
      )
    seen.add(key)
  for b in range(m):
    has = {k for k in (FORWARD, BACKWARD, INPUT, WEIGHT) if (k, b) in seen}
    if FORWARD not in has:
      raise ScheduleError(
        f"stage {s} never runs {written(Action(FORWARD, s, b))}"
      )
    if BACKWARD in has and has & {INPUT, WEIGHT}:
      raise ScheduleError(
        f"stage {s}, microbatch {b}: both B and its halves I / W"
      )
    if INPUT in has and WEIGHT not in has:
      raise ScheduleError(
        f"stage {s} never runs {written(Action(WEIGHT, s, b))}: microbatch "
        f"{b}'s weight gradient would be lost"
      )
    if not has & {BACKWARD, INPUT}:
      raise ScheduleError(f"stage {s} never runs microbatch {b}'s backward")
  if max_in_flight is not None:
    held = peak = 0
    for a in actions:
      held += (a.kind == FORWARD) - (a.kind in (BACKWARD, WEIGHT))
      peak = max(peak, held)
    if peak > max_in_flight:
      raise ScheduleError(
        f"stage {s} holds {peak} microbatches at once between F and their "
        f"weight gradient; the limit is {max_in_flight}"
      )


def custom_schedule(
  name: str, actions: "str | Sequence[Sequence[Action]]", summary: str = ""
) -> ScheduleKind:
  """A ``ScheduleKind`` running written lists as they are (text as
  ``parse_actions`` reads it, or per-device ``Action`` lists), checked
  now; ``jpipe.Pipeline(schedule=...)`` takes it. It runs the stage
  count, devices and microbatch count it was written for, and says so
  when a pipeline asks for others."""
  if name in REGISTRY:
    raise ScheduleError(
      f"{name!r} is a built-in schedule's name: give yours another"
    )
  lists = parse_actions(actions) if isinstance(actions, str) else actions
  schedule = schedule_from_lists(name, lists)

  def builder(stage_device, num_microbatches):
    if list(stage_device) != list(schedule.stage_device):
      raise ScheduleError(
        f"schedule {name!r} puts stages on devices "
        f"{list(schedule.stage_device)}; this pipeline runs them on "
        f"{list(stage_device)}: write one list per device of the plan"
      )
    if num_microbatches != schedule.num_microbatches:
      raise ScheduleError(
        f"schedule {name!r} is written for {schedule.num_microbatches} "
        f"microbatches; this call has {num_microbatches}: pass batches "
        f"of {schedule.num_microbatches} microbatches"
      )
    return schedule

  return ScheduleKind(
    name,
    False,
    summary
    or f"a written schedule of {schedule.num_microbatches} microbatches",
    builder,
    places_itself=True,
    written=schedule,
  )
