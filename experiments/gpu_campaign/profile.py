r"""Where the one-device pipeline loses to the jitted step: a profile.

(1) The host's fixed cost of one jitted call by how many arrays it takes
and returns: an elementwise program over n leaves (n = 1 ... 1024),
dispatched back to back, in microseconds per call and per array -- what
every action of the driver pays per param, gradient and optimizer-state
leaf.
(2) The overhead part's GPT on 2 stages of the one device, async (weight
stashing) and 1f1b -- also with the stage programs as CUDA graphs
(``gpu_command_buffers=True``, jpipe's default before 2026-11-26) -- and
the jitted reference step: a ``jax.profiler``
trace of steady-state steps parsed by
``experiments.runtime.trace_breakdown`` (host time per kind of driver op,
dispatch against Python, the runtime's phases, each device's busy time).
The async trace itself is kept beside the JSON
(``profile_trace_async.json.gz``, for Perfetto) when it is under 16 MB.

Usage: python -m experiments.gpu_campaign --parts profile [--quick] --out DIR
"""

import os
import shutil
import tempfile
import time

import jax
import numpy as np
import optax

from experiments.gpu_campaign import _common
from experiments.gpu_campaign.overhead import (
  SIZES,
  one_device_pipeline,
  timed_runner,
)
from experiments.runtime import trace_breakdown

LEAF_COUNTS = {"quick": (1, 16), "full": (1, 16, 64, 256, 1024)}
# (label, schedule, gpu_command_buffers), most important first.
RUNS = (
  ("reference_async", None, None),
  ("async", "async", False),
  ("async_command_buffers", "async", True),
  ("1f1b", "1f1b", False),
  ("1f1b_command_buffers", "1f1b", True),
)
# --quick: the reference and one pipeline (the code paths; off a GPU the
# CUDA-graph variants compile alike, and 1f1b's trace parses as async's).
QUICK_RUNS = ("reference_async", "async")
KEEP_TRACE_BYTES = 16 * 2**20


def dispatch_cost(n: int, calls: int = 50) -> dict:
  """Host microseconds per call of a jitted ``x * s + 1`` over ``n``
  leaves of 256 floats (n arrays in, n out), inputs ready, dispatched
  back to back (the device's queue keeps up: the work is tiny)."""
  device = jax.devices()[0]
  xs = tuple(jax.device_put(np.ones(256, np.float32), device) for _ in range(n))
  f = jax.jit(lambda xs, s: tuple(x * s + 1 for x in xs))
  scale = jax.device_put(np.float32(1.0), device)
  jax.block_until_ready(f(xs, scale))
  times = []
  for _ in range(calls):
    start = time.perf_counter()
    out = f(xs, scale)
    times.append(time.perf_counter() - start)
  jax.block_until_ready(out)
  us = 1e6 * float(np.median(times))
  return {"leaves": n, "us_per_call": us, "us_per_array": us / (2 * n + 1)}


def main(args):
  quick = args.quick
  size = dict(SIZES["quick" if quick else "full"])
  m = size.pop("m")
  steps = 2 if quick else 3
  results = _common.Results(
    args.out,
    "profile",
    {**size, "microbatches": m, "dtype": args.dtype, "traced_steps": steps},
  )
  budget = _common.Budget(args.budget)
  for n in LEAF_COUNTS["quick" if quick else "full"]:
    results.add({"what": "dispatch", **dispatch_cost(n)})
  loss_fn, params, batch, _ = _common.language_model(**size, dtype=args.dtype)
  tx = optax.adamw(1e-4)
  chosen = set(filter(None, args.profile_runs.split(",")))
  if quick and not chosen:
    chosen = set(QUICK_RUNS)
  unknown = chosen - {label for label, _, _ in RUNS}
  if unknown:
    raise ValueError(f"unknown profile runs {sorted(unknown)}: see RUNS")
  for label, schedule, command_buffers in RUNS:
    if chosen and label not in chosen:
      continue
    if budget.spent:
      results.note("stopped_by_budget", True)
      break
    if schedule is None:
      run = _common.reference_step(
        loss_fn, params, batch, m, tx, update_every_microbatch=True
      )
    else:
      pipe = one_device_pipeline(
        loss_fn,
        params,
        batch,
        p=2,
        schedule=schedule,
        m=m,
        tx=tx,
        recompute=False,
        gpu_command_buffers=command_buffers,
      )
      run = timed_runner(pipe, params, batch)
    for _ in range(3):  # compile, warm up
      run()
    with tempfile.TemporaryDirectory() as scratch:
      path = trace_breakdown.capture(run, steps, scratch)
      summary = trace_breakdown.breakdown(path)
      if label == "async" and os.path.getsize(path) < KEEP_TRACE_BYTES:
        shutil.copy(path, os.path.join(args.out, "profile_trace_async.json.gz"))
    results.add(
      {
        "what": "trace",
        "run": label,
        "stages": 2,
        "gpu_command_buffers": command_buffers,
        **summary,
      }
    )
    print(trace_breakdown.table({label: summary}), flush=True)
    del run
  results.finish()
