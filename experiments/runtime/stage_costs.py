"""Per-stage action costs measured one action at a time, and the
simulated timeline of a run of calls with them.

Fake CPU devices share the host's cores, so an action timed while other
devices run is slowed by them; and a synchronous step's measured time also
holds its wait for the tied-gradient sum. For the event simulator each
stage's forward and backward are read from a profiled ``seq`` step (one
microbatch in flight: nothing else runs meanwhile) and each stage's
optimizer step (and, if asked, weight prediction) is timed alone.
"""

import functools
import time

import jax
import jax.numpy as jnp
import numpy as np

from jpipe import schedule as schedule_lib


def _median_seconds(fn, repeats=9) -> float:
  jax.block_until_ready(fn())  # compiled and warm
  times = []
  for _ in range(repeats):
    t0 = time.perf_counter()
    jax.block_until_ready(fn())
    times.append(time.perf_counter() - t0)
  return float(np.median(times))


def isolated_stage_costs(pipe, state, batches, predictor=None, delay=0):
  """Median seconds per stage: ``{"F": [...], "B": [...], "S": [...]}``.

  Args:
    pipe: a ``jpipe.Pipeline`` built with ``schedule="seq"`` and
      ``fuse_last_stage=False`` (so every forward and backward is its own
      action).
    state: its initialised state.
    batches: at least 3 batches for it (2 compile, the rest are
      profiled; the medians pool their actions).
    predictor: a ``jpipe.staleness`` predictor; with ``delay`` > 0 each
      forward is charged one prediction over ``delay`` steps.
    delay: the delay to predict over.
  """
  if pipe.schedule_name != "seq":
    raise ValueError(f"needs a seq pipeline, got {pipe.schedule_name!r}")
  for batch in batches[:2]:
    state, _ = pipe.step(state, batch)
  n = pipe.stages.num_stages
  per = {k: [[] for _ in range(n)] for k in "FB"}
  for batch in batches[2:]:  # Pooled over the profiled steps.
    state, metrics = pipe.step(state, batch, profile=True)
    timeline = metrics["timeline"]
    for action, start in timeline.start.items():
      if action.kind in per:
        per[action.kind][action.stage].append(timeline.end[action] - start)
  costs = {k: [float(np.median(v)) for v in c] for k, c in per.items()}
  costs["S"] = []
  for s in range(n):
    opt = pipe.stage_optimizers[s]
    params, opt_state = state.stage_params[s], state.opt_states[s]
    zeros = tuple(jnp.zeros_like(p) for p in params)
    step = functools.partial(opt.update, zeros, opt_state, params, None, 1.0)
    costs["S"].append(_median_seconds(step))
    if predictor is not None and delay:
      predict = jax.jit(
        lambda p, st, opt=opt: predictor(
          opt.as_dict(p), opt.base_state(st), delay
        )
      )
      predicted = functools.partial(predict, params, opt_state)
      costs["F"][s] += _median_seconds(predicted)
  return costs


def simulate_calls(name, num_stages, m, calls, costs, step_every=1):
  """The event simulator's timeline of ``calls`` ``step`` calls of m
  microbatches with per-stage ``costs`` (``isolated_stage_costs``).

  A synchronous schedule flushes every call; nothing else separates the
  calls, since the driver dispatches asynchronously (a device starts the
  next call's work once its own inputs are there). ``async`` / ``2bw``
  are one stream (``step_every``: backwards per step / microbatches per
  minibatch) drained after the last call.
  """
  if name in schedule_lib.STREAMS:
    lists = schedule_lib.Stream(name, num_stages, step_every).schedule(
      (m,) * calls
    )
  else:
    one = schedule_lib.build(name, num_stages, m)
    lists = schedule_lib.ActionLists(
      one.name,
      one.num_stages,
      one.stage_device,
      tuple(
        tuple(
          schedule_lib.Action(a.kind, a.stage, a.microbatch + c * m)
          for c in range(calls)
          for a in acts
        )
        for acts in one.device_actions
      ),
    )
  return schedule_lib.simulate(
    lists, costs["F"], costs["B"], step_seconds=float(np.mean(costs["S"]))
  )
