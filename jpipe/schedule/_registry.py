"""Every schedule jpipe runs, in one table.

A ``ScheduleKind`` says what a schedule is: its name, whether it streams
across calls (``async``, ``2bw``: no flush at the end of a call) or
flushes (the synchronous ones, equal to single-device accumulation), a
line for help texts, and how to build one call's action lists on given
devices. ``jpipe.Pipeline(schedule=...)``, the CLI's checks, the memory
prediction and the docs read their names from here (``SCHEDULES``,
``SYNCHRONOUS``, ``STREAMS``).
"""

import dataclasses
from collections.abc import Callable, Sequence

from jpipe.schedule import _builders, _zero_bubble
from jpipe.schedule._order import place
from jpipe.schedule._schedule import Schedule, make_schedule


@dataclasses.dataclass(frozen=True)
class ScheduleKind:
  """One schedule.

  Attributes:
    name: what users write (``schedule="1f1b"``).
    asynchronous: streams across calls (stale weights; no flush per call).
    summary: one line for help texts.
    builder: ``builder(num_stages, num_microbatches, **kwargs)`` -> one
      call (a stream: one window and a flush) with stage s on device s.
    places_itself: the builder takes the stages' devices
      (``builder(stage_device, num_microbatches)``), as ``interleaved``
      does: several stages per device, ordered together.
    written: a user's schedule (``custom_schedule``): the lists it runs,
      for the stages, devices and microbatches they were written for.
    placement: ``placement(p)`` -> the device of every stage on p
      devices, where the schedule fixes it (``zbv``, ``dualpipev``: 2p
      stages in a V); the pipeline then cuts that many stages and places
      them so. None: any placement.
    unlooped: for a loop schedule -- given more stages than devices,
      stage s goes on device ``s mod p`` (Megatron's virtual stages:
      ``interleaved``, ``interleaved_zb``, ``looped_bfs``), the stage
      count a multiple of the devices -- the schedule whose order it
      runs with one stage a device (``1f1b``, ``zbh1``, ``gpipe``). None:
      not a loop.
    stale: a backward may differentiate at newer params than its
      forward's (PipeDream's ``async``): the staleness mitigations
      (stashing, prediction, Gap-Aware, delay corrections) apply.
    two_versions: PipeDream-2BW's double-buffered weights: forwards read
      the version before the last step, and a step applies a whole
      minibatch (``step_every`` > 1 required).

  A streaming kind (``asynchronous``) steps every ``step_every``
  microbatches and steps a short window at a flush its own way
  (``partial_window``); a synchronous one steps once per call.
  """

  name: str
  asynchronous: bool
  summary: str
  builder: Callable[..., Schedule]
  places_itself: bool = False
  written: Schedule | None = None
  placement: Callable[[int], tuple[int, ...]] | None = None
  unlooped: str | None = None
  stale: bool = False
  two_versions: bool = False

  @property
  def loops(self) -> bool:
    """A loop schedule (``unlooped``)."""
    return self.unlooped is not None

  def stage_devices(
    self, num_stages: int, num_devices: int | None = None
  ) -> tuple[int, ...] | None:
    """The device of each of ``num_stages`` stages where the schedule
    places them: ``placement`` on num_stages / 2 devices (a V), or, for a
    loop on ``num_devices`` devices fewer than the stages, stage s on
    device s mod p. None: it does not, or cannot place that many (an odd
    count in a V). A loop over a stage count that is not a multiple of
    the devices: ValueError."""
    if self.loops and num_devices is not None and num_stages > num_devices:
      if num_stages % num_devices:
        raise ValueError(
          f"schedule {self.name!r} loops stages over devices (stage s on "
          f"device s mod p): {num_stages} stages on {num_devices} devices "
          f"is uneven; use a multiple of {num_devices} stages"
        )
      return _builders.loop_placement(num_stages, num_devices)
    if self.placement is None or num_stages % 2:
      return None
    return tuple(self.placement(num_stages // 2))

  def on_devices(
    self, stage_device: Sequence[int], num_microbatches: int, **kwargs
  ) -> Schedule:
    """One call of ``num_microbatches`` with stage s on schedule device
    ``stage_device[s]`` (devices numbered from 0)."""
    stage_device = list(stage_device)
    if self.places_itself:
      return self.builder(stage_device, num_microbatches, **kwargs)
    n = len(stage_device)
    built = self.builder(n, num_microbatches, **kwargs)
    if stage_device == list(built.stage_device):
      return built
    per_stage = [
      [a for a in built.device_actions[built.stage_device[s]] if a.stage == s]
      for s in range(n)
    ]
    lists = place(built.name, per_stage, stage_device)
    return make_schedule(
      built.name, lists.device_actions, stage_device, num_microbatches
    )


REGISTRY: dict[str, ScheduleKind] = {
  k.name: k
  for k in (
    ScheduleKind(
      "seq",
      False,
      "naive model parallelism: one microbatch in flight",
      _builders.seq,
    ),
    ScheduleKind(
      "gpipe",
      False,
      "GPipe: all forwards, then all backwards, a flush",
      _builders.gpipe,
    ),
    ScheduleKind(
      "1f1b",
      False,
      "1F1B with a flush: stage s holds n - s microbatches",
      _builders.one_f_one_b,
    ),
    ScheduleKind(
      "eager1f1b",
      False,
      "1F1B with 2(n-1-s) warm-up forwards: sends overlap compute",
      _builders.eager_1f1b,
    ),
    ScheduleKind(
      "async",
      True,
      "PipeDream's asynchronous 1F1B without flushes (delay n - 1 - s)",
      _builders.async_1f1b,
      stale=True,
    ),
    ScheduleKind(
      "2bw",
      True,
      "PipeDream-2BW: two weight versions, a step per minibatch",
      _builders.two_bw,
      two_versions=True,
    ),
    ScheduleKind(
      "interleaved",
      False,
      "interleaved 1F1B (Megatron's virtual stages: stage s on device s "
      "mod p); other placements (mixed pipe): 1F1B by list scheduling",
      _builders.interleaved,
      places_itself=True,
      unlooped="1f1b",
    ),
    ScheduleKind(
      "looped_bfs",
      False,
      "breadth-first: a device's stages one after another, all microbatches",
      _builders.looped_bfs,
      places_itself=True,
      unlooped="gpipe",
    ),
    ScheduleKind(
      "zbh1",
      False,
      "zero-bubble ZB-H1: backward split into I and W, W fills bubbles",
      _zero_bubble.zero_bubble_h1,
    ),
    ScheduleKind(
      "zbh2",
      False,
      "zero-bubble ZB-H2: more warm-up forwards, no idle after the first "
      "forward (stage s holds 2(n - s) - 1)",
      _zero_bubble.zero_bubble_h2,
    ),
    ScheduleKind(
      "zbv",
      False,
      "zero-bubble ZB-V: 2 stages per device in a V, I and W split",
      _zero_bubble.zero_bubble_v,
      places_itself=True,
      placement=_zero_bubble.v_placement,
    ),
    ScheduleKind(
      "dualpipev",
      False,
      "DualPipeV: V placement, F of one stage paired with B of the other",
      _zero_bubble.dual_pipe_v,
      places_itself=True,
      placement=_zero_bubble.v_placement,
    ),
    ScheduleKind(
      "interleaved_zb",
      False,
      "interleaved zero bubble: Megatron's virtual stages (stage s on "
      "device s mod p), I and W split, W deferred",
      _zero_bubble.interleaved_zero_bubble,
      places_itself=True,
      unlooped="zbh1",
    ),
  )
}
SCHEDULES = tuple(REGISTRY)
SYNCHRONOUS = tuple(n for n, k in REGISTRY.items() if not k.asynchronous)
STREAMS = tuple(n for n, k in REGISTRY.items() if k.asynchronous)
# Where the staleness mitigations apply (``ScheduleKind.stale``).
STALE = tuple(n for n, k in REGISTRY.items() if k.stale)


def lookup(schedule: "str | ScheduleKind") -> ScheduleKind:
  """The registered kind of a name; a kind as it is (a built-in one, or
  a user's: ``custom_schedule``). Unknown: a one-line error naming the
  choices."""
  if isinstance(schedule, ScheduleKind):
    return schedule
  if schedule not in REGISTRY:
    raise ValueError(f"unknown schedule {schedule!r}: one of {SCHEDULES}")
  return REGISTRY[schedule]


def build(
  name: str, num_stages: int, num_microbatches: int, **kwargs
) -> Schedule:
  """A schedule by name (one of SCHEDULES) with stage s on device s (or
  where the schedule places its stages: ``zbv``'s V); kwargs go to the
  builder (``interleaved`` takes ``stage_device``)."""
  kind = lookup(name)
  default = kind.stage_devices(num_stages) or range(num_stages)
  stage_device = kwargs.pop("stage_device", list(default))
  if len(stage_device) != num_stages:
    raise ValueError(
      f"stage_device has {len(stage_device)} entries for {num_stages} stages"
    )
  if kind.places_itself:
    return kind.on_devices(stage_device, num_microbatches, **kwargs)
  return kind.builder(num_stages, num_microbatches, **kwargs)
