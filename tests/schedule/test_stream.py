"""The asynchronous stream: call boundaries, delays, flushes, ordering."""

import numpy as np
import pytest

from jpipe import partition
from jpipe import schedule as sc


def _stage_list(stream, s, cuts):
  """Stage s's actions over calls ending at ``cuts`` (cumulative)."""
  out, start = [], 0
  for end in cuts:
    out += stream.stage_actions(s, start, end)
    start = end
  return out


@pytest.mark.parametrize(
  "name, n, k", [("async", 4, 1), ("async", 3, 2), ("2bw", 3, 4)]
)
def test_any_call_boundaries_give_one_stream(name, n, k):
  """Feeding 12 microbatches in any split gives every stage the same
  actions in the same order (the call boundaries are invisible)."""
  stream = sc.Stream(name, n, k)
  whole = [_stage_list(stream, s, [12]) for s in range(n)]
  for cuts in ([1, 2, 3, 12], [5, 6, 11, 12], list(range(1, 13))):
    for s in range(n):
      assert _stage_list(stream, s, cuts) == whole[s]


@pytest.mark.parametrize("n, k", [(4, 1), (4, 2), (3, 3)])
def test_delays_match_the_counted_steps(n, k):
  """The rule's delay (b // k - steps before F) against steps counted in
  the finite schedule of the same stream (make_schedule's own count)."""
  stream = sc.Stream("async", n, k)
  counted = stream.schedule((5, 7, 4))  # 16 microbatches, then a flush
  for s in range(n):
    for b in range(16 - k):  # (the flush shortens the last window)
      assert stream.delay(s, b) == counted.delay[s, b]
      assert stream.steps_before_forward(s, b) == counted.forward_version[s, b]
  if k == 1:
    for s in range(n):
      w = partition.steady_state_delay(n, s)
      assert [stream.delay(s, b) for b in range(10)] == [
        min(b, w) for b in range(10)
      ]
      assert stream.max_delay(s) == w


def test_flush_drains_and_steps_a_partial_window():
  stream = sc.Stream("async", 3, 2)
  drained = stream.drain_actions(0, 5)
  # Stage 0 (2 warm-up forwards) still owes backwards 3 and 4; 4 opens a
  # window that only the flush closes.
  assert [str(a) for a in drained] == ["B0.3", "S0.3", "B0.4", "S0.4"]
  assert stream.drain_actions(2, 4) == ()  # last stage: nothing owed
  full = stream.schedule((5,))
  assert full.step_groups[0] == ((0, 1), (2, 3), (4,))


def test_streaming_bubble_approaches_the_warm_up_bound():
  """Equal stage costs, 50 calls of m microbatches: a stream idles only
  in its one warm-up and drain, (p - 1) / (50 m + p - 1); gpipe pays them
  every call."""
  p = 4
  for m in (1, 4, 16):
    stream = sc.Stream("async", p).schedule((m,) * 50)
    bubble = sc.simulate(stream, 1.0, 1.0).bubble
    np.testing.assert_allclose(bubble, (p - 1) / (50 * m + p - 1), rtol=1e-9)
    once = sc.simulate(sc.gpipe(p, m), 1.0, 1.0).bubble
    assert once > bubble


def test_issue_order_respects_devices_and_data():
  stream = sc.Stream("async", 4)
  for fed, m in ((0, 3), (3, 5), (8, 1)):
    lists = sc.place(
      "async",
      [stream.stage_actions(s, fed, fed + m) for s in range(4)],
      [0, 1, 1, 0],
    )
    order = sc.issue_order(lists)
    assert set(order) == lists.actions()
    at = {a: i for i, a in enumerate(order)}
    for acts in lists.device_actions:  # each device's order is kept
      assert [at[a] for a in acts] == sorted(at[a] for a in acts)
    for a in order:  # inputs first, when they are in this segment
      if a.kind == "F" and a.stage:
        src = sc.Action("F", a.stage - 1, a.microbatch)
        assert src not in at or at[src] < at[a]
      if a.kind == "B":
        src = sc.Action("B", a.stage + 1, a.microbatch)
        assert src not in at or at[src] < at[a]
    # Stages sharing a device keep their own order.
    for s, d in enumerate([0, 1, 1, 0]):
      own = [a for a in lists.device_actions[d] if a.stage == s]
      assert own == list(stream.stage_actions(s, fed, fed + m))


def test_action_kinds_are_their_letters():
  for kind, letter in zip(sc.ActionKind, "FBSIW", strict=True):
    assert kind == letter and hash(kind) == hash(letter)
    assert sc.Action(kind, 0, 1) == sc.Action(letter, 0, 1)
    assert {sc.Action(letter, 0, 1): 1}[sc.Action(kind, 0, 1)] == 1
  assert list(sc.ActionKind) == [
    sc.FORWARD,
    sc.BACKWARD,
    sc.UPDATE,
    sc.INPUT,
    sc.WEIGHT,
  ]


def test_bad_streams():
  with pytest.raises(ValueError, match="unknown stream 'zb'"):
    sc.Stream("zb", 2)
  with pytest.raises(ValueError, match="step_every must be >= 1"):
    sc.Stream("async", 2, 0)
  with pytest.raises(ValueError, match="2bw needs step_every.*>= num_stages"):
    sc.Stream("2bw", 4, 3)
  with pytest.raises(ValueError, match="every call needs >= 1 microbatch"):
    sc.Stream("async", 2).schedule((3, 0))
