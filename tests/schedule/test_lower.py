"""Lowering a global order to per-process actions and transfers."""

import itertools

import numpy as np
import pytest

from jpipe import schedule as schedule_lib
from jpipe.schedule import BACKWARD, FORWARD, STEP, Move, MoveKind, Transfer


def _chain_transfers(num_stages):
  """A chain's moves: F(s) reads stage s-1's activation and the tied
  value of stage 0; B(s) sends its input cotangent back; S(s) of a later
  stage hands stage 0 a gradient."""

  def transfers(action):
    s, b = action.stage, action.microbatch
    if action.kind == FORWARD:
      before = [Transfer("F", s - 1, s, f"x{s}")] if s else []
      if s == num_stages - 1 and s:
        before.insert(0, Transfer("tied", 0, s, "emb"))
      return before, ()
    if action.kind == BACKWARD:
      return (), [Transfer("B", s, s - 1, f"x{s}")] if s else ()
    del b
    return (), [Transfer("tied_grad", s, 0, "emb")] if s else ()

  return transfers


def _order(schedule, num_stages, m):
  lists = schedule_lib.build(schedule, num_stages, m)
  return schedule_lib.issue_order(lists)


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "async"])
@pytest.mark.parametrize(
  "stage_process", [(0, 0, 0, 0), (0, 1, 0, 1), (0, 0, 1, 2)]
)
def test_each_pair_of_processes_sends_and_receives_in_one_sequence(
  schedule, stage_process
):
  """For every ordered pair of processes, the sends of one to the other
  are the receives of the other from the one, in the same order; each
  process holds its own stages' actions in the global order; a transfer
  inside a process is a MOVE there and nothing elsewhere."""
  n = len(stage_process)
  order = _order(schedule, n, 4)
  transfers = _chain_transfers(n)
  processes = sorted(set(stage_process))
  lowered = {
    q: schedule_lib.lower(order, transfers, stage_process, q) for q in processes
  }
  for q, ops in lowered.items():
    own = [a for a in order if stage_process[a.stage] == q]
    assert [op for op in ops if not isinstance(op, Move)] == own
    for op in ops:
      if isinstance(op, Move):
        t = op.transfer
        ends = (stage_process[t.src], stage_process[t.dst])
        want = {
          MoveKind.MOVE: (q, q),
          MoveKind.SEND: (q, ends[1]),
          MoveKind.RECV: (ends[0], q),
        }[op.kind]
        assert ends == want and (op.kind == MoveKind.MOVE) == (
          ends[0] == ends[1]
        )
  for a, b in itertools.permutations(processes, 2):
    sends = [
      (op.action, op.transfer)
      for op in lowered[a]
      if op.kind == MoveKind.SEND and stage_process[op.transfer.dst] == b
    ]
    receives = [
      (op.action, op.transfer)
      for op in lowered[b]
      if op.kind == MoveKind.RECV and stage_process[op.transfer.src] == a
    ]
    assert sends == receives


def test_inputs_come_before_their_action_and_results_after():
  """Against a plain restatement: in one process, each action is preceded
  by the moves of its inputs and followed by the moves of its results,
  every transfer of the chain appearing exactly once."""
  order = _order("1f1b", 3, 3)
  transfers = _chain_transfers(3)
  ops = schedule_lib.lower(order, transfers, (0, 0, 0), 0)
  expected = []
  for action in order:
    before, after = transfers(action)
    expected += [Move(MoveKind.MOVE, action, t) for t in before]
    expected.append(action)
    expected += [Move(MoveKind.MOVE, action, t) for t in after]
  assert list(ops) == expected
  moves = [op for op in ops if isinstance(op, Move)]
  forwards = sum(1 for a in order if a.kind == FORWARD and a.stage)
  backwards = sum(1 for a in order if a.kind == BACKWARD and a.stage)
  steps = sum(1 for a in order if a.kind == STEP and a.stage)
  tied = sum(1 for a in order if a.kind == FORWARD and a.stage == 2)
  assert len(moves) == forwards + backwards + steps + tied
  assert str(moves[0]).startswith("MOVE_F0->1.")
  assert np.all([isinstance(op.kind, MoveKind) for op in moves])
