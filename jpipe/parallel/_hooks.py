"""One pipeline's hooks into its driver: delays and replica sync."""

import time

from jpipe.parallel._hetero import Heterogeneity
from jpipe.runtime import DriverHooks


class ReplicaHooks(DriverHooks):
  """Pipeline ``rank``'s side of a sync policy, plus simulated delays.

  Made before its pipeline (``Pipeline(hooks=...)``) and ``bind``-ed to
  the policy once the plan, which the first pipeline solves, is known;
  nothing runs in between.

  Args:
    rank: the pipeline's index.
    hetero: the delays (``Heterogeneity``).
  """

  def __init__(self, rank, hetero: Heterogeneity):
    self.rank = rank
    self.hetero = hetero
    self.policy = None
    self.draining = False
    self.delayed_seconds = 0.0

  def bind(self, policy, stage_devices) -> None:
    """The shared ``SyncPolicy``, and per stage the index of its device
    among all pipelines' devices (the delays are per device)."""
    self.policy = policy
    self.stage_devices = tuple(stage_devices)
    self.last = len(stage_devices) - 1
    self.steps = [0] * len(stage_devices)  # per stage, steps taken
    self.computes = [0] * len(stage_devices)  # per stage, F and B run

  def before_compute(self, action, inputs=()):
    s = action.stage
    index, self.computes[s] = self.computes[s], self.computes[s] + 1
    if self.hetero.active:
      seconds = self.hetero.delay(self.stage_devices[s], index)
      if seconds > 0:
        time.sleep(seconds)
        self.delayed_seconds += seconds

  def reduce_gradient(self, stage, grads):
    return self.policy.gradient(
      self.rank, stage, self.steps[stage], grads, self.draining
    )

  def after_step(self, stage, params):
    step = self.steps[stage]
    params = self.policy.params(self.rank, stage, step, params, self.draining)
    if stage == self.last and not self.draining:
      self.policy.last_stage_step(self.rank, step)
    self.steps[stage] += 1
    return params
