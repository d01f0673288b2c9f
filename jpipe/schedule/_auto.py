"""``schedule="auto"``: every candidate schedule simulated on one plan's
costs, ranked by step time among those that fit the memory limit.

A pure function of numbers: the stages' devices, the microbatch count,
each stage's F, I and W seconds and the transfer time of each cut
(``StageCosts``), and each stage's bytes split into what it holds all
along, what each microbatch in flight keeps and one program's working
buffers (``StageMemoryTerms``, from the partitioner's memory model).
For each candidate its action lists on those devices are built (a
candidate that cannot run there -- a V schedule off the V, the loop
schedule off the loop -- is skipped with the builder's reason), run
through the event simulator for the step time and bubble, and walked
action by action for each device's peak bytes: its stages' fixed bytes,
the most bytes its microbatches keep at once (from a forward to its
backward, B or I; from I to W what the weight gradients read), and its
largest working buffer once. The fastest that fits wins; equal times go
to the smaller peak. Only synchronous schedules are candidates: a stream
(``async``, ``2bw``) trains with stale weights, another computation.
"""

import dataclasses
from collections.abc import Sequence

import numpy as np

from jpipe.schedule._registry import REGISTRY, SYNCHRONOUS, ScheduleKind
from jpipe.schedule._schedule import BACKWARD, FORWARD, INPUT, WEIGHT
from jpipe.schedule._simulate import simulate

AUTO = "auto"


class NoScheduleFits(ValueError):
  """No candidate schedule fits the memory limit (names the smallest)."""


@dataclasses.dataclass(frozen=True)
class StageCosts:
  """Seconds per microbatch, per stage [S]; transfers per cut [S - 1].

  Attributes:
    forward, backward: F and B (B = I + W).
    input: I, the input-gradient half of a split backward (W = B - I);
      None: half of B.
    comm: seconds an activation (or its gradient) takes across the cut
      after stage s (between s and s + 1) when they are on different
      devices; empty: free transfers.
  """

  forward: tuple[float, ...]
  backward: tuple[float, ...]
  input: tuple[float, ...] | None = None
  comm: tuple[float, ...] = ()


@dataclasses.dataclass(frozen=True)
class StageMemoryTerms:
  """Bytes per stage [S]: ``fixed`` held all along (params, gradients,
  optimizer state), ``kept`` per microbatch between its forward and its
  backward (B, or I where it splits), ``working`` one program's buffers
  (a device counts its stages' largest once: it runs one program at a
  time), ``weight_kept`` per microbatch between a split backward's I and
  its W (what the weight gradients read: each layer's input and output
  gradient; None: ``kept``)."""

  fixed: tuple[float, ...]
  kept: tuple[float, ...]
  working: tuple[float, ...]
  weight_kept: tuple[float, ...] | None = None


@dataclasses.dataclass(frozen=True)
class ScheduleRow:
  """One candidate's prediction: ``step_seconds`` (the simulated makespan
  of one step), ``bubble`` (idle fraction), ``device_bytes`` (peak per
  schedule device), ``fits`` (every device within the limit)."""

  name: str
  step_seconds: float
  bubble: float
  device_bytes: tuple[float, ...]
  fits: bool

  @property
  def peak_bytes(self) -> float:
    return max(self.device_bytes)

  @property
  def peak_device(self) -> int:
    return int(np.argmax(self.device_bytes))


@dataclasses.dataclass(frozen=True)
class ScheduleChoice:
  """The ranked table (fitting rows first, fastest first), the chosen
  name, the limit (bytes per device, or None), why the candidates not
  in the table were left out, the schedule devices' names (None:
  "device d"), and the fitting rows a built pipeline's own prediction
  then put over the limit (``jpipe.Pipeline`` moves down the table past
  them)."""

  rows: tuple[ScheduleRow, ...]
  chosen: str
  limit: float | None
  skipped: tuple[tuple[str, str], ...] = ()
  device_names: tuple[str, ...] | None = None
  over_when_built: tuple[str, ...] = ()

  def moved_to(self, name: str, over: Sequence[str]) -> "ScheduleChoice":
    """This choice with ``name`` chosen instead, the rows ``over`` found
    over the limit by the built pipeline's own (finer) prediction."""
    return dataclasses.replace(self, chosen=name, over_when_built=tuple(over))

  def to_dict(self, device_names: Sequence[str] | None = None) -> dict:
    """A JSON-ready record (``plan.json``'s ``schedule_choice``)."""
    name = _namer(device_names or self.device_names)
    return {
      "chosen": self.chosen,
      "memory_limit": self.limit,
      "rows": [
        {
          "schedule": r.name,
          "step_seconds": r.step_seconds,
          "bubble": r.bubble,
          "peak_bytes": r.peak_bytes,
          "peak_device": name(r.peak_device),
          "device_bytes": list(r.device_bytes),
          "fits": r.fits,
        }
        for r in self.rows
      ],
      "skipped": dict(self.skipped),
      "over_when_built": list(self.over_when_built),
    }

  def table(self, device_names: Sequence[str] | None = None) -> list[str]:
    """The table as printed lines."""
    name = _namer(device_names or self.device_names)
    lines = [
      f"schedule=auto chose {self.chosen!r} from (limit "
      + ("none" if self.limit is None else size(self.limit))
      + "):",
      f"  {'schedule':<15}{'step':>10}{'bubble':>8}  peak memory",
    ]
    for r in self.rows:
      lines.append(
        f"  {r.name:<15}{duration(r.step_seconds):>10}{r.bubble:>8.3f}  "
        f"{size(r.peak_bytes)} on {name(r.peak_device)}"
        + ("" if r.fits else "  (over the limit)")
        + (
          "  (over the limit as built)"
          if r.name in self.over_when_built
          else ""
        )
        + ("  <- chosen" if r.name == self.chosen else "")
      )
    if self.skipped:
      lines.append(
        "  not applicable: "
        + "; ".join(f"{n} ({why})" for n, why in self.skipped)
      )
    return lines


def duration(seconds: float) -> str:
  """Seconds in s, ms or us, 4 significant digits."""
  for scale, unit in ((1.0, "s"), (1e-3, "ms")):
    if seconds >= scale:
      return f"{seconds / scale:.4g} {unit}"
  return f"{seconds / 1e-6:.4g} us"


def size(n: float) -> str:
  """Bytes in GiB, or a smaller binary unit below one GiB."""
  for power, unit in ((3, "GiB"), (2, "MiB"), (1, "KiB")):
    if abs(n) >= 1024**power:
      return f"{n / 1024**power:.2f} {unit}"
  return f"{n:.0f} B"


def _namer(device_names):
  if device_names is None:
    return lambda d: f"device {d}"
  return lambda d: device_names[d]


def candidates() -> tuple[ScheduleKind, ...]:
  """The built-in synchronous schedules, in the registry's order."""
  return tuple(REGISTRY[n] for n in SYNCHRONOUS if REGISTRY[n].written is None)


def rank_schedules(
  kinds: Sequence[ScheduleKind],
  stage_device: Sequence[int],
  num_microbatches: int,
  costs: StageCosts,
  memory: StageMemoryTerms,
  limit: float | None = None,
  *,
  fused_last: bool = False,
  device_names: Sequence[str] | None = None,
) -> ScheduleChoice:
  """Every applicable schedule of ``kinds`` simulated and ranked.

  Args:
    kinds: the candidates (``candidates()``; streams are refused).
    stage_device: schedule device of each stage (0..k-1, all used).
    num_microbatches: microbatches per step.
    costs: the stages' seconds and the cuts' transfer times.
    memory: the stages' bytes.
    limit: bytes per device, or None (every candidate fits).
    fused_last: the last stage runs each microbatch's backward with its
      forward where its backward is not split (keeps nothing in flight).
    device_names: each schedule device's name in the table and errors
      (None: "device d").

  Returns:
    The choice: the fastest that fits (equal times: the smaller peak).

  Raises:
    NoScheduleFits: none fits ``limit`` (the smallest need named).
  """
  stage_device = [int(d) for d in stage_device]
  _check_lengths(len(stage_device), costs, memory)
  rows, skipped, seen = [], [], {}
  for kind in kinds:
    if kind.asynchronous:
      raise ValueError(
        f"schedule {kind.name!r} streams (stale weights): auto chooses "
        "among synchronous schedules only"
      )
    if kind.placement is not None and kind.stage_devices(
      len(stage_device)
    ) != tuple(stage_device):
      skipped.append(
        (kind.name, "needs its own placement: 2 stages per device in a V")
      )
      continue
    try:
      lists = kind.on_devices(stage_device, num_microbatches)
      timeline = _simulate(lists, costs)
    except ValueError as e:
      skipped.append((kind.name, str(e).split(":")[0]))
      continue
    same = seen.setdefault(lists.device_actions, kind.name)
    if same != kind.name:  # (One stage per device: interleaved is 1f1b.)
      skipped.append((kind.name, f"the same lists as {same}"))
      continue
    held = device_peak_bytes(lists, memory, fused_last)
    fits = limit is None or max(held) <= limit
    rows.append(
      ScheduleRow(kind.name, timeline.makespan, timeline.bubble, held, fits)
    )
  if not rows:
    raise ValueError(
      "schedule='auto': no synchronous schedule runs on this placement: "
      + "; ".join(f"{n}: {why}" for n, why in skipped)
    )
  order = {r.name: i for i, r in enumerate(rows)}
  rows.sort(
    key=lambda r: (
      not r.fits,
      _rounded(r.step_seconds),
      r.peak_bytes,
      order[r.name],
    )
  )
  names = None if device_names is None else tuple(device_names)
  if not rows[0].fits:
    least = min(rows, key=lambda r: r.peak_bytes)
    where = _namer(names)(least.peak_device)
    raise NoScheduleFits(
      f"schedule='auto': no schedule fits the memory limit of "
      f"{size(limit)} per device; the smallest need is {least.name!r} at "
      f"{size(least.peak_bytes)} ({where}): raise the limit, or use more "
      "stages, recomputation or more microbatches"
    )
  return ScheduleChoice(tuple(rows), rows[0].name, limit, tuple(skipped), names)


def _rounded(seconds: float) -> float:
  """Step times equal to 9 digits count as a tie (float sums differ)."""
  return float(f"{seconds:.9g}")


def _check_lengths(n, costs: StageCosts, memory: StageMemoryTerms) -> None:
  """Every per-stage field has n entries, ``comm`` n - 1 (or none)."""
  fields = {
    "costs.forward": costs.forward,
    "costs.backward": costs.backward,
    "costs.input": costs.input or [0] * n,
    "memory.fixed": memory.fixed,
    "memory.kept": memory.kept,
    "memory.working": memory.working,
    "memory.weight_kept": memory.weight_kept or [0] * n,
  }
  for name, values in fields.items():
    if len(values) != n:
      raise ValueError(f"{name} has {len(values)} entries for {n} stages")
  if len(costs.comm) not in (0, n - 1):
    raise ValueError(
      f"costs.comm has {len(costs.comm)} entries: one per cut ({n - 1})"
    )


def _simulate(lists, costs: StageCosts):
  """The event simulation of ``lists`` at ``costs``."""
  return simulate(
    lists,
    list(costs.forward),
    list(costs.backward),
    comm_seconds=list(costs.comm) if len(costs.comm) else 0.0,
    input_seconds=None if costs.input is None else list(costs.input),
  )


def device_peak_bytes(
  lists, memory: StageMemoryTerms, fused_last: bool = False
) -> tuple[float, ...]:
  """Per schedule device: its stages' fixed bytes, the most bytes its
  microbatches keep at once in its action order (``kept`` from F to B or
  I, ``weight_kept`` from I to W), and its stages' largest working
  buffer."""
  n = lists.num_stages
  kept = np.array(memory.kept, np.float64)
  weight_kept = kept if memory.weight_kept is None else memory.weight_kept
  last = lists.device_actions[lists.stage_device[n - 1]]
  if fused_last and not any(a.kind == INPUT and a.stage == n - 1 for a in last):
    kept[n - 1] = 0.0  # Its backward runs in its forward's program.
  change = {
    FORWARD: lambda s: kept[s],
    BACKWARD: lambda s: -kept[s],
    INPUT: lambda s: weight_kept[s] - kept[s],
    WEIGHT: lambda s: -weight_kept[s],
  }
  out = []
  for d, actions in enumerate(lists.device_actions):
    stages = [s for s in range(n) if lists.stage_device[s] == d]
    held = peak = 0.0
    for a in actions:
      held += change[a.kind](a.stage) if a.kind in change else 0.0
      peak = max(peak, held)
    fixed = sum(memory.fixed[s] for s in stages)
    working = max((memory.working[s] for s in stages), default=0.0)
    out.append(float(fixed + peak + working))
  return tuple(out)
