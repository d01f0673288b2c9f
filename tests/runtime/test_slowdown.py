"""One simulated-slowdown mechanism for SD-Pipe's heterogeneity and
DynPipe's injected interference (``jpipe.runtime.DeviceSlowdowns``)."""

import numpy as np
import pytest

from jpipe import dynamic, parallel
from jpipe.runtime import DeviceSlowdowns, Slowdown, parse_slowdowns


def test_both_spellings_parse_to_the_same_slowdowns():
  assert parse_slowdowns("3:2.0, 5:1.5", steps=False) == (
    Slowdown(3, 2.0),
    Slowdown(5, 1.5),
  )
  assert parse_slowdowns("1:3.0:100:300,2:2:5", steps=True) == (
    Slowdown(1, 3.0, 100, 300),
    Slowdown(2, 2.0, 5, None),
  )
  # The packages' parsers are views of it.
  assert parallel.parse_slowdown("3:2.0") == {3: 2.0}
  assert dynamic.parse_inject("1:3.0:100:300") == (Slowdown(1, 3.0, 100, 300),)


@pytest.mark.parametrize(
  "text, steps, message",
  [
    ("3=2", False, "write DEVICE:FACTOR "),
    ("1:3", True, "write DEVICE:FACTOR:FROM_STEP"),
    ("1:3:10:5", True, "0 <= FROM_STEP < TO_STEP"),
    ("-1:3", False, "DEVICE >= 0"),
  ],
)
def test_bad_spellings_are_refused_naming_the_form(text, steps, message):
  with pytest.raises(ValueError, match=message):
    parse_slowdowns(text, steps=steps)


def test_factors_multiply_where_their_steps_overlap():
  devices = DeviceSlowdowns((Slowdown(1, 2.0, 0, 10), Slowdown(1, 3.0, 5)))
  assert [devices.factor(1, t) for t in (0, 5, 9, 10)] == [2.0, 6.0, 6.0, 3.0]
  assert devices.factor(0, 5) == 1.0


def test_random_delays_repeat_and_hit_their_probability():
  devices = DeviceSlowdowns(random_seconds=0.5, probability=0.1, seed=3)
  delays = [devices.random_delay(2, i) for i in range(5000)]
  assert delays == [devices.random_delay(2, i) for i in range(5000)]
  assert set(delays) == {0.0, 0.5}
  assert np.mean(delays) / 0.5 == pytest.approx(0.1, abs=0.015)
  assert DeviceSlowdowns().random_delay(2, 7) == 0.0


def test_sdpipe_and_dynpipe_hooks_read_the_same_mechanism():
  h = parallel.Heterogeneity(
    hetero=0.2, slowdown={1: 3.0}, base_seconds=0.01, seed=4
  )
  same = DeviceSlowdowns((Slowdown(1, 3.0),), random_seconds=0.2, seed=4)
  for device in (0, 1):
    for i in range(200):  # SD-Pipe's delay, restated.
      expected = 0.01 * same.factor(device) + same.random_delay(device, i)
      assert h.delay(device, i) == pytest.approx(expected)
  interference = dynamic.Interference(dynamic.parse_inject("1:4:2:6"))
  assert [interference.factor(1, t) for t in range(8)] == [
    1.0 if t < 2 or t >= 6 else 4.0 for t in range(8)
  ]


def test_a_replica_group_sleeps_at_its_slowest_device():
  """SPMD group (devices 0, 1; device 1 4x from step 2): every replica
  waits for the slowest, so the stage sleeps 4x its half of the work;
  a weighted group's replicas sleep their own rows at their own factor
  (restated from the Interference docstring)."""
  from jpipe.schedule import Action

  interference = dynamic.Interference(
    dynamic.parse_inject("1:4:2"), simulated_seconds=0.01
  )
  interference.stage_shares = ((0.25, 0.5), (0.1, 0.15))
  interference.stage_devices = (0, 2)
  interference.stage_groups = ((0, 1), (2,))
  forward = Action("F", 0, 0)
  for step, factor in ((0, 1.0), (2, 4.0)):
    interference.step = step
    interference.before_compute(forward)
    half = 0.25 * 0.01 / 2
    assert interference.take_slept()[0] == pytest.approx(factor * half)
    assert interference.take_replica_slept() == pytest.approx(
      {(0, 0): factor * half, (0, 1): factor * half}
    )
  interference.stage_rows = ((3, 1), None)
  interference.before_compute(forward)
  quarter = 0.25 * 0.01 / 4
  assert interference.take_replica_slept() == pytest.approx(
    {(0, 0): 3 * quarter, (0, 1): 4 * quarter}
  )
  assert interference.take_slept()[0] == pytest.approx(4 * quarter)
