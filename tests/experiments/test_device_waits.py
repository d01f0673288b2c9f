"""experiments.distributed.device_waits: a process's device time split
into busy, waiting for another process's value and otherwise idle."""

import pytest

from experiments.distributed import device_waits
from jpipe import schedule


def _r(kind, stage, b, start, end, arrived=None):
  """An action record, times in milliseconds."""
  return {
    "kind": kind,
    "stage": stage,
    "microbatch": b,
    "device": stage,
    "start": start / 1e3,
    "end": end / 1e3,
    "arrived": None if arrived is None else arrived / 1e3,
  }


def test_gaps_are_split_by_what_the_action_waited_for():
  """Worked by hand: process 1's first forward waits 12 ms for its
  activation (made at 10, arrived 12: 2 ms latency); its second arrives
  while it is busy (no wait, not timed); a 2 ms gap before a backward
  with no remote input is other idle, as is the tail to the window's
  end; process 0's backward waits 10 ms for a cotangent that took 2."""
  p0 = [
    _r("F", 0, 0, 0, 10),
    _r("F", 0, 1, 10, 20),
    _r("B", 0, 0, 30, 50, arrived=30),
  ]
  p1 = [
    _r("F", 1, 0, 12, 18, arrived=12),
    _r("B", 1, 0, 18, 28),
    _r("F", 1, 1, 28, 34, arrived=22),
    _r("B", 1, 1, 36, 46),
  ]
  w0, w1 = device_waits.device_waits([p0, p1], steps=1)
  assert w0 == pytest.approx(
    {
      "busy": 40.0,
      "transfer_wait": 10.0,
      "other_idle": 0.0,
      "waits": 1,
      "latency_ms": 2.0,
    }
  )
  assert w1 == pytest.approx(
    {
      "busy": 32.0,
      "transfer_wait": 12.0,
      "other_idle": 6.0,
      "waits": 1,
      "latency_ms": 2.0,
    }
  )
  # Per step: two steps' worth halves every figure but the latency.
  half = device_waits.device_waits([p0, p1], steps=2)[1]
  assert half["busy"] == 16.0 and half["latency_ms"] == pytest.approx(2.0)
  assert "process 1" in device_waits.table([w0, w1])


def test_a_fused_backward_s_cotangent_comes_from_the_next_forward():
  """The last stage's backward ran inside its forward's program: the
  cotangent's producer is that forward."""
  p0 = [_r("F", 0, 0, 0, 10), _r("B", 0, 0, 25, 30, arrived=25)]
  p1 = [_r("F", 1, 0, 11, 20, arrived=11)]
  w0, w1 = device_waits.device_waits([p0, p1], steps=1)
  assert w0["latency_ms"] == pytest.approx(5.0)
  assert w1["latency_ms"] == pytest.approx(1.0)


def test_a_simulated_timeline_is_all_busy_or_other_idle():
  """A simulated timeline (no process sends it anything): busy equals the
  timeline's own per-device busy time; every gap is other idle."""
  lists = schedule.gpipe(3, 4)
  timeline = schedule.simulate(lists, [1.0, 2.0, 1.5], [2.0, 4.0, 3.0])
  records = device_waits.records(timeline)
  assert len(records) == len(timeline.start)
  assert all(r["arrived"] is None for r in records)
  per_device = [[r for r in records if r["device"] == d] for d in range(3)]
  waits = device_waits.device_waits(per_device, steps=1)
  for d, w in enumerate(waits):
    assert w["busy"] == pytest.approx(timeline.busy[d] * 1e3)
    assert w["transfer_wait"] == 0 and w["latency_ms"] is None
    assert w["busy"] + w["other_idle"] == pytest.approx(timeline.makespan * 1e3)


def test_a_synchronous_schedule_s_calls_reuse_microbatch_numbers():
  """Two calls of a synchronous schedule both run F(0, 0): a forward's
  activation came from the run that started before it arrived."""
  p0 = [_r("F", 0, 0, 0, 10), _r("F", 0, 0, 100, 110)]
  p1 = [_r("F", 1, 0, 13, 20, arrived=13), _r("F", 1, 0, 115, 120, arrived=115)]
  _, w1 = device_waits.device_waits([p0, p1], steps=2)
  assert w1["latency_ms"] == pytest.approx(4.0)  # median of 3 and 5


def test_transfer_latencies_from_both_ends_stamps():
  """Worked by hand: value 7 was asked for 5 s before it existed and
  arrived 3 ms after; value 8 was asked for 2 ms after it existed and
  arrived 1 ms after that; value 9 never arrived (not counted)."""
  sender = [
    ("offer", 7, 0.0),
    ("ready", 7, 10.0),
    ("offer", 8, 10.5),
    ("ready", 8, 11.0),
    ("offer", 9, 12.0),
    ("ready", 9, 12.5),
  ]
  receiver = [
    ("pull", 7, 5.0),
    ("arrived", 7, 10.003),
    ("pull", 8, 11.002),
    ("arrived", 8, 11.003),
    ("pull", 9, 12.6),
  ]
  rows = device_waits.transfer_latencies(sender, receiver)
  assert [r["ready"] for r in rows] == [10.0, 11.0]
  assert rows[0]["early"] == pytest.approx(5.0)
  assert rows[0]["transfer"] == pytest.approx(0.003)
  assert rows[1]["early"] == pytest.approx(-0.002)
  assert rows[1]["transfer"] == pytest.approx(0.001)
