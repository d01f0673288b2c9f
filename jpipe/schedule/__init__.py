"""Pipeline schedules as data, and an event simulator for them."""

from jpipe.schedule._builders import (
  SCHEDULES,
  async_1f1b,
  build,
  gpipe,
  interleaved,
  one_f_one_b,
  seq,
  two_bw,
)
from jpipe.schedule._export import (
  chrome_trace,
  plot_timeline,
  write_chrome_trace,
)
from jpipe.schedule._schedule import (
  BACKWARD,
  FORWARD,
  STEP,
  Action,
  Schedule,
  make_schedule,
)
from jpipe.schedule._simulate import Timeline, simulate

__all__ = [
  "BACKWARD",
  "FORWARD",
  "SCHEDULES",
  "STEP",
  "Action",
  "Schedule",
  "Timeline",
  "async_1f1b",
  "build",
  "chrome_trace",
  "gpipe",
  "interleaved",
  "make_schedule",
  "one_f_one_b",
  "plot_timeline",
  "seq",
  "simulate",
  "two_bw",
  "write_chrome_trace",
]
