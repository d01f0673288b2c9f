"""Simulated slow devices, one mechanism for every experiment that needs
them: SD-Pipe's heterogeneity (fixed per-device factors and seeded random
delays, ``jpipe.parallel.Heterogeneity``) and DynPipe's injected
interference (factors over a range of steps, ``jpipe.dynamic.Interference``).

A ``Slowdown`` makes one device ``factor`` times slower over a range of
steps; ``DeviceSlowdowns`` holds them with SD-Pipe's random delay and
answers the two questions the hooks ask before a forward or backward: how
many times slower is this device at this step, and is this action (the
``index``-th on its device) delayed? The answer depends only on the seed,
the device and the index -- never on thread timing -- so runs repeat.
"""

import dataclasses

import numpy as np

# SD-Pipe's --hetero: the chance that an action is delayed.
RANDOM_DELAY_PROBABILITY = 0.1


@dataclasses.dataclass(frozen=True)
class Slowdown:
  """Device ``device`` runs ``factor`` times slower from step ``start``
  (counting from 0) until before step ``end`` (None: to the end)."""

  device: int
  factor: float
  start: int = 0
  end: int | None = None

  def active(self, step: int) -> bool:
    return self.start <= step and (self.end is None or step < self.end)


@dataclasses.dataclass(frozen=True)
class DeviceSlowdowns:
  """Slowdowns by device and step, and a seeded random delay per action.

  Attributes:
    slowdowns: the ``Slowdown``s (several on one device multiply).
    random_seconds: seconds of a random delay (SD-Pipe's ``h``; 0: none).
    probability: of a random delay, per action.
    seed: seeds the random delays.
  """

  slowdowns: tuple[Slowdown, ...] = ()
  random_seconds: float = 0.0
  probability: float = RANDOM_DELAY_PROBABILITY
  seed: int = 0

  def factor(self, device: int, step: int = 0) -> float:
    """The product of the device's slowdowns active at ``step``."""
    out = 1.0
    for s in self.slowdowns:
      if s.device == device and s.active(step):
        out *= s.factor
    return out

  def random_delay(self, device: int, index: int) -> float:
    """Seconds of random delay before the ``index``-th forward or backward
    on ``device``."""
    if self.random_seconds <= 0:
      return 0.0
    u = np.random.default_rng((self.seed, device, index)).random()
    return self.random_seconds if u < self.probability else 0.0


def parse_slowdowns(text: str, *, steps: bool) -> tuple[Slowdown, ...]:
  """``Slowdown``s from ``"DEVICE:FACTOR,..."`` (``steps=False``: for
  the whole run, e.g. ``"3:2.0,5:1.5"``) or
  ``"DEVICE:FACTOR:FROM_STEP[:TO_STEP],..."`` (``steps=True``, e.g.
  ``"1:3.0:100:300"``)."""
  spelling = "DEVICE:FACTOR:FROM_STEP[:TO_STEP]" if steps else "DEVICE:FACTOR"
  example = (
    "'1:3.0:100:300' slows device 1 three times from step 100 to step 300"
    if steps
    else "'3:2.0' makes device 3 twice as slow"
  )
  out = []
  for part in (p.strip() for p in text.split(",") if p.strip()):
    fields = part.split(":")
    try:
      if len(fields) not in ((3, 4) if steps else (2,)):
        raise ValueError
      device, factor = int(fields[0]), float(fields[1])
      start = int(fields[2]) if steps else 0
      end = int(fields[3]) if len(fields) == 4 else None
    except ValueError:
      raise ValueError(
        f"bad slowdown {part!r}: write {spelling} (e.g. {example})"
      ) from None
    if (
      device < 0
      or factor <= 0
      or start < 0
      or (end is not None and end <= start)
    ):
      raise ValueError(
        f"bad slowdown {part!r}: needs DEVICE >= 0, FACTOR > 0 and "
        "0 <= FROM_STEP < TO_STEP"
      )
    out.append(Slowdown(device, factor, start, end))
  return tuple(out)
