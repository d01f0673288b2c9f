"""What one ``step`` or ``flush`` call runs: action lists, issue order and
fusable pairs, mapped onto the pipeline's devices and cached.

A synchronous call is its schedule for the call's microbatch count. An
asynchronous call is a segment of the stream: per stage, the actions the
fed microbatches make possible (``Stream.stage_actions``), or a flush's
drain. Past every stage's warm-up a segment depends on how many
microbatches were fed only through the step windows, so steady-state calls
are built once and reused with shifted microbatch indices.
"""

import dataclasses
import functools

from jpipe import schedule as schedule_lib


@dataclasses.dataclass(frozen=True)
class Call:
  """One call's work.

  Attributes:
    lists: per schedule device, its actions in order.
    order: every action, in one order that respects the lists and the
      data dependencies (the driver dispatches in it).
    fused: ``(stage, microbatch)`` pairs whose backward may run with the
      forward as one program.
    fused_steps: ``(stage, microbatch)`` of the backwards whose stage's
      step may run in the same program (for a pair in ``fused``: in its
      forward's).
  """

  lists: schedule_lib.ActionLists
  order: tuple[schedule_lib.Action, ...]
  fused: frozenset
  fused_steps: frozenset = frozenset()

  @property
  def base(self) -> "Call":
    """The cached call this one is a shift of (itself)."""
    return self

  @property
  def shift(self) -> int:
    """Microbatches this call is later than ``base`` in the stream."""
    return 0

  def shifted(self, shift: int) -> "Call | ShiftedCall":
    """The same call ``shift`` microbatches later in the stream."""
    return ShiftedCall(self, shift) if shift else self


def _shift_action(a, shift):
  return schedule_lib.Action(a.kind, a.stage, a.microbatch + shift)


def shifted_ops(ops, shift: int):
  """Lowered ``ops`` (actions and moves) ``shift`` microbatches later."""
  if not shift:
    return ops
  return [
    op._replace(action=_shift_action(op.action, shift))
    if type(op) is schedule_lib.Move
    else _shift_action(op, shift)
    for op in ops
  ]


@dataclasses.dataclass(frozen=True, eq=False)
class ShiftedCall:
  """``base`` (a cached ``Call``) ``shift`` microbatches later: a steady
  stream's every call. Its lists, order and fused pairs are built only
  when read (a profiled call, a test): the driver runs ``base``'s
  lowered ops shifted (``Driver.lower``), so a call does not pay for
  re-building and re-lowering its order."""

  base: Call
  shift: int

  @functools.cached_property
  def lists(self) -> schedule_lib.ActionLists:
    lists = self.base.lists
    return schedule_lib.ActionLists(
      lists.name,
      lists.num_stages,
      lists.stage_device,
      tuple(
        tuple(_shift_action(a, self.shift) for a in acts)
        for acts in lists.device_actions
      ),
    )

  @functools.cached_property
  def order(self) -> tuple[schedule_lib.Action, ...]:
    return tuple(_shift_action(a, self.shift) for a in self.base.order)

  @functools.cached_property
  def fused(self) -> frozenset:
    return frozenset((s, b + self.shift) for s, b in self.base.fused)

  @functools.cached_property
  def fused_steps(self) -> frozenset:
    return frozenset((s, b + self.shift) for s, b in self.base.fused_steps)


class CallActions:
  """Builds (and caches) the ``Call`` of a pipeline's calls.

  Args:
    kind: the schedule (``jpipe.schedule.ScheduleKind``).
    stream: the asynchronous stream, or None (synchronous).
    num_stages: pipeline stages.
    stage_device: each stage's schedule device (stages sharing a device
      are interleaved in the order of their ideal timeline).
    output_free: per stage, whether no other stage reads its values (its
      backward may then fuse with its forward).
    fuse: whether to fuse such pairs at all.
    fuse_steps: whether a stream's backward may run with the step after
      it (``schedule.step_fusable_backwards``).
  """

  def __init__(
    self,
    kind,
    stream,
    num_stages,
    stage_device,
    *,
    output_free,
    fuse,
    fuse_steps=False,
  ):
    self.kind = kind
    self.name = kind.name
    self.stream = stream
    self.num_stages = num_stages
    self.stage_device = tuple(stage_device)
    self.output_free = tuple(output_free)
    self.fuse = fuse
    self.fuse_steps = fuse_steps
    self._cache: dict[tuple, Call] = {}

  def __call__(self, fed: int, m: int | None) -> "Call | ShiftedCall":
    """The call feeding m microbatches after ``fed`` (m None: a flush)."""
    start = fed if self.stream is None else self.stream.steady_start(fed)
    key = (m, start)
    if key not in self._cache:
      if self.stream is None:
        lists = self.synchronous(m)
      else:
        lists = schedule_lib.place(
          self.name,
          [
            self.stream.drain_actions(s, start)
            if m is None
            else self.stream.stage_actions(s, start, start + m)
            for s in range(self.num_stages)
          ],
          self.stage_device,
        )
      fused = frozenset()
      if self.fuse:
        fused = schedule_lib.fusable_pairs(lists, self.output_free)
      fused_steps = frozenset()
      if self.fuse_steps and self.stream is not None:
        fused_steps = schedule_lib.step_fusable_backwards(lists, fused)
      self._cache[key] = Call(
        lists, schedule_lib.issue_order(lists), fused, fused_steps
      )
    return self._cache[key].shifted(fed - start)

  def synchronous(self, m: int) -> schedule_lib.Schedule:
    """The synchronous schedule of m microbatches on the devices."""
    return self.kind.on_devices(self.stage_device, m)
