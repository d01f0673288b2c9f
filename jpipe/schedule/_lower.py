"""Lowering a global action order to one process's actions and transfers.

A schedule's actions compute; the values between them move. Across
processes every move is a send on one side and a receive on the other,
and the two sides must issue the moves between them in the same order
(spec/multiprocess.md). ``lower`` makes that explicit, as
torch.distributed.pipelining lowers its schedules into per-rank lists
with SEND_F / RECV_F / SEND_B / RECV_B: walking the global issue order,
it gives each process its own compute actions and, around each action
(of any process), the ``Move``s of that action's transfers in which the
process takes part -- SEND where it holds the source stage, RECV where
it holds the destination, MOVE where it holds both (a local copy between
devices). Every process walks the same order, so for every pair of
processes the sends of one and the receives of the other come in the
same sequence.

What moves for which action is the caller's (it depends on the stage
graph): ``transfers(action)`` returns the transfers the action needs
before it runs (its inputs) and the ones it makes after (its results).
"""

import enum
from collections.abc import Callable, Hashable, Sequence
from typing import NamedTuple

from jpipe.schedule._schedule import BACKWARD, UPDATE, WEIGHT, Action


class MoveKind(enum.StrEnum):
  """Which end of a transfer a process makes."""

  SEND = "SEND"  # It holds the source stage; another holds the destination.
  RECV = "RECV"  # It holds the destination; another holds the source.
  MOVE = "MOVE"  # It holds both (a copy between its own devices).
  # It holds a round-robin group whose replica in another process runs
  # the action (a backward): it notes it, as the group's steps apply
  # every replica's backwards (its ``transfer`` moves nothing).
  ELSEWHERE = "ELSEWHERE"


class Transfer(NamedTuple):
  """A value moving from stage ``src`` to stage ``dst``.

  Attributes:
    what: its kind, as the caller names them (e.g. "F" an activation, "B"
      an input cotangent).
    src, dst: the stages.
    value: which value of its kind (e.g. the activation's variable).
  """

  what: str
  src: int
  dst: int
  value: Hashable


class Move(NamedTuple):
  """A process's end of ``transfer``, made at ``action`` (the action
  whose input or result it carries).

  ``seq``: for a SEND or RECV, the transfer's index among those between
  its two processes in the order's walk (the same at both ends, wherever
  an early send moved it); -1 for a MOVE."""

  kind: MoveKind
  action: Action
  transfer: Transfer
  seq: int = -1

  def __str__(self) -> str:
    t = self.transfer
    return f"{self.kind}_{t.what}{t.src}->{t.dst}.{self.action.microbatch}"


def lower(
  order: Sequence[Action],
  transfers: Callable[[Action], tuple[Sequence[Transfer], Sequence[Transfer]]],
  stage_process: Sequence[int],
  process: int,
  *,
  made_by: Callable[[Action, Transfer], Action | None] | None = None,
  replica_process: Sequence[Sequence[int] | None] | None = None,
  shift: int = 0,
) -> tuple[Action | Move, ...]:
  """Process ``process``'s actions and moves, in issue order.

  Args:
    order: every process's actions in the global issue order.
    transfers: ``action -> (before, after)``: the transfers the action
      needs before it runs and those it makes after.
    stage_process: the process of each stage, or its processes (a tuple:
      a stage across processes runs in each of them; a process that
      holds one end of a transfer and not the other SENDs or RECVs,
      whatever else holds them).
    process: the process whose list this is.
    made_by: ``(action, transfer) -> the action that makes the value``
      of a ``before`` transfer, or None. Given (a transport whose ends
      match by ``seq``, not by order), this process sends such a value
      right after the action that makes it, when that action is in the
      order: it then travels while the sender goes on, instead of
      waiting for the sender to reach its reader's place in the order.
    replica_process: per stage, None or (a round-robin group across
      processes) the process of each of its k replicas: microbatch b's
      actions of the stage but its steps, and the ends of b's transfers
      there, are those of replica (b + shift) mod k's process alone (the
      group's other processes note its backwards: ``ELSEWHERE``); its
      steps run in all of ``stage_process``'s.
    shift: added to the order's microbatches to pick their replicas (a
      call lowered once and shifted, as ``shift``'s ``Call``).

  Returns:
    For each action of ``order``: the moves of its ``before`` transfers
    this process takes part in (a SEND moved early: after its maker),
    the action itself where its stage is this process's, then the moves
    of its ``after`` transfers.
  """
  stage_process = [
    tuple(p) if isinstance(p, (tuple, list)) else (p,) for p in stage_process
  ]
  where = _Where(stage_process, replica_process, shift)
  position = {a: i for i, a in enumerate(order)}
  seqs: dict[tuple[int, int], int] = {}
  placed: list[list[Action | Move]] = [[] for _ in order]
  early: list[list[Move]] = [[] for _ in order]  # Sends after order[i].
  for i, action in enumerate(order):
    before, after = transfers(action)
    ends = where.ends(action.microbatch)
    for move in _ends(action, before, ends, process, seqs):
      maker = None
      if made_by is not None and move.kind == MoveKind.SEND:
        maker = position.get(made_by(action, move.transfer))
      if maker is not None and maker < i:
        early[maker].append(move)
      else:
        placed[i].append(move)
    placed[i] += where.runs(action, process)
    placed[i] += _ends(action, after, ends, process, seqs)
  out = []
  for ops, sends in zip(placed, early, strict=True):
    out += ops
    out += sends
  return tuple(out)


class _Where(NamedTuple):
  """Which processes run a stage's actions and make its transfers' ends
  (``lower``'s arguments of that name)."""

  stage_process: Sequence[tuple[int, ...]]
  replica_process: Sequence[Sequence[int] | None] | None
  shift: int

  def processes(self, s: int, b: int, kind=None) -> tuple[int, ...]:
    """Where stage s runs microbatch b (an action of ``kind``)."""
    r = self.replica_process[s] if self.replica_process else None
    if r is None or kind == UPDATE:
      return self.stage_process[s]
    return (r[(b + self.shift) % len(r)],)

  def ends(self, b: int) -> Sequence[tuple[int, ...]]:
    """Per stage, the processes of microbatch b's transfer ends there."""
    if self.replica_process is None:
      return self.stage_process
    return [self.processes(s, b) for s in range(len(self.stage_process))]

  def runs(self, action: Action, process: int) -> list:
    """What ``process`` makes of ``action``: the action, a note that
    another process's replica ran its backward (ELSEWHERE), or nothing."""
    s, b = action.stage, action.microbatch
    if process in self.processes(s, b, action.kind):
      return [action]
    if process in self.stage_process[s] and action.kind in (BACKWARD, WEIGHT):
      note = Transfer("elsewhere", s, s, None)
      return [Move(MoveKind.ELSEWHERE, action, note)]
    return []


def _ends(action, transfers, stage_process, process, seqs) -> list[Move]:
  moves = []
  for t in transfers:
    srcs, dsts = stage_process[t.src], stage_process[t.dst]
    if len(srcs) > 1 or len(dsts) > 1:  # A group across processes.
      kind = _group_end(process, srcs, dsts)
      if kind is not None:
        moves.append(Move(kind, action, t))
      continue
    (src,), (dst,) = srcs, dsts
    if src == dst == process:
      moves.append(Move(MoveKind.MOVE, action, t))
      continue
    if process not in (src, dst):
      if src != dst:  # Both ends count every transfer of their pair.
        seqs[(src, dst)] = seqs.get((src, dst), 0) + 1
      continue
    seq = seqs.get((src, dst), 0)
    seqs[(src, dst)] = seq + 1
    kind = MoveKind.SEND if src == process else MoveKind.RECV
    moves.append(Move(kind, action, t, seq))
  return moves


def _group_end(process, srcs, dsts) -> MoveKind | None:
  """A process's end of a transfer where a stage spans processes (no
  ``seq``: such ends meet by order): MOVE where it holds both stages,
  SEND or RECV where it holds one, None where neither."""
  if process in srcs:
    return MoveKind.MOVE if process in dsts else MoveKind.SEND
  return MoveKind.RECV if process in dsts else None
