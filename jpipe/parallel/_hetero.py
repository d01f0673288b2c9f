"""Simulated heterogeneity: seeded delays before a device's work.

SD-Pipe's ``--hetero h``: before every scheduled forward or backward, with
probability 0.1, the device's work is delayed by ``h`` seconds. Beside it,
fixed per-device slowdowns: a device with factor f spends f times the
simulated compute time ``base_seconds`` on each forward or backward
(factor 1 where none is given). Whether a given action is delayed depends
only on the seed, the device and the action's index on that device --
never on thread timing -- so a run's delays repeat exactly. The delays
are ``jpipe.runtime``'s simulated slowdowns (``DeviceSlowdowns``), the
mechanism DynPipe's injected interference uses too.
"""

import dataclasses
import functools

from jpipe.runtime import (
  RANDOM_DELAY_PROBABILITY,
  DeviceSlowdowns,
  Slowdown,
  parse_slowdowns,
)

HETERO_PROBABILITY = RANDOM_DELAY_PROBABILITY


@dataclasses.dataclass(frozen=True)
class Heterogeneity:
  """Delays per device.

  Attributes:
    hetero: seconds of a random delay (SD-Pipe's ``h``; 0: none).
    slowdown: ``{device index: factor}`` (factor >= 1).
    base_seconds: simulated compute seconds of every forward and backward
      on a device of factor 1 (0: none).
    seed: seeds the random delays.
    probability: of a random delay, per action.
  """

  hetero: float = 0.0
  slowdown: dict = dataclasses.field(default_factory=dict)
  base_seconds: float = 0.0
  seed: int = 0
  probability: float = HETERO_PROBABILITY

  def __post_init__(self):
    if self.hetero < 0 or self.base_seconds < 0:
      raise ValueError(
        f"hetero ({self.hetero}) and base_seconds ({self.base_seconds}) "
        "are seconds: use values >= 0"
      )
    for device, factor in self.slowdown.items():
      if factor < 1:
        raise ValueError(
          f"slowdown factor {factor} of device {device} is below 1: a "
          "factor says how many times slower a device is (e.g. 2.0)"
        )

  @property
  def active(self) -> bool:
    return self.hetero > 0 or self.base_seconds > 0

  @functools.cached_property
  def devices(self) -> DeviceSlowdowns:
    """The same delays as ``jpipe.runtime.DeviceSlowdowns``."""
    return DeviceSlowdowns(
      tuple(Slowdown(d, f) for d, f in sorted(self.slowdown.items())),
      random_seconds=self.hetero,
      probability=self.probability,
      seed=self.seed,
    )

  def delay(self, device: int, index: int) -> float:
    """Seconds before the ``index``-th forward or backward on ``device``."""
    devices = self.devices
    return self.base_seconds * devices.factor(device) + devices.random_delay(
      device, index
    )


def parse_slowdown(text: str) -> dict[int, float]:
  """``"DEVICE:FACTOR,..."`` (e.g. ``"3:2.0,5:1.5"``) as a dict."""
  return {s.device: s.factor for s in parse_slowdowns(text, steps=False)}
