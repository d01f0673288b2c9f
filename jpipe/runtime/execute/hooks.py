"""What a layer above may run around a driver's actions."""

from typing import Any

from jpipe import schedule as schedule_lib


class DriverHooks:
  """What a layer above may do around a driver's actions; these defaults
  do nothing. Several pipelines in data parallel (``jpipe.parallel``)
  synchronise replicas of a stage and inject simulated delays here. A
  driver calls them only for the stages its process runs.
  """

  def before_compute(self, action: schedule_lib.Action, inputs=()) -> None:
    """Before a forward or backward (or I, W) is dispatched, with the
    values its program reads (``inputs``: a pytree of arrays, some still
    arriving from other devices; empty for a backward that ran fused
    with its forward)."""

  def reduce_gradient(self, stage: int, grads: Any) -> Any:
    """A stage's gradient (packed accumulator or leaves) before its step:
    returns the gradient the step applies."""
    return grads

  def after_step(self, stage: int, params: tuple) -> tuple:
    """A stage's params after its step: returns the params it keeps."""
    return params
