"""Loss scaling for float16 activations: a static scale, or a dynamic one
that halves when a step's gradient overflows and doubles after a run of
finite steps (jmp's ``DynamicLossScale``, Megatron's and DeepSpeed's
dynamic scaler).

``Pipeline(loss_scale=...)`` takes a number (static), ``"dynamic"`` or a
``DynamicLossScale``; ``check_loss_scale`` turns it into what the
pipeline keeps. The dynamic scale's state (``LossScaleState``: Python
numbers, on the host) rides in the ``PipelineState`` and its state dict.
"""

import dataclasses
import math
from typing import NamedTuple


class LossScaleState(NamedTuple):
  """A dynamic loss scale between steps: the scale the next step uses,
  and how many finite steps in a row it has been used for."""

  scale: float
  good_steps: int


@dataclasses.dataclass(frozen=True)
class DynamicLossScale:
  """A loss scale that adjusts itself (synchronous schedules).

  A step whose gradient (over every stage) holds an inf or a NaN is
  skipped and the scale divided by ``factor`` (not below ``min_scale``);
  after ``growth_interval`` finite steps in a row it is multiplied by
  ``factor``. Defaults: jmp's (2**15, 2000 steps, 2, 1).

  Attributes:
    initial: the first step's scale.
    growth_interval: finite steps in a row before the scale grows.
    factor: what the scale is multiplied or divided by (> 1; a power of
      two keeps every scaling exact).
    min_scale: the scale never drops below it (> 0).
  """

  initial: float = 2.0**15
  growth_interval: int = 2000
  factor: float = 2.0
  min_scale: float = 1.0

  def __post_init__(self):
    _check_number("initial", self.initial)
    _check_number("min_scale", self.min_scale)
    if not (isinstance(self.factor, (int, float)) and self.factor > 1):
      raise ValueError(
        f"DynamicLossScale.factor must be a number > 1, got {self.factor!r}"
      )
    if not (
      isinstance(self.growth_interval, int) and self.growth_interval >= 1
    ):
      raise ValueError(
        "DynamicLossScale.growth_interval must be an int >= 1 (steps), got "
        f"{self.growth_interval!r}"
      )

  def start(self) -> LossScaleState:
    """The state before the first step."""
    return LossScaleState(float(self.initial), 0)

  def adjust(self, state: LossScaleState, finite: bool) -> LossScaleState:
    """The state after a step that used ``state.scale``: ``finite``
    whether its gradient was (else the step was skipped)."""
    if not finite:
      return LossScaleState(max(state.scale / self.factor, self.min_scale), 0)
    good = state.good_steps + 1
    if good >= self.growth_interval:
      return LossScaleState(state.scale * self.factor, 0)
    return LossScaleState(state.scale, good)


def check_loss_scale(loss_scale) -> "float | DynamicLossScale | None":
  """``Pipeline``'s ``loss_scale`` as the pipeline keeps it: a float
  (static), a ``DynamicLossScale`` (``"dynamic"``: the defaults'), or
  None (no scaling)."""
  if loss_scale is None or isinstance(loss_scale, DynamicLossScale):
    return loss_scale
  if loss_scale == "dynamic":
    return DynamicLossScale()
  _check_number("loss_scale", loss_scale)
  return float(loss_scale)


def _check_number(name: str, x) -> None:
  ok = (
    isinstance(x, (int, float)) and not isinstance(x, bool) and 0 < x < math.inf
  )
  if not ok:
    also = ", 'dynamic' or None" if name == "loss_scale" else ""
    raise ValueError(
      f"{name} must be a finite number > 0 (e.g. 2.0**12; a power of two "
      f"scales exactly){also}, got {x!r}"
    )


def state_dict_entry(state: LossScaleState) -> dict:
  """A state's entry in a pipeline's state dict."""
  return {"scale": float(state.scale), "good_steps": int(state.good_steps)}


def from_state_dict(entry) -> LossScaleState:
  """``state_dict_entry``'s inverse (host numbers or 0-d arrays)."""
  return LossScaleState(float(entry["scale"]), int(entry["good_steps"]))
