"""Injected interference: a device slowed by a factor from a step on.

``Interference`` is a ``DriverHooks``: before each forward or backward
it sleeps on behalf of the stage, so timings are sleep-dominated (honest
on a CPU) and the slowdown follows the layers a stage holds:

- with ``simulated_seconds`` > 0 (the whole model's forward + backward
  of one microbatch), every action sleeps its simulated compute: the
  stage's share of the model's cost times that, times its device's
  factor;
- without, only the extra of a slowed device sleeps: ``(factor - 1)``
  times the stage's share times ``model_seconds`` (what the model's
  forward + backward of a microbatch measured, set by the controller).

The factor of a device at a step comes from ``Slowdown``s ("DEVICE:FACTOR:
FROM_STEP[:TO_STEP]", as ``config.dynamic.inject``). What was slept, per
stage, is counted so the controller adds it to the stage's measured time
(in one process the host thread sleeps, so the device itself looks idle).
The slowdowns are ``jpipe.runtime``'s (``Slowdown``, ``DeviceSlowdowns``),
the mechanism SD-Pipe's simulated heterogeneity uses too.
"""

import threading
import time

from jpipe.runtime import (
  DeviceSlowdowns,
  DriverHooks,
  Slowdown,
  parse_slowdowns,
)


def parse_inject(text: str) -> tuple[Slowdown, ...]:
  """``"DEVICE:FACTOR:FROM_STEP[:TO_STEP],..."`` -> Slowdowns."""
  return parse_slowdowns(text, steps=True)


class Interference(DriverHooks):
  """Sleeps for simulated compute and injected slowdowns.

  Args:
    slowdowns: the injected ``Slowdown``s.
    simulated_seconds: seconds of the whole model's forward + backward
      per microbatch, slept by every action in proportion (0: none).

  The controller sets ``step`` before each call, ``stage_shares`` (per
  stage: its (forward, backward) share of the model's cost per
  microbatch, summing to 1 over all stages), ``stage_devices`` (per
  stage, its (first) device index) and ``stage_groups`` (per stage, all
  its devices: a replica group splits each microbatch, so its stage
  sleeps 1 / r of the time, at its slowest device's factor) for the plan
  in force, and ``model_seconds`` once measured. ``stage_rows`` (per
  stage: examples of a microbatch per replica, or None) marks a weighted
  group: its replicas run their slices in parallel, replica j sleeping
  ``rows[j] / n`` of the stage's time at its own device's factor, the
  stage as long as its slowest; each replica's own time is counted apart
  (``take_replica_slept``), which is how the controller sees its speed.
  """

  def __init__(self, slowdowns=(), simulated_seconds: float = 0.0):
    if simulated_seconds < 0:
      raise ValueError(
        f"simulated_seconds must be >= 0, got {simulated_seconds}"
      )
    self.slowdowns = tuple(slowdowns)  # (dynamic.collect swaps them.)
    self.simulated_seconds = simulated_seconds
    self.step = 0
    self.model_seconds = simulated_seconds or None
    self.stage_shares: tuple[tuple[float, float], ...] = ()
    self.stage_devices: tuple[int, ...] = ()
    self.stage_groups: tuple[tuple[int, ...], ...] = ()
    self.stage_rows: tuple = ()
    self._slept: dict[int, float] = {}
    self._replica_slept: dict[tuple[int, int], float] = {}
    self._lock = threading.Lock()

  def factor(self, device: int, step: int) -> float:
    """The product of the device's slowdowns active at ``step``."""
    return DeviceSlowdowns(self.slowdowns).factor(device, step)

  def before_compute(self, action, inputs=()):
    if not self.stage_shares or self.model_seconds is None:
      return  # Before the controller placed the plan or measured.
    s = action.stage
    forward, backward = self.stage_shares[s]
    # A split backward's I and W (zero-bubble) sleep half of it each.
    share = {"F": forward, "B": backward}.get(action.kind, backward / 2)
    group = (
      self.stage_groups[s] if self.stage_groups else (self.stage_devices[s],)
    )
    rows = self.stage_rows[s] if self.stage_rows else None
    # Each device its share of the examples at its own factor. SPMD (no
    # rows): equal shares, and the slowest device holds the others up.
    weights = rows or (1,) * len(group)
    own = [
      self._extra(d) * share * self.model_seconds * r / sum(weights)
      for d, r in zip(group, weights, strict=True)
    ]
    if rows is None:
      own = [max(own)] * len(own)
    seconds = max(own)
    if seconds > 0:
      time.sleep(seconds)
      with self._lock:
        self._slept[s] = self._slept.get(s, 0.0) + seconds
        for j, t in enumerate(own):
          key = (s, j)
          self._replica_slept[key] = self._replica_slept.get(key, 0.0) + t

  def _extra(self, device) -> float:
    """What a device sleeps per second of its simulated share: its whole
    simulated time, or only a slowdown's extra over real compute."""
    factor = self.factor(device, self.step)
    return factor if self.simulated_seconds > 0 else factor - 1.0

  def take_replica_slept(self) -> dict[tuple[int, int], float]:
    """Per (stage, replica), seconds its own slice slept since the last
    call (and resets); a stage of one device is its replica 0."""
    with self._lock:
      out, self._replica_slept = self._replica_slept, {}
    return out

  def take_slept(self) -> dict[int, float]:
    """Per stage, seconds slept since the last call (and resets)."""
    with self._lock:
      out, self._slept = self._slept, {}
    return out
