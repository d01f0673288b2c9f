"""Pipeline schedules as data: per-device ordered actions.

An action is a forward (F) or backward (B) of stage s on microbatch m, or an
optimizer step (S) of stage s. A backward may also run as two actions
(zero-bubble schedules): I, the input gradient (what stage s - 1 waits
for), and W, the weight gradient (which nothing downstream waits for, so
it can fill a bubble); I then W is B. A device runs its actions in order;
an action also waits for its data: F(s, m) for F(s-1, m) (the
activation), B(s, m) and I(s, m) for F(s, m) and the input gradient of
stage s+1 (its B or I), W(s, m) for I(s, m), S(s) for the backwards (B or
W) it applies. Transfers are the edges between stages on different devices; the
driver issues them as ``device_put`` when the consumer's action is next and
the event simulator charges them as link time.

Semantics are fixed by which backwards each step applies, from which the
delay of every microbatch on every stage follows: the number of steps the
stage takes between F(s, m) and the step that applies m's gradient.
"""

import dataclasses
import enum
from typing import NamedTuple

import numpy as np


class ActionKind(enum.StrEnum):
  """What an action does: a forward, a backward (or its two halves: the
  input gradient and the weight gradient) or the optimizer's update of
  the stage's params (``UPDATE``, written "S" as PipeDream's and
  torch's schedules write a step; not ``step``, which is a whole
  ``Pipeline.step`` call)."""

  FORWARD = "F"
  BACKWARD = "B"
  UPDATE = "S"
  INPUT = "I"
  WEIGHT = "W"

  # A kind equals, and hashes as, its letter ("F"): actions built from
  # either are the same dictionary key.
  __hash__ = str.__hash__


FORWARD, BACKWARD, UPDATE, INPUT, WEIGHT = ActionKind
# The kinds that make a stage's input gradient (what stage s - 1's
# backward waits for), and those that add to its weight gradient (what a
# step applies).
INPUT_GRADIENT = (BACKWARD, INPUT)
WEIGHT_GRADIENT = (BACKWARD, WEIGHT)


class Action(NamedTuple):
  """One unit of work. ``microbatch`` of a step: the last one it applies."""

  kind: ActionKind
  stage: int
  microbatch: int

  def __str__(self) -> str:
    return f"{self.kind}{self.stage}.{self.microbatch}"


@dataclasses.dataclass(frozen=True)
class ActionLists:
  """Per-device action lists: what runs where, in which order.

  A whole schedule, or a segment of a stream (one ``step`` call of an
  asynchronous pipeline): an action's inputs produced by an action that is
  not in the lists ran before them.

  Attributes:
    name: the builder's name.
    num_stages: pipeline stages.
    stage_device: device of every stage.
    device_actions: per device, the actions in execution order.
  """

  name: str
  num_stages: int
  stage_device: tuple[int, ...]
  device_actions: tuple[tuple[Action, ...], ...]

  @property
  def num_devices(self) -> int:
    return len(self.device_actions)

  def actions(self) -> frozenset[Action]:
    """Every action in the lists."""
    return frozenset(a for acts in self.device_actions for a in acts)

  def format(self) -> str:
    """One line per device, e.g. ``dev0: F0.0 F0.1 B0.0 S0.0``."""
    return "\n".join(
      f"dev{d}: " + " ".join(str(a) for a in actions)
      for d, actions in enumerate(self.device_actions)
    )


@dataclasses.dataclass(frozen=True)
class Schedule(ActionLists):
  """Per-device action lists covering whole microbatches, and the
  staleness they imply.

  Attributes:
    name, num_stages, stage_device, device_actions: as ``ActionLists``.
    num_microbatches: microbatches covered (F, B and a step of each on
      every stage).
    step_groups: per stage, the microbatches each of its steps applies, in
      step order.
    forward_version: int [num_stages, num_microbatches]: steps stage s has
      taken when F(s, m) runs.
    delay: int [num_stages, num_microbatches]: steps between F(s, m) and the
      step that applies m's gradient (0 = synchronous).
    backward_uses_stash: whether B(s, m) runs at the weights F(s, m) used
      (weight stashing / 2BW) rather than the latest ones.
  """

  num_microbatches: int
  step_groups: tuple[tuple[tuple[int, ...], ...], ...]
  forward_version: np.ndarray
  delay: np.ndarray
  backward_uses_stash: bool = False


def make_schedule(
  name,
  device_actions,
  stage_device,
  num_microbatches,
  *,
  forward_version=None,
  backward_uses_stash=False,
) -> Schedule:
  """A Schedule from per-device action orders.

  ``forward_version`` overrides the weight version each forward uses
  (2BW's double buffering pins it); otherwise it is the steps the stage has
  taken when its forward runs.
  """
  num_stages = len(stage_device)
  stage_actions = [
    [a for a in device_actions[stage_device[s]] if a.stage == s]
    for s in range(num_stages)
  ]
  groups, version, applied_at = _semantics(stage_actions, num_microbatches)
  if forward_version is not None:
    version = np.asarray(forward_version, np.int64)
  return Schedule(
    name=name,
    num_stages=num_stages,
    num_microbatches=num_microbatches,
    stage_device=tuple(int(d) for d in stage_device),
    device_actions=tuple(tuple(a) for a in device_actions),
    step_groups=groups,
    forward_version=version,
    delay=applied_at - version,
    backward_uses_stash=backward_uses_stash,
  )


def _semantics(stage_actions, num_microbatches):
  """Step groups, forward versions and the step applying each gradient."""
  num_stages = len(stage_actions)
  version = np.full((num_stages, num_microbatches), -1, np.int64)
  applied_at = np.full((num_stages, num_microbatches), -1, np.int64)
  groups = []
  for s, actions in enumerate(stage_actions):
    steps, pending, stage_groups = 0, [], []
    for a in actions:
      if a.kind == FORWARD:
        version[s, a.microbatch] = steps
      elif a.kind in WEIGHT_GRADIENT:
        pending.append(a.microbatch)
      elif a.kind == UPDATE:
        for m in pending:
          applied_at[s, m] = steps
        stage_groups.append(tuple(pending))
        pending, steps = [], steps + 1
    if pending:
      raise ValueError(f"stage {s}: backwards {pending} are never applied")
    groups.append(tuple(stage_groups))
  if np.any(version < 0) or np.any(applied_at < 0):
    raise ValueError(
      "every microbatch needs F, B (or I and W) and a step on every stage"
    )
  return tuple(groups), version, applied_at
