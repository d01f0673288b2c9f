"""Zero-bubble schedules: the backward split into I and W, W filling bubbles.

Qi et al., "Zero Bubble Pipeline Parallelism" (ICLR 2024): a stage's
backward is two computations, the input gradient I (which the previous
stage waits for: it is on the critical path) and the weight gradient W
(which nothing downstream waits for). Deferring W to where a device
would otherwise wait removes most of 1F1B's bubble.
"""

from jpipe.schedule._schedule import (
  FORWARD,
  INPUT,
  STEP,
  WEIGHT,
  Action,
  Schedule,
  make_schedule,
)


def zero_bubble_h1(num_stages: int, num_microbatches: int) -> Schedule:
  """ZB-H1 (the paper's handcrafted schedule at 1F1B's peak memory).

  Stage s runs 1F1B's order with each backward split into I then W, and
  keeps its last ``s`` weight gradients deferred: after I(i) it runs
  W(i - s). The later a stage, the longer its cool-down waits for the
  earlier stages' input gradients, and the deferred W's fill that wait.
  Stage s then holds at most ``n`` microbatches between F and W (1F1B:
  ``n - s``): every device at 1F1B's peak, stage 0's. With equal F, I
  and W costs the bubble is ``(n - 1)(F + I - W)``, a third of 1F1B's
  ``(n - 1)(F + I + W)``. Synchronous: one step per stage at the end.
  """
  if num_stages < 1 or num_microbatches < 1:
    raise ValueError(
      f"need >= 1 stage and microbatch, got {num_stages} stages and "
      f"{num_microbatches} microbatches"
    )
  n, m = num_stages, num_microbatches
  lists = []
  for s in range(n):
    warm = min(n - 1 - s, m)
    actions = [Action(FORWARD, s, b) for b in range(warm)]
    weights = iter(range(m))
    for i in range(m):
      if warm + i < m:
        actions.append(Action(FORWARD, s, warm + i))
      actions.append(Action(INPUT, s, i))
      if i >= s:  # Keep s weight gradients deferred.
        actions.append(Action(WEIGHT, s, next(weights)))
    actions += [Action(WEIGHT, s, b) for b in weights]
    actions.append(Action(STEP, s, m - 1))
    lists.append(actions)
  return make_schedule("zbh1", lists, list(range(n)), m)
