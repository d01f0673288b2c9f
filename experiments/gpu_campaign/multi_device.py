r"""On a machine with several devices: the pipeline's speed-up over one.

The overhead part's GPT on p = every device (at most 8), 1f1b, the
streaming asynchronous schedule and the zero-bubble ones (ZB-H1: one
stage per device, its backward split in I and W; ZB-V and DualPipeV: 2p
stages in a V, two per device), recompute off, against the same model as
one jitted step on one device: speed-up = reference time / pipeline time
(ideal p, less the bubble: m / (m + p - 1) for 1f1b, which the
zero-bubble schedules fill with W). With one device the part records why
it did nothing. ``--quick`` runs each code path once (DualPipeV's
actions are ZB-V's, in another order: full runs only).

Usage: python -m experiments.gpu_campaign.multi_device [--quick] --out DIR
"""

import jax
import optax

import jpipe
from experiments.gpu_campaign import _common
from experiments.gpu_campaign.overhead import SIZES, timed_runner

SCHEDULES = ("1f1b", "async", "zbh1", "zbv", "dualpipev")
QUICK_SCHEDULES = ("1f1b", "async", "zbh1", "zbv")
V_SCHEDULES = ("zbv", "dualpipev")  # 2 stages per device


def main(args):
  size = dict(SIZES["quick" if args.quick else "full"])
  m = size.pop("m")
  repeats = 3 if args.quick else 10
  # --quick: two stages run every code path (a test, not a table).
  p = min(jax.device_count(), 2 if args.quick else 8)
  results = _common.Results(
    args.out, "multi_device", {**size, "microbatches": m, "stages": p}
  )
  if p < 2:
    results.note("skipped", "one device: no pipeline across devices to time")
    results.finish()
    return
  budget = _common.Budget(args.budget)
  loss_fn, params, batch, _ = _common.language_model(**size, dtype=args.dtype)
  tx = optax.adamw(1e-4)
  for schedule in QUICK_SCHEDULES if args.quick else SCHEDULES:
    if budget.spent:
      results.note("stopped_by_budget", True)
      break
    asynchronous = schedule == "async"
    reference = _common.reference_step(
      loss_fn, params, batch, m, tx, update_every_microbatch=asynchronous
    )
    stages = 2 * p if schedule in V_SCHEDULES else p
    pipe = jpipe.Pipeline(
      loss_fn,
      params,
      batch,
      num_stages=stages,
      devices=jax.devices()[:p],
      schedule=schedule,
      num_microbatches=m,
      optimizer=tx,
      recompute=False,
      weight_stashing=asynchronous,
    )
    run = timed_runner(pipe, params, batch)
    summary = _common.ratio_summary(
      *_common.paired_times(run, reference, repeats)
    )
    results.add(
      {
        "schedule": schedule,
        "stages": stages,
        "devices": p,
        **summary,
        "speedup": 1.0 / summary["ratio"],
        "ideal_1f1b": p * m / (m + p - 1),
      }
    )
  results.finish()
