r"""The partitioner's predicted stage times against measured ones.

A GPT is traced and its nodes costed by each of the partitioner's methods
(``analytic``: FLOPs from the jaxpr; ``xla``: the compiled node's cost
analysis; ``measured``: each node timed on the device), split into 4
stages by that method's own costs, and the plan's per-stage forward and
backward seconds set beside the same stages timed one action at a time in
a ``seq`` pipeline on the device (``experiments.runtime.stage_costs``).
``analytic`` and ``xla`` convert FLOPs to seconds at a nominal rate, so
the comparable figure is each stage's share of the total; ``measured``
predicts seconds outright. A plan is as good as its shares.

Usage: python -m experiments.gpu_campaign.stage_times [--quick] --out DIR
"""

import dataclasses

import jax
import numpy as np
import optax

import jpipe
from experiments.gpu_campaign import _common
from experiments.runtime.stage_costs import isolated_stage_costs
from jpipe import partition

SIZES = {
  "quick": dict(layers=4, width=64, heads=2, length=32, batch=8, m=2),
  "full": dict(layers=8, width=1024, heads=16, length=512, batch=16, m=2),
}
STAGES = 4
METHODS = ("analytic", "xla", "measured")


def main(args):
  size = dict(SIZES["quick" if args.quick else "full"])
  m = size.pop("m")
  results = _common.Results(
    args.out, "stage_times", {**size, "microbatches": m, "stages": STAGES}
  )
  budget = _common.Budget(args.budget)
  loss_fn, params, batch, _ = _common.language_model(**size)
  micro = jax.tree.map(lambda x: x[: x.shape[0] // m], batch)
  traced = partition.trace(loss_fn, params, micro)
  batches = [jax.device_put(batch)] * 5
  for method in METHODS:
    if budget.spent:
      results.note("stopped_by_budget", True)
      break
    costs = partition.profile_nodes(
      traced, params, micro, method=method, recompute=False
    )
    plan = partition.plan_traced(traced, costs, STAGES)
    plan = dataclasses.replace(plan, stage_devices=((0,),) * plan.num_stages)
    pipe = jpipe.Pipeline(
      loss_fn,
      params,
      batch,
      num_stages=plan.num_stages,
      devices=jax.devices()[:1],
      schedule="seq",
      num_microbatches=m,
      optimizer=optax.sgd(1e-4),
      partition=plan,
      recompute=False,
      fuse_last_stage=False,
    )
    measured = isolated_stage_costs(pipe, pipe.init(params), batches)
    predicted = np.add(plan.stage_forward_seconds, plan.stage_backward_seconds)
    actual = np.add(measured["F"], measured["B"])
    shares = predicted / predicted.sum(), actual / actual.sum()
    results.add(
      {
        "method": method,
        "stages": plan.num_stages,
        "predicted_forward_s": list(map(float, plan.stage_forward_seconds)),
        "predicted_backward_s": list(map(float, plan.stage_backward_seconds)),
        "measured_forward_s": measured["F"],
        "measured_backward_s": measured["B"],
        "predicted_share": list(map(float, shares[0])),
        "measured_share": list(map(float, shares[1])),
        # The worst stage's share error, relative to its measured share.
        "max_share_error": float(np.max(np.abs(shares[0] / shares[1] - 1))),
        "measured_imbalance": float(actual.max() / actual.mean()),
      }
    )
  results.finish()
