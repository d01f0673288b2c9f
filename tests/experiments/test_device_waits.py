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
