r"""The driver's cost per action, and the gradient own-buffer threshold.

(1) A tiny GPT (8 layers x 8 wide: compute ~ 0) on p stages of one device
and m microbatches under gpipe and the streaming asynchronous schedule:
step time / actions in microseconds, and the host's share (time until
``pipe.step`` returned, per action) split into the driver's own Python,
the programs' dispatch and the rest (``experiments.runtime.host_cost``).
On a GPU the host's share near the whole is the driver setting the
pace; then the split says whether jpipe's Python or JAX's dispatch is.
(2) ``experiments.runtime.flat_grads`` on this device: a stage's backward
with its gradients all packed into one buffer, none packed, and jpipe's
default threshold (``jpipe.runtime.build.flat.own_buffer_bytes``), by leaf size,
kept in this part's JSON (``grad_buffers``).

Usage: python -m experiments.gpu_campaign.driver [--quick] --out DIR
"""

import cProfile
import io
import json
import os
import pstats
import subprocess
import sys
import tempfile
import time

import numpy as np
import optax

from experiments.gpu_campaign import _common
from experiments.gpu_campaign.overhead import one_device_pipeline, timed_runner
from experiments.runtime.host_cost import host_breakdown

TINY = dict(layers=8, width=8, heads=1, length=4, batch=64)
GRID = {
  "quick": [(2, 4)],  # Each code path once (a test, not a table).
  "full": [(p, m) for p in (2, 4, 8) for m in (8, 32)],
}
# --quick: each code path once, at the least size that runs it (the
# test compiles every program: a 4-layer GPT, the profile at p = 2).
QUICK = dict(layers=4, profile=dict(p=2, m=4, steps=2), widths="128")


def host_profile(loss_fn, params, batch, p=4, m=32, steps=5) -> dict:
  """Where the host's time goes: ``cProfile`` over ``steps`` gpipe steps of
  the tiny GPT (compiled and warm first), per action in microseconds: the
  25 functions with the most own time, and the total."""
  pipe = one_device_pipeline(
    loss_fn,
    params,
    batch,
    p=p,
    schedule="gpipe",
    m=m,
    tx=optax.sgd(1e-3),
    recompute=False,
  )
  run = timed_runner(pipe, params, batch)
  for _ in range(2):
    run()
  actions = run.actions() * steps
  profiler = cProfile.Profile()
  profiler.enable()
  for _ in range(steps):
    run()
  profiler.disable()
  stats = pstats.Stats(profiler, stream=io.StringIO())
  rows = sorted(stats.stats.items(), key=lambda kv: -kv[1][2])[:25]
  return {
    "stages": p,
    "microbatches": m,
    "us_per_action": 1e6 * stats.total_tt / actions,
    "top_own_time": [
      {
        "function": f"{os.path.basename(file)}:{line}:{name}",
        "calls_per_action": calls / actions,
        "own_us_per_action": 1e6 * own / actions,
        "cumulative_us_per_action": 1e6 * cumulative / actions,
      }
      for (file, line, name), (_, calls, own, cumulative, _) in rows
    ],
  }


def main(args):
  grid = GRID["quick" if args.quick else "full"]
  repeats = 3 if args.quick else 10
  size = dict(TINY, layers=QUICK["layers"]) if args.quick else TINY
  results = _common.Results(
    args.out, "driver", {**size, "repeats": repeats, "grid": grid}
  )
  budget = _common.Budget(args.budget)
  loss_fn, params, batch, _ = _common.language_model(**size)
  profile = QUICK["profile"] if args.quick else {}
  results.note("host_profile", host_profile(loss_fn, params, batch, **profile))
  # The stream with its steps apart and inside their backwards' programs
  # (``Partitioning.fuse_step``): on a GPU the update may also fuse into
  # the gradient's kernels, so its cost and its bits are measured here.
  for schedule, fuse_step in (
    ("gpipe", True),
    ("async", False),
    ("async", True),
  ):
    for p, m in grid:
      if budget.spent:
        results.note("stopped_by_budget", True)
        break
      pipe = one_device_pipeline(
        loss_fn,
        params,
        batch,
        p=p,
        schedule=schedule,
        m=m,
        tx=optax.sgd(1e-3),
        recompute=False,
        fuse_step=fuse_step,
      )
      run = timed_runner(pipe, params, batch)
      times = []
      for i in range(repeats + 2):
        start = time.perf_counter()
        run()
        if i >= 2:  # compiled and warm
          times.append(time.perf_counter() - start)
      actions = run.actions()
      step = float(np.median(times))
      results.add(
        {
          "schedule": schedule,
          "fuse_step": fuse_step,
          "stages": p,
          "microbatches": m,
          "actions": actions,
          "step_ms": 1e3 * step,
          "us_per_action": 1e6 * step / actions,
          # host_us_per_action and its parts: the driver's Python, the
          # programs' dispatch, their run (``host_cost``).
          **host_breakdown(pipe, run, actions, repeats),
        }
      )
  widths = QUICK["widths"] if args.quick else "256,512,1024,2048,4096"
  # Its own files go to a scratch folder: this part's JSON (with the run's
  # date, device and commit) carries the record.
  with tempfile.TemporaryDirectory() as scratch:
    child = subprocess.run(
      [
        sys.executable,
        "-m",
        "experiments.runtime.flat_grads",
        f"--out_dir={scratch}",
        f"--grad_widths={widths}",
        f"--repeats={repeats}",
      ],
      capture_output=True,
      text=True,
      timeout=budget.timeout(30.0),
    )
    if child.returncode == 0:
      platform = _common.metadata()["platform"]
      with open(os.path.join(scratch, f"flat_grads_{platform}.json")) as f:
        results.note("grad_buffers", json.load(f))
    else:
      results.note("grad_buffers_error", child.stderr[-2000:])
  results.finish()
