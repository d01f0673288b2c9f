"""Schedules a user writes: parsed, checked with a one-line reason."""

import pytest

from jpipe import schedule as sc
from jpipe.schedule import BACKWARD, FORWARD, INPUT, UPDATE, WEIGHT, Action

TWO_STAGES = """
# device 0: stage 0          device 1: stage 1
0F0 0F1 0I0 0W0 0I1 0W1
1F0 1I0 1F1 1I1 1W0 1W1
"""


def test_text_is_read_as_torch_writes_action_lists():
  lists = sc.parse_actions("0F1 1I0, 0W1 2B3\n\n0S3  # a step")
  assert lists == [
    [
      Action(FORWARD, 0, 1),
      Action(INPUT, 1, 0),
      Action(WEIGHT, 0, 1),
      Action(BACKWARD, 2, 3),
    ],
    [Action(UPDATE, 0, 3)],
  ]
  # A BOM (some Windows editors write one) and CRLF line ends read alike.
  assert sc.parse_actions("\ufeff0F1 1I0, 0W1 2B3\r\n\r\n0S3\r\n") == lists


def test_a_written_schedule_runs_as_written_with_a_step_at_the_end():
  kind = sc.custom_schedule("mine", TWO_STAGES)
  built = kind.on_devices([0, 1], 2)
  assert built.format().splitlines() == [
    "dev0: F0.0 F0.1 I0.0 W0.0 I0.1 W0.1 S0.1",
    "dev1: F1.0 I1.0 F1.1 I1.1 W1.0 W1.1 S1.1",
  ]
  assert (built.delay == 0).all()
  with pytest.raises(ValueError, match="written for 2 microbatches; this"):
    kind.on_devices([0, 1], 4)
  with pytest.raises(ValueError, match=r"devices \[0, 1\]; this pipeline"):
    kind.on_devices([0, 0], 2)
  with pytest.raises(ValueError, match="'1f1b' is a built-in"):
    sc.custom_schedule("1f1b", TWO_STAGES)


@pytest.mark.parametrize(
  "text, reason",
  [
    ("0F0 0I0\n1F0 1I0 1W0", r"never runs 0W0: microbatch 0's weight"),
    ("0F0 0W0 0I0\n1F0 1I0 1W0", r"0W0 reads 0I0's values before"),
    ("0I0 0F0 0W0\n1F0 1I0 1W0", r"0I0 reads 0F0's values before"),
    ("0F0 0F0 0B0\n1F0 1B0", r"0F0 runs twice"),
    ("0F0 0B0 0I0 0W0\n1F0 1B0", "both B and its halves"),
    ("0F0 0F1 0B0\n1F0 1F1 1B0 1B1", r"never runs microbatch 1's backward"),
    ("0F0 1F0 0B0 1B0", r"deadlock: every device waits, at \['0B0'\]"),
    ("0F0 1B0\n1F0 0B0", "a stage runs on one device"),
    ("0F0 0X0", r"'0X0' is not an action"),
    ("1F0 1B0", r"stages \[0\] have no actions"),
    ("0F0 0B0 0S0 0F1 0B1\n1F0 1B0 1S0 1F1 1B1", "never applied"),
  ],
)
def test_lists_that_cannot_run_are_refused_naming_why(text, reason):
  with pytest.raises(sc.ScheduleError, match=reason):
    sc.custom_schedule("mine", text)


@pytest.mark.parametrize("name", sc.SCHEDULES)
@pytest.mark.parametrize("n, m", [(1, 1), (2, 5), (3, 3), (4, 8)])
def test_every_built_in_schedule_passes_the_check(name, n, m):
  """n devices: a stage each, or two in a V (zbv, dualpipev: at least
  the 2n microbatches DualPipeV needs); a schedule placing its stages
  otherwise (interleaved, looped_bfs, interleaved_zb) also two per
  device in a loop."""
  kind = sc.lookup(name)
  kwargs = {"minibatch": n} if name == "2bw" else {}
  stage_device = list(range(n))
  if kind.placement is not None:
    stage_device, m = list(kind.placement(n)), max(m, 2 * n)
  sc.check_schedule(kind.on_devices(stage_device, m, **kwargs))
  if kind.places_itself and kind.placement is None:
    sc.check_schedule(kind.on_devices(sc.loop_placement(2 * n, n), m))


def test_a_microbatch_limit_names_the_stage_over_it():
  one = sc.one_f_one_b(4, 8)
  sc.check_schedule(one, max_in_flight=4)
  with pytest.raises(sc.ScheduleError, match="stage 0 holds 4 .* limit is 3"):
    sc.check_schedule(one, max_in_flight=3)
  with pytest.raises(sc.ScheduleError, match="stage 0 holds 8"):
    sc.check_schedule(sc.gpipe(4, 8), max_in_flight=4)
