r"""Model FLOP utilisation of the jitted reference and of the one-device
pipeline, bfloat16 compute and float32.

A GPT-2-medium-sized model (24 layers x 1024, 16 heads, vocabulary 50,304:
354 M parameters, float32 params) trained with AdamW; the pipeline is
1f1b, 2 stages on one device, recompute off. Model FLOPs per step by
``_common.training_flops``; MFU = FLOPs / step time / the device's dense
peak for the compute dtype (``_common.PEAK_FLOPS``; None where the device
is not listed, e.g. a CPU). Target: the pipeline's MFU >= 0.95 x the
reference's, i.e. ratio <= 1.053.

Usage: python -m experiments.gpu_campaign.mfu [--quick] --out DIR
"""

import optax

from experiments.gpu_campaign import _common
from experiments.gpu_campaign.overhead import one_device_pipeline, timed_runner

SIZES = {
  "quick": dict(
    layers=2, width=64, heads=2, length=32, batch=8, vocab=512, m=4
  ),
  "full": dict(
    layers=24, width=1024, heads=16, length=512, batch=32, vocab=50304, m=4
  ),
}


def main(args):
  size = dict(SIZES["quick" if args.quick else "full"])
  m = size.pop("m")
  repeats = 3 if args.quick else 6
  results = _common.Results(
    args.out, "mfu", {**size, "microbatches": m, "repeats": repeats}
  )
  budget = _common.Budget(args.budget)
  tx = optax.adamw(1e-4)
  flops = _common.training_flops(
    layers=size["layers"],
    width=size["width"],
    length=size["length"],
    vocab=size["vocab"],
    tokens=size["batch"] * size["length"],
  )
  for dtype in ("bfloat16", "float32"):
    if budget.spent:
      results.note("stopped_by_budget", True)
      break
    loss_fn, params, batch, _ = _common.language_model(**size, dtype=dtype)
    reference = _common.reference_step(
      loss_fn, params, batch, m, tx, update_every_microbatch=False
    )
    pipe = one_device_pipeline(
      loss_fn,
      params,
      batch,
      p=2,
      schedule="1f1b",
      m=m,
      tx=tx,
      recompute=False,
    )
    run = timed_runner(pipe, params, batch)
    summary = _common.ratio_summary(
      *_common.paired_times(run, reference, repeats)
    )
    peak = _common.peak_flops(dtype)
    achieved = {
      k: flops / (summary[f"{k}_ms"] / 1e3) for k in ("pipeline", "reference")
    }
    results.add(
      {
        "dtype": dtype,
        "parameters": _common.parameter_count(params),
        "flops_per_step": flops,
        **summary,
        **{f"{k}_tflops": v / 1e12 for k, v in achieved.items()},
        **{
          f"{k}_mfu": (v / peak if peak else None) for k, v in achieved.items()
        },
        "pipeline_mfu_over_reference": 1.0 / summary["ratio"],
      }
    )
    del pipe, run, reference
  results.finish()
