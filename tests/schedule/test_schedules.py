"""Schedules as data: well-formed, the delays of the papers, the bubbles."""

import numpy as np
import pytest

from jpipe import schedule as sc

ALL = [
  ("seq", {}),
  ("gpipe", {}),
  ("1f1b", {}),
  ("async", {}),
  ("async", {"step_every": 3}),
  ("2bw", {"minibatch": 4}),
  ("interleaved", {}),
]


def _in_flight(schedule, stage):
  """Most microbatches forwarded but not yet backwarded on a stage."""
  actions = schedule.device_actions[schedule.stage_device[stage]]
  live = peak = 0
  for a in actions:
    if a.stage != stage:
      continue
    live += {sc.FORWARD: 1, sc.BACKWARD: -1}.get(a.kind, 0)
    peak = max(peak, live)
  return peak


@pytest.mark.parametrize("name,kwargs", ALL)
@pytest.mark.parametrize("stages,microbatches", [(1, 4), (3, 8), (4, 8)])
def test_well_formed_and_deadlock_free(name, kwargs, stages, microbatches):
  s = sc.build(name, stages, microbatches, **kwargs)
  for stage in range(stages):
    actions = [
      a for a in s.device_actions[s.stage_device[stage]] if a.stage == stage
    ]
    for kind in (sc.FORWARD, sc.BACKWARD):
      got = sorted(a.microbatch for a in actions if a.kind == kind)
      assert got == list(range(microbatches)), (kind, stage)
    for m in range(microbatches):
      assert actions.index(sc.Action(sc.FORWARD, stage, m)) < actions.index(
        sc.Action(sc.BACKWARD, stage, m)
      )
  sc.simulate(s, 1.0, 2.0, comm_seconds=0.1)  # raises on a deadlock
  assert np.all(s.delay >= 0)


@pytest.mark.parametrize("p,m", [(2, 4), (4, 8), (4, 16), (8, 8)])
@pytest.mark.parametrize("name", ["gpipe", "1f1b"])
def test_synchronous_bubble_is_gpipes(name, p, m):
  s = sc.build(name, p, m)
  timeline = sc.simulate(s, 1.0, 2.0)
  assert timeline.makespan == pytest.approx((m + p - 1) * 3.0)
  assert timeline.bubble == pytest.approx((p - 1) / (m + p - 1))
  assert np.all(s.delay == 0)


def test_1f1b_bounds_activation_memory():
  p, m = 4, 16
  for stage in range(p):
    assert _in_flight(sc.gpipe(p, m), stage) == m
    assert _in_flight(sc.one_f_one_b(p, m), stage) == p - stage


def test_seq_keeps_one_device_busy():
  timeline = sc.simulate(sc.seq(4, 6), 1.0, 2.0)
  assert timeline.bubble == pytest.approx(3 / 4)


@pytest.mark.parametrize("p", [2, 4, 8])
def test_async_delays_and_steady_state(p):
  m = 64
  s = sc.async_1f1b(p, m)
  for stage in range(p):
    d = p - 1 - stage
    np.testing.assert_array_equal(s.delay[stage, :d], np.arange(d))
    assert np.all(s.delay[stage, d:] == d)
  timeline = sc.simulate(s, 1.0, 2.0)
  starts = [timeline.start[sc.Action(sc.FORWARD, 0, k)] for k in range(m)]
  # Steady state: stage 0 takes one microbatch per f + b, no bubble.
  np.testing.assert_allclose(np.diff(starts[2 * p : m - 2 * p]), 3.0)


def test_async_step_every_matches_ftpipe():
  """FTPipe, 4 stages, step_every 2: stage 0 sees delays 2, 1, 2, 1, ..."""
  s = sc.async_1f1b(4, 16, step_every=2)
  assert list(s.delay[0, 4:12]) == [2, 1, 2, 1, 2, 1, 2, 1]
  assert s.step_groups[0][0] == (0, 1)
  assert np.all(s.delay[3] == 0)


def test_2bw_delay_is_one_minibatch():
  s = sc.two_bw(4, 12, minibatch=4)
  assert np.all(s.delay[:, :4] == 0)
  assert np.all(s.delay[:, 4:] == 1)
  assert s.backward_uses_stash
  assert all(len(g) == 4 for g in s.step_groups[0])


def test_interleaved_puts_several_stages_on_a_device():
  s = sc.interleaved([0, 1, 1, 0], 6)
  assert s.num_devices == 2
  assert {a.stage for a in s.device_actions[0]} == {0, 3}
  assert np.all(s.delay == 0)
  asynchronous = sc.interleaved([0, 1, 1, 0], 6, synchronous=False)
  assert asynchronous.delay.max() > 0
  timeline = sc.simulate(s, 1.0, 2.0, comm_seconds=0.5)
  assert 0.0 < timeline.bubble < 1.0


def test_bad_input():
  with pytest.raises(ValueError, match="unknown schedule 'zero_bubble'"):
    sc.build("zero_bubble", 2, 4)
  with pytest.raises(ValueError, match="2bw needs step_every .*>= num_stages"):
    sc.two_bw(4, 8, minibatch=2)
  with pytest.raises(ValueError, match="step_every must be >= 1"):
    sc.async_1f1b(2, 4, step_every=0)
  with pytest.raises(ValueError, match="need >= 1 stage"):
    sc.gpipe(0, 4)
  with pytest.raises(ValueError, match="backwards \\[0\\] are never applied"):
    sc.make_schedule(
      "no_step",
      [[sc.Action(sc.FORWARD, 0, 0), sc.Action(sc.BACKWARD, 0, 0)]],
      [0],
      1,
    )
  f, b, step = sc.FORWARD, sc.BACKWARD, sc.UPDATE
  cyclic = sc.make_schedule(
    "cyclic",
    [
      [sc.Action(b, 0, 0), sc.Action(f, 0, 0), sc.Action(step, 0, 0)],
      [sc.Action(f, 1, 0), sc.Action(b, 1, 0), sc.Action(step, 1, 0)],
    ],
    [0, 1],
    1,
  )
  with pytest.raises(ValueError, match="schedule deadlocks"):
    sc.simulate(cyclic, 1.0, 1.0)


def test_chrome_trace_and_gantt_png(tmp_path):
  import json

  timeline = sc.simulate(sc.one_f_one_b(3, 4), 1e-3, 2e-3)
  path = tmp_path / "trace.json"
  sc.write_chrome_trace(timeline, str(path))
  events = json.loads(path.read_text())["traceEvents"]
  work = [e for e in events if e["ph"] == "X"]
  assert len(work) == 3 * (2 * 4 + 1)
  f00 = [e for e in work if e["name"] == "F0.0"][0]
  assert f00["ts"] == 0.0 and f00["dur"] == pytest.approx(1e3)
  tracks = [e["args"]["name"] for e in events if e["ph"] == "M"]
  assert tracks == ["device 0", "device 1", "device 2"]
  png = tmp_path / "gantt.png"
  sc.plot_timeline(timeline, str(png))
  assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_exports_take_device_names(tmp_path):
  timeline = sc.simulate(sc.gpipe(2, 2), 1.0, 1.0)
  names = ["devices 0-1", "device 2"]
  events = sc.chrome_trace(timeline, names)["traceEvents"]
  assert [e["args"]["name"] for e in events if e["ph"] == "M"] == names
  sc.plot_timeline(timeline, str(tmp_path / "g.png"), device_names=names)
  with pytest.raises(ValueError, match="1 device names for a timeline of 2"):
    sc.chrome_trace(timeline, names[:1])
