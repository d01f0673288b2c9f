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

from jpipe.schedule._schedule import Action


class MoveKind(enum.StrEnum):
  """Which end of a transfer a process makes."""

  SEND = "SEND"  # It holds the source stage; another holds the destination.
  RECV = "RECV"  # It holds the destination; another holds the source.
  MOVE = "MOVE"  # It holds both (a copy between its own devices).


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
  whose input or result it carries)."""

  kind: MoveKind
  action: Action
  transfer: Transfer

  def __str__(self) -> str:
    t = self.transfer
    return f"{self.kind}_{t.what}{t.src}->{t.dst}.{self.action.microbatch}"


def lower(
  order: Sequence[Action],
  transfers: Callable[[Action], tuple[Sequence[Transfer], Sequence[Transfer]]],
  stage_process: Sequence[int],
  process: int,
) -> tuple[Action | Move, ...]:
  """Process ``process``'s actions and moves, in issue order.

  Args:
    order: every process's actions in the global issue order.
    transfers: ``action -> (before, after)``: the transfers the action
      needs before it runs and those it makes after.
    stage_process: the process of each stage.
    process: the process whose list this is.

  Returns:
    For each action of ``order``: the moves of its ``before`` transfers
    this process takes part in, the action itself where its stage is this
    process's, then the moves of its ``after`` transfers.
  """
  out = []
  for action in order:
    before, after = transfers(action)
    out += _ends(action, before, stage_process, process)
    if stage_process[action.stage] == process:
      out.append(action)
    out += _ends(action, after, stage_process, process)
  return tuple(out)


def _ends(action, transfers, stage_process, process) -> list[Move]:
  moves = []
  for t in transfers:
    src, dst = stage_process[t.src], stage_process[t.dst]
    if src == process:
      kind = MoveKind.MOVE if dst == process else MoveKind.SEND
    elif dst == process:
      kind = MoveKind.RECV
    else:
      continue
    moves.append(Move(kind, action, t))
  return moves
