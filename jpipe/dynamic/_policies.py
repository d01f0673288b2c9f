"""DynPipe's re-partitioning policies: after a measured window, whether
and where to move the split.

A policy reads the controller (``DynamicPipeline``: the split in force,
the calibrated node times, the slowdown models, the step-time predictions
and the measured switch costs) and the window; it returns a ``Decision``
or None. ``make_policy(name, ...)`` builds one by name (``POLICIES``); the
rules themselves are in the controller's module docstring.
"""

import dataclasses
import json

import numpy as np

from jpipe.dynamic._replan import dynpipe_split
from jpipe.dynamic._trigger import Trigger, clamped_ratios

POLICIES = ("jpipe", "dynpipe", "static")


@dataclasses.dataclass(frozen=True)
class Decision:
  """A re-partition to make.

  Attributes:
    boundaries: the new split (node index where each stage starts, and
      the end).
    sigma: per stage slot, the slowdown the split was solved for.
    old_seconds, new_seconds: predicted seconds per call of the split in
      force and of the new one.
    expected_sigma: per slot of the new split, the slowdown it should show
      (the forest's prediction, or the measured one).
  """

  boundaries: tuple[int, ...]
  sigma: tuple[float, ...]
  old_seconds: float
  new_seconds: float
  expected_sigma: tuple[float, ...]

  @classmethod
  def of(cls, boundaries, sigma, old_seconds, new_seconds, expected):
    """From arrays and numpy scalars (as the planners return them)."""
    return cls(
      tuple(int(b) for b in boundaries),
      tuple(float(x) for x in sigma),
      float(old_seconds),
      float(new_seconds),
      tuple(float(x) for x in expected),
    )

  def to_json(self) -> str:
    return json.dumps(dataclasses.astuple(self))

  @classmethod
  def from_json(cls, text: str) -> "Decision | None":
    """The decision ``to_json`` wrote, or None for "null"."""
    data = json.loads(text)
    return None if data is None else cls.of(*data)


class Policy:
  """A policy that never moves the split ("static": the baseline)."""

  name = "static"

  def decide(self, pipe, window) -> Decision | None:
    """The re-partition ``window`` asks for, or None."""
    del pipe, window
    return None

  def switched(self) -> None:
    """The split changed by a decision: what was measured on the old one
    no longer applies."""


class JpipePolicy(Policy):
  """jpipe's rule: the exact min-max split for the mean slowdowns of two
  windows in a row that changed the same slots, switched to when the
  simulator's predicted gain over ``horizon_steps`` pays for the switch."""

  name = "jpipe"

  def __init__(self, high: float, low: float):
    self.high, self.low = high, low
    # The last window's (changed slots, clamped sigmas, stage seconds).
    self._last = None

  def decide(self, pipe, window) -> Decision | None:
    sigma = np.asarray(window.sigma)
    # As DynPipe, slowdowns between the thresholds count as none (a small
    # stage's unslowed dispatch reads as up to ~1.5x). A slot entering or
    # leaving the slowed state, or a slowed slot moving by the trigger's
    # factor, asks for a new split.
    factors = clamped_ratios(sigma, np.ones_like(sigma), self.high, self.low)
    state_changed = (factors == 1.0) != (pipe.assumed == 1.0)
    ratio = factors / pipe.assumed
    changed = state_changed | (ratio >= self.high) | (ratio <= self.low)
    # One profiled step is a noisy sample (a pause reads as a slowdown):
    # act when two windows in a row show the same slots changed, on their
    # mean.
    seen = self._last
    self._last = (changed, factors, np.asarray(window.stage_seconds))
    if not np.any(changed) or seen is None or np.any(seen[0] != changed):
      return None
    sigma = clamped_ratios(
      (seen[1] + factors) / 2, np.ones_like(factors), self.high, self.low
    )
    new, expected = pipe.best_split(sigma)
    if new == pipe.boundaries:
      return None
    # The split in force is scored on what it measured (the two windows'
    # stage times), the candidate on the calibrated node times: a model
    # error on the split in force (a stage's fixed cost spread over its
    # nodes) no longer hides the gain of a move.
    old_t = pipe.predict_measured((seen[2] + self._last[2]) / 2)
    new_t = pipe.predict(new, expected)
    if (old_t - new_t) * pipe.horizon_steps <= pipe.switch_cost(new):
      return None
    return Decision.of(new, sigma, old_t, new_t, expected)

  def switched(self) -> None:
    self._last = None


class DynpipePolicy(Policy):
  """DynPipe's own rule: its trigger on stage times against a reference
  window (re-taken after every switch, as DynPipe restarts), the best of
  its top-k candidate cuts by its 1F1B score, switched to whenever it
  differs."""

  name = "dynpipe"

  def __init__(self, high: float, low: float, warmup_windows: int, top_k: int):
    self.high, self.low, self.top_k = high, low, top_k
    self.trigger = Trigger(high, low, warmup_windows)

  def decide(self, pipe, window) -> Decision | None:
    if self.trigger.add(window.stage_seconds) is None:
      return None
    sigma = np.asarray(window.sigma)
    factors = clamped_ratios(sigma, np.ones_like(sigma), self.high, self.low)
    slowdowns = pipe.slowdowns_of(factors)
    current = pipe.boundaries
    new, _ = dynpipe_split(
      pipe.forward,
      pipe.backward,
      current,
      pipe.on_replicas(factors if pipe.predictor is None else slowdowns),
      top_k=self.top_k,
    )
    if new == current:
      return None
    expected = slowdowns(new)
    return Decision.of(
      new,
      factors,
      pipe.predict(current, factors),
      pipe.predict(new, expected),
      expected,
    )

  def switched(self) -> None:
    self.trigger.rebase()


def make_policy(
  name: str, *, high: float, low: float, warmup_windows: int, top_k: int
) -> Policy:
  """The policy called ``name`` (one of ``POLICIES``)."""
  if name == "jpipe":
    return JpipePolicy(high, low)
  if name == "dynpipe":
    return DynpipePolicy(high, low, warmup_windows, top_k)
  if name == "static":
    return Policy()
  raise ValueError(f"unknown policy {name!r}: one of {POLICIES}")
