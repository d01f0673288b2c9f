"""Lowering a global order to per-process actions and transfers."""

import itertools

import numpy as np
import pytest

from jpipe import schedule as schedule_lib
from jpipe.schedule import BACKWARD, FORWARD, UPDATE, Move, MoveKind, Transfer


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
  steps = sum(1 for a in order if a.kind == UPDATE and a.stage)
  tied = sum(1 for a in order if a.kind == FORWARD and a.stage == 2)
  assert len(moves) == forwards + backwards + steps + tied
  assert str(moves[0]).startswith("MOVE_F0->1.")
  assert np.all([isinstance(op.kind, MoveKind) for op in moves])


def _made_by(action, transfer):
  if transfer.what == "F":
    return schedule_lib.Action(FORWARD, transfer.src, action.microbatch)
  return None


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "zbh1"])
@pytest.mark.parametrize("stage_process", [(0, 1, 0, 1), (0, 0, 1, 2)])
def test_early_sends_follow_their_maker_and_meet_their_receive_by_seq(
  schedule, stage_process
):
  """With ``made_by``, an activation is sent right after the forward that
  made it -- never later than without it -- and the ends of every
  transfer between two processes carry the same seq: the receiver's
  transfers numbered in its order are the sender's, whatever order the
  sender sends them in."""
  n = len(stage_process)
  order = _order(schedule, n, 4)
  transfers = _chain_transfers(n)
  processes = sorted(set(stage_process))
  lazy = {
    q: schedule_lib.lower(order, transfers, stage_process, q) for q in processes
  }
  early = {
    q: schedule_lib.lower(order, transfers, stage_process, q, made_by=_made_by)
    for q in processes
  }
  moved = 0
  for q in processes:
    ops, before = early[q], lazy[q]
    assert [op for op in ops if not isinstance(op, Move)] == [
      op for op in before if not isinstance(op, Move)
    ]
    assert sorted(map(str, ops)) == sorted(map(str, before))
    for i, op in enumerate(ops):
      if op.kind != MoveKind.SEND or op.transfer.what != "F":
        continue
      after = ops.index(_made_by(op.action, op.transfer))
      # After its maker, with no compute action between them.
      assert after < i
      assert all(isinstance(x, Move) for x in ops[after + 1 : i])
      moved += before.index(op) > i
  assert moved > 0  # Some sends did move earlier.
  for a, b in itertools.permutations(processes, 2):
    sends = {
      op.seq: (op.action, op.transfer)
      for op in early[a]
      if op.kind == MoveKind.SEND and stage_process[op.transfer.dst] == b
    }
    receives = [
      (op.seq, (op.action, op.transfer))
      for op in early[b]
      if op.kind == MoveKind.RECV and stage_process[op.transfer.src] == a
    ]
    assert [seq for seq, _ in receives] == list(range(len(receives)))
    assert sends == dict(receives)


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "async"])
@pytest.mark.parametrize(
  "stage_processes", [((0, 1), (2,)), ((0,), (0, 1), (1,)), ((0, 1), (1, 2))]
)
def test_a_stage_across_processes_runs_in_each_and_its_ends_match(
  schedule, stage_processes
):
  """A stage on several processes (a replica group across processes):
  against a plain restatement, each of its processes holds its actions
  and makes every transfer's end -- MOVE where it holds both stages,
  SEND or RECV where one; and any two processes meet the transfers they
  share in the same order (a group's all-gather and its lead's sends
  pair up by order)."""
  n = len(stage_processes)
  order = _order(schedule, n, 4)
  transfers = _chain_transfers(n)
  processes = sorted({q for ps in stage_processes for q in ps})
  lowered = {
    q: schedule_lib.lower(order, transfers, stage_processes, q)
    for q in processes
  }
  for q in processes:
    expected = []
    for action in order:
      before, after = transfers(action)
      for t in before:
        expected += _group_end(q, t, action, stage_processes)
      if q in stage_processes[action.stage]:
        expected.append(action)
      for t in after:
        expected += _group_end(q, t, action, stage_processes)
    # (A transfer between two single processes keeps its seq: the other
    # tests check those.)
    assert [_unnumbered(op) for op in lowered[q]] == expected
  for p, q in itertools.combinations(processes, 2):
    ends = [
      [(op.action, op.transfer) for op in lowered[r] if isinstance(op, Move)]
      for r in (p, q)
    ]
    shared = set(ends[0]) & set(ends[1])
    assert [e for e in ends[0] if e in shared] == [
      e for e in ends[1] if e in shared
    ]


def _group_end(q, t, action, stage_processes) -> list:
  """q's end of transfer t at action (stage_processes: of each stage)."""
  srcs, dsts = stage_processes[t.src], stage_processes[t.dst]
  if q in srcs and q in dsts:
    return [Move(MoveKind.MOVE, action, t)]
  if q in srcs:
    return [Move(MoveKind.SEND, action, t)]
  return [Move(MoveKind.RECV, action, t)] if q in dsts else []


def _unnumbered(op):
  return op._replace(seq=-1) if isinstance(op, Move) else op


@pytest.mark.parametrize("shift", [0, 1, 3])
def test_a_round_robin_group_across_processes_runs_b_on_its_replica(shift):
  """1F1B-RR with stage 1's replicas in processes 0 and 1: against a
  plain restatement, F and B of microbatch b run in replica (b + shift)
  mod 2's process alone (the other notes B as ELSEWHERE), steps in both,
  and b's transfers end there."""
  stage_processes = ((0,), (0, 1), (2,))
  replica_process = (None, (0, 1), None)
  order = _order("async", 3, 4)
  transfers = _chain_transfers(3)

  def where(s, b, kind=None):
    if s != 1 or kind == UPDATE:
      return stage_processes[s]
    return (replica_process[1][(b + shift) % 2],)

  for q in (0, 1, 2):
    ops = schedule_lib.lower(
      order,
      transfers,
      stage_processes,
      q,
      replica_process=replica_process,
      shift=shift,
    )
    expected = []
    for action in order:
      b = action.microbatch
      ends = [where(s, b) for s in range(3)]
      before, after = transfers(action)
      for t in before:
        expected += _group_end(q, t, action, ends)
      if q in where(action.stage, b, action.kind):
        expected.append(action)
      elif q in stage_processes[action.stage] and action.kind == BACKWARD:
        note = Transfer("elsewhere", 1, 1, None)
        expected.append(Move(MoveKind.ELSEWHERE, action, note))
      for t in after:
        expected += _group_end(q, t, action, ends)
    assert [_unnumbered(op) for op in ops] == expected
    if q in (0, 1):  # Every step of the group, in both of its processes.
      steps = [a for a in order if a.stage == 1 and a.kind == UPDATE]
      assert (
        steps
        and [op for op in ops if op in steps and not isinstance(op, Move)]
        == steps
      )
