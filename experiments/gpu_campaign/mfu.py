"""Model FLOP utilisation and tokens/s of the jitted reference and of the
one-device pipeline, bfloat16 compute and float32, at GPT-2 medium and
GPT-2 XL sizes.

GPT-2 medium (24 layers x 1024, 16 heads: 354 M parameters) and GPT-2 XL
(48 x 1600, 25 heads: 1.56 B), vocabulary 50,304, sequence 1024, float32
params, attention through ``jax.nn.dot_product_attention`` (cuDNN's fused
kernel on an NVIDIA GPU), trained with AdamW; the pipeline is 1f1b, 2
stages on one device, recompute off. Model FLOPs per step by
``_common.training_flops``; MFU = FLOPs / step time / the device's dense
peak for the compute dtype (``_common.PEAK_FLOPS``; None where the device
is not listed, e.g. a CPU); tokens/s = the step's tokens / step time (one
device: per GPU). XL runs in bfloat16 only (its float32 activations and
the two copies of its state do not fit beside each other). Targets (issue
67): medium in bfloat16 at MFU >= 0.40 absolute, the pipeline's >= 0.97x
the reference's.

Usage: python -m experiments.gpu_campaign.mfu [--quick] --out DIR
"""

import optax

from experiments.gpu_campaign import _common
from experiments.gpu_campaign.overhead import one_device_pipeline, timed_runner

# GPT-2 at its training sequence, vocabulary padded to a multiple of 64.
_GPT2 = dict(length=1024, vocab=50304, m=4)
SIZES = {
  "quick": [
    dict(
      name="quick",
      layers=2,
      width=64,
      heads=2,
      length=32,
      batch=8,
      vocab=512,
      m=4,
      dtypes=("bfloat16", "float32"),
    ),
  ],
  "full": [
    dict(
      _GPT2,
      name="gpt2-medium",
      layers=24,
      width=1024,
      heads=16,
      batch=16,
      dtypes=("bfloat16", "float32"),
    ),
    dict(
      _GPT2,
      name="gpt2-xl",
      layers=48,
      width=1600,
      heads=25,
      batch=8,
      dtypes=("bfloat16",),
    ),
  ],
}


def main(args):
  sizes = SIZES["quick" if args.quick else "full"]
  repeats = 3 if args.quick else 6
  results = _common.Results(
    args.out, "mfu", {"sizes": sizes, "repeats": repeats}
  )
  budget = _common.Budget(args.budget)
  for size in sizes:
    for dtype in size["dtypes"]:
      if budget.spent:
        results.note("stopped_by_budget", True)
        results.finish()
        return
      results.add(_row(size, dtype, repeats))
  results.finish()


def _row(size: dict, dtype: str, repeats: int) -> dict:
  """One size in one compute dtype: both sides timed in pairs."""
  shape = {k: size[k] for k in ("layers", "width", "heads", "length", "batch")}
  m, tx = size["m"], optax.adamw(1e-4)
  tokens = size["batch"] * size["length"]
  flops = _common.training_flops(
    layers=size["layers"],
    width=size["width"],
    length=size["length"],
    vocab=size["vocab"],
    tokens=tokens,
  )
  loss_fn, params, batch, _ = _common.language_model(
    **shape, vocab=size["vocab"], dtype=dtype
  )
  reference = _common.reference_step(
    loss_fn, params, batch, m, tx, update_every_microbatch=False
  )
  pipe = one_device_pipeline(
    loss_fn, params, batch, p=2, schedule="1f1b", m=m, tx=tx, recompute=False
  )
  run = timed_runner(pipe, params, batch)
  summary = _common.ratio_summary(
    *_common.paired_times(run, reference, repeats)
  )
  peak = _common.peak_flops(dtype)
  seconds = {k: summary[f"{k}_ms"] / 1e3 for k in ("pipeline", "reference")}
  return {
    "size": size["name"],
    "dtype": dtype,
    "parameters": _common.parameter_count(params),
    "tokens_per_step": tokens,
    "flops_per_step": flops,
    **summary,
    **{f"{k}_tflops": flops / t / 1e12 for k, t in seconds.items()},
    **{
      f"{k}_mfu": (flops / t / peak if peak else None)
      for k, t in seconds.items()
    },
    **{f"{k}_tokens_per_s": tokens / t for k, t in seconds.items()},
    "pipeline_mfu_over_reference": 1.0 / summary["ratio"],
  }
