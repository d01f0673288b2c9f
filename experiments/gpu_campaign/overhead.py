r"""The pipeline's own cost on ONE device, against one jitted step.

A GPT split into p stages, all placed on the same device, run by jpipe's
driver under gpipe, 1f1b and the streaming asynchronous schedule (weight
stashing), recompute off and on, against the same model as one jitted step
over the same microbatches with the same AdamW update (the asynchronous
rows' reference updates after every microbatch, as each stage does; a
recomputing row's reference recomputes too, ``jax.checkpoint``).
p = 1 is the driver around an unsplit model. Timed alternately; per row
the median ratio and its IQR, the host's dispatch time until ``pipe.step``
returned, and the fixed cost per microbatch in microseconds ((pipeline -
reference) / m), which compares across machines of different speed.
Target on a GPU: ratio <= 1.05 at p = 2 and 4, recompute off.

Rows run in the order below, most important first, until the budget is
spent.

Usage: python -m experiments.gpu_campaign.overhead [--quick] --out DIR
"""

import dataclasses
import time

import jax
import numpy as np
import optax

import jpipe
from experiments.gpu_campaign import _common
from jpipe import partition

# layers, width, heads, sequence, batch, microbatches, dtype
SIZES = {
  # (Quick: 2 layers, as many as its rows' stages; the test compiles
  # every program of each row.)
  "quick": dict(layers=2, width=32, heads=2, length=16, batch=8, m=4),
  "full": dict(layers=16, width=1024, heads=16, length=512, batch=32, m=8),
}

# (stages, schedule, recompute), most important first.
ROWS = (
  [(p, "gpipe", False) for p in (2, 4)]
  + [(p, s, False) for s in ("1f1b", "async") for p in (2, 4)]
  + [(1, "gpipe", False), (8, "gpipe", False)]
  + [(p, "gpipe", True) for p in (2, 4)]
  + [(p, s, True) for s in ("1f1b", "async") for p in (2, 4)]
  + [(8, s, r) for s in ("1f1b", "async") for r in (False, True)]
  + [(1, "gpipe", True), (8, "gpipe", True)]
)


# --quick: one row per code path (p = 1, streams, recomputation).
QUICK_ROWS = ((2, "gpipe", False), (1, "1f1b", True), (2, "async", False))


def one_device_plan(loss_fn, params, batch, m, p):
  """A ``p``-stage plan (analytic costs) with every stage on device 0."""
  micro = jax.tree.map(lambda x: x[: x.shape[0] // m], batch)
  traced = partition.trace(loss_fn, params, micro)
  costs = partition.profile_nodes(traced, params, micro, method="analytic")
  plan = partition.plan_traced(traced, costs, p)
  return dataclasses.replace(plan, stage_devices=((0,),) * plan.num_stages)


def one_device_pipeline(
  loss_fn, params, batch, *, p, schedule, m, tx, recompute, **options
):
  """A ``jpipe.Pipeline`` of ``p`` stages all on the first device
  (``options``: more of the Pipeline's)."""
  return jpipe.Pipeline(
    loss_fn,
    params,
    batch,
    num_stages=p,
    devices=jax.devices()[:1],
    schedule=schedule,
    num_microbatches=m,
    optimizer=tx,
    partition=one_device_plan(loss_fn, params, batch, m, p),
    recompute=recompute,
    weight_stashing=schedule == "async",
    **options,
  )


def timed_runner(pipe, params, batch):
  """``run()``: one ``pipe.step`` waited for; the host's seconds until
  ``step`` returned are appended to ``run.host_seconds``.
  ``run.actions()`` runs one profiled step and returns how many actions
  (forwards, backwards, optimizer steps) it ran."""
  state = {"s": pipe.init(params), "b": jax.device_put(batch)}

  def run():
    start = time.perf_counter()
    state["s"], metrics = pipe.step(state["s"], state["b"])
    run.host_seconds.append(time.perf_counter() - start)
    jax.block_until_ready((state["s"].stage_params, metrics["loss"]))

  def actions():
    state["s"], metrics = pipe.step(state["s"], state["b"], profile=True)
    return len(metrics["timeline"].start)

  run.host_seconds = []
  run.actions = actions
  run.state = state  # {"s": the pipeline's state, "b": the batch}
  return run


def main(args):
  size = dict(SIZES["quick" if args.quick else "full"])
  m = size.pop("m")
  repeats = 3 if args.quick else 10
  loss_fn, params, batch, _ = _common.language_model(**size, dtype=args.dtype)
  results = _common.Results(
    args.out,
    "overhead",
    {**size, "microbatches": m, "dtype": args.dtype, "repeats": repeats},
  )
  budget = _common.Budget(args.budget)
  tx = optax.adamw(1e-4)
  references = {}
  start, stop = (int(x) if x else None for x in args.overhead_rows.split(":"))
  rows = QUICK_ROWS if args.quick else ROWS
  for p, schedule, recompute in rows[start:stop]:
    if budget.spent:
      results.note("stopped_by_budget", True)
      break
    asynchronous = schedule == "async"
    # A recomputing pipeline against a jitted step that recomputes too:
    # the extra forward is the user's choice, not the pipeline's cost.
    key = (asynchronous, recompute)
    if key not in references:
      references[key] = _common.reference_step(
        loss_fn,
        params,
        batch,
        m,
        tx,
        update_every_microbatch=asynchronous,
        recompute=recompute,
      )
    pipe = one_device_pipeline(
      loss_fn,
      params,
      batch,
      p=p,
      schedule=schedule,
      m=m,
      tx=tx,
      recompute=recompute,
    )
    run = timed_runner(pipe, params, batch)
    pipe_times, ref_times = _common.paired_times(run, references[key], repeats)
    summary = _common.ratio_summary(pipe_times, ref_times)
    host = float(np.median(run.host_seconds[-repeats:]))
    fixed = (summary["pipeline_ms"] - summary["reference_ms"]) * 1e3 / m
    results.add(
      {
        "stages": p,
        "schedule": schedule,
        "recompute": recompute,
        "reference_recomputes": recompute,
        **summary,
        "host_dispatch_ms": 1e3 * host,
        "host_share": host / (summary["pipeline_ms"] / 1e3),
        "fixed_us_per_microbatch": fixed,
        "actions": run.actions(),
      }
    )
    del pipe, run
  results.finish()
