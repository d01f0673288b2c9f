"""Per-stage seconds per microbatch from one profiled step.

A stage's time is the sum of its forward and backward actions' measured
durations (an action's start waits for its inputs, so waiting is not
counted) plus what ``Interference`` slept for it (in one process the
host thread sleeps, so the device itself looks idle), over the
microbatches it ran forward. Across processes each process times its own
stages and the result is gathered, so every process gets every stage.
"""

import jax
import numpy as np

from jpipe import distributed


def stage_seconds_per_microbatch(
  timeline, slept: dict[int, float], num_stages: int
) -> np.ndarray:
  """Per stage, seconds per microbatch, float64 [num_stages].

  Args:
    timeline: the profiled step's ``Timeline`` (``Pipeline.step(...,
      profile=True)``).
    slept: per stage, seconds slept for it during the step
      (``Interference.take_slept``).
    num_stages: stages of the plan the step ran.
  """
  busy = np.zeros(num_stages)
  micro = np.zeros(num_stages)
  for action, end in timeline.end.items():
    if action.kind == "S":
      continue
    busy[action.stage] += end - timeline.start[action]
    if action.kind == "F":
      micro[action.stage] += 1
  for s, t in slept.items():
    busy[s] += t
  if jax.process_count() > 1:
    both = distributed.arrays_everywhere(
      "stage seconds", np.stack([busy, micro])
    )
    busy, micro = both.sum(axis=0)
  return busy / np.maximum(micro, 1)
