"""One pipeline's hooks into its driver: delays and replica sync."""

import time

from jpipe.parallel._hetero import Heterogeneity
from jpipe.runtime import DriverHooks


class ReplicaHooks(DriverHooks):
  """Pipeline ``rank``'s side of a sync policy, plus simulated delays.

  Args:
    rank: the pipeline's index.
    policy: the shared ``SyncPolicy``.
    hetero: the delays (``Heterogeneity``).
    stage_devices: per stage, the index of its device among all
      pipelines' devices (the delays are per device).
  """

  def __init__(self, rank, policy, hetero: Heterogeneity, stage_devices):
    self.rank = rank
    self.policy = policy
    self.hetero = hetero
    self.stage_devices = tuple(stage_devices)
    self.last = len(stage_devices) - 1
    self.steps = [0] * len(stage_devices)  # per stage, steps taken
    self.computes = [0] * len(stage_devices)  # per stage, F and B run
    self.draining = False
    self.delayed_seconds = 0.0

  def before_compute(self, action):
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
