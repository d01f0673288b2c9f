"""Pipeline schedules as data, and an event simulator for them."""

from jpipe.schedule._builders import (
  async_1f1b,
  eager_1f1b,
  gpipe,
  interleaved,
  looped_bfs,
  one_f_one_b,
  seq,
  two_bw,
)
from jpipe.schedule._custom import (
  ScheduleError,
  check_schedule,
  custom_schedule,
  parse_actions,
  schedule_from_lists,
)
from jpipe.schedule._export import (
  chrome_trace,
  plot_timeline,
  write_chrome_trace,
)
from jpipe.schedule._lower import Move, MoveKind, Transfer, lower
from jpipe.schedule._order import fusable_pairs, issue_order, place
from jpipe.schedule._registry import (
  REGISTRY,
  SCHEDULES,
  STREAMS,
  SYNCHRONOUS,
  ScheduleKind,
  build,
  lookup,
)
from jpipe.schedule._schedule import (
  BACKWARD,
  FORWARD,
  INPUT,
  INPUT_GRADIENT,
  STEP,
  WEIGHT,
  WEIGHT_GRADIENT,
  Action,
  ActionKind,
  ActionLists,
  Schedule,
  make_schedule,
)
from jpipe.schedule._simulate import Timeline, ready_time, simulate
from jpipe.schedule._stream import Stream
from jpipe.schedule._zero_bubble import zero_bubble_h1

__all__ = [
  "BACKWARD",
  "FORWARD",
  "INPUT",
  "INPUT_GRADIENT",
  "REGISTRY",
  "SCHEDULES",
  "STEP",
  "STREAMS",
  "SYNCHRONOUS",
  "WEIGHT",
  "WEIGHT_GRADIENT",
  "Action",
  "Move",
  "MoveKind",
  "ActionKind",
  "ActionLists",
  "Schedule",
  "ScheduleError",
  "ScheduleKind",
  "Stream",
  "Timeline",
  "Transfer",
  "async_1f1b",
  "build",
  "check_schedule",
  "chrome_trace",
  "custom_schedule",
  "eager_1f1b",
  "fusable_pairs",
  "gpipe",
  "interleaved",
  "issue_order",
  "lookup",
  "looped_bfs",
  "lower",
  "make_schedule",
  "one_f_one_b",
  "parse_actions",
  "place",
  "plot_timeline",
  "ready_time",
  "schedule_from_lists",
  "seq",
  "simulate",
  "two_bw",
  "write_chrome_trace",
  "zero_bubble_h1",
]
