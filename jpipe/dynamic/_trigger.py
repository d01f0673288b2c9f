"""DynPipe's trigger: a stage's time per window against its reference.

DynPipe sums each stage's forward and backward time over windows of 50
iterations; the window ending at iteration 100 is the reference. For each
later window ``ratio = window / reference`` per stage; any ratio >= 2 or
<= 0.5 triggers a re-partition, and ratios in between count as 1 (its
``profiles`` vector). Here the window length, warm-up and thresholds are
arguments; the times are whatever the caller measured per window.
"""

import dataclasses
from collections.abc import Sequence

import numpy as np


def clamped_ratios(
  window: Sequence[float],
  reference: Sequence[float],
  high: float = 2.0,
  low: float = 0.5,
) -> np.ndarray:
  """Per stage, window / reference, with ratios strictly between ``low``
  and ``high`` set to 1 (DynPipe's ``profiles``)."""
  ratios = np.asarray(window, np.float64) / np.asarray(reference, np.float64)
  return np.where((ratios > low) & (ratios < high), 1.0, ratios)


def triggers(ratios: Sequence[float], high=2.0, low=0.5) -> bool:
  """Whether any stage's ratio is >= ``high`` or <= ``low``."""
  r = np.asarray(ratios, np.float64)
  return bool(np.any((r >= high) | (r <= low)))


@dataclasses.dataclass
class Trigger:
  """Windows of per-stage times; the first after warm-up is the reference.

  ``add(stage_seconds)`` takes one window's per-stage times (seconds)
  and returns the clamped ratios when they trigger, else None.
  ``rebase()`` makes the next window the new reference (after a
  re-partition the stages hold other layers).

  Args:
    high, low: DynPipe's thresholds (2 and 0.5).
    warmup_windows: windows ignored at the start and after a rebase
      (compilation, a cold stream).
  """

  high: float = 2.0
  low: float = 0.5
  warmup_windows: int = 1
  reference: np.ndarray | None = None
  _skip: int = dataclasses.field(default=-1, repr=False)

  def __post_init__(self):
    if not self.low < 1.0 < self.high:
      raise ValueError(
        f"thresholds need low < 1 < high, got low={self.low}, high={self.high}"
      )
    if self._skip < 0:
      self._skip = self.warmup_windows

  def add(self, stage_seconds: Sequence[float]) -> np.ndarray | None:
    times = np.asarray(stage_seconds, np.float64)
    if self._skip > 0:
      self._skip -= 1
      return None
    if self.reference is None:
      if np.any(times <= 0):
        raise ValueError(f"reference stage times must be > 0, got {times}")
      self.reference = times
      return None
    if times.shape != self.reference.shape:
      raise ValueError(
        f"{times.shape[0]} stage times for {self.reference.shape[0]} stages"
      )
    ratios = clamped_ratios(times, self.reference, self.high, self.low)
    return ratios if triggers(ratios, self.high, self.low) else None

  def rebase(self) -> None:
    self.reference = None
    self._skip = self.warmup_windows
