"""Pure functions of action lists: devices, issue order, fusable pairs
(a forward with its backward; a backward with the step after it).

A driver in one process dispatches every device's actions from one thread,
so it needs one global order consistent with every device's list and with
the data dependencies; the order of the ideal timeline (unit costs) is one.
"""

from collections.abc import Sequence

from jpipe.schedule._schedule import (
  BACKWARD,
  FORWARD,
  UPDATE,
  Action,
  ActionLists,
)
from jpipe.schedule._simulate import simulate


def place(
  name: str,
  stage_actions: Sequence[Sequence[Action]],
  stage_device: Sequence[int],
) -> ActionLists:
  """Per-stage action lists moved onto (possibly shared) devices.

  Each stage keeps its order; stages sharing a device are interleaved in
  the order of their ideal timeline (unit costs, one device per stage;
  a step first among actions starting together), which keeps every
  dependency satisfiable.
  """
  n = len(stage_actions)
  stage_device = tuple(int(d) for d in stage_device)
  own = ActionLists(
    name, n, tuple(range(n)), tuple(tuple(a) for a in stage_actions)
  )
  if stage_device == own.stage_device:
    return own
  timeline = simulate(own, 1.0, 1.0)
  merged = [[] for _ in range(max(stage_device) + 1)]
  for s, acts in enumerate(own.device_actions):
    for i, a in enumerate(acts):
      key = (timeline.start[a], a.kind != UPDATE, s, i)
      merged[stage_device[s]].append((*key, a))
  return ActionLists(
    name,
    n,
    stage_device,
    tuple(tuple(a for *_, a in sorted(m)) for m in merged),
  )


def issue_order(lists: ActionLists) -> tuple[Action, ...]:
  """A global action order consistent with every device's list and the
  data dependencies (the order of the simulated start times with unit
  costs; steps, which take none, first among actions starting together,
  so what a step hands on -- a tied leaf's gradient -- leaves before the
  other stages' work of that moment)."""
  timeline = simulate(lists, 1.0, 1.0)
  position = {a: i for acts in lists.device_actions for i, a in enumerate(acts)}
  return tuple(
    sorted(
      position,
      key=lambda a: (
        timeline.start[a],
        a.kind != UPDATE,
        timeline.device_of[a],
        position[a],
      ),
    )
  )


def fusable_pairs(
  lists: ActionLists, output_free: Sequence[bool]
) -> frozenset[tuple[int, int]]:
  """(stage, microbatch) pairs whose backward may run with the forward:
  the stage has no outputs (``output_free[s]``: its backward needs nothing
  but its own forward), both are in the lists and no step of the stage
  lies between them on its device (so the gradient joins the same step)."""
  pairs = set()
  for acts in lists.device_actions:
    forward_at = {}
    for i, a in enumerate(acts):
      if not output_free[a.stage]:
        continue
      if a.kind == FORWARD:
        forward_at[(a.stage, a.microbatch)] = i
      elif a.kind == BACKWARD and (a.stage, a.microbatch) in forward_at:
        i0 = forward_at[(a.stage, a.microbatch)]
        if not any(
          b.kind == UPDATE and b.stage == a.stage for b in acts[i0 + 1 : i]
        ):
          pairs.add((a.stage, a.microbatch))
  return frozenset(pairs)


def step_fusable_backwards(
  lists: ActionLists, fused: frozenset[tuple[int, int]] = frozenset()
) -> frozenset[tuple[int, int]]:
  """(stage, microbatch) of every backward whose stage's next action on
  its device is that stage's step: nothing of the stage runs between
  them, so the step may run in the backward's own program (the gradient
  it ends with applied at once). A backward in ``fused``
  (``fusable_pairs``: run in its forward's program) qualifies only where
  its forward comes right before it too. Other stages' actions in
  between do not matter: they read none of this stage's params or state
  (tied leaves aside: the driver keeps a tied leaf owner's step apart
  where a holder's gradient of the leaf arrives after its backward)."""
  pairs = set()
  for acts in lists.device_actions:
    last = {}  # stage -> its latest two actions so far on this device
    for a in acts:
      before = last.get(a.stage, (None, None))
      b = before[1]
      if a.kind == UPDATE and b is not None and b.kind == BACKWARD:
        key = (a.stage, b.microbatch)
        f = before[0]
        if key not in fused or (
          f is not None and f.kind == FORWARD and f.microbatch == b.microbatch
        ):
          pairs.add(key)
      last[a.stage] = (before[1], a)
  return frozenset(pairs)
