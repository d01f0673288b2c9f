r"""Predicted memory against the device's own count, and the asynchronous
stash against PipeDream's d + 1 versions.

Each setting runs in its own process, so the device's peak
(``device.memory_stats()["peak_bytes_in_use"]``, a high-water mark over
the process's life) is that pipeline's alone: params are made on the
host, then the pipeline is built, initialised and stepped 3 times. Its
prediction (``pipe.memory``, from abstract shapes before anything
compiles) for each device (``pipe.device_memory``: all stages on a
one-device machine; one stage per device where there are p devices).
Target: within 10 % of measured. Devices that report no memory
statistics (CPUs) give the prediction alone.

The stash: under ``async`` with weight stashing, stage s of p holds the
params of every microbatch between its forward and backward, d_s + 1
versions with d_s = p - 1 - s (PipeDream, section 3.3); the prediction's
``versions`` is listed beside it.

Usage: python -m experiments.gpu_campaign.memory [--quick] --out DIR
"""

import json
import subprocess
import sys

import jax
import optax

import jpipe
from experiments.gpu_campaign import _common
from experiments.gpu_campaign.overhead import one_device_plan

SIZES = {
  "quick": dict(layers=4, width=64, heads=2, length=32, batch=16, m=4),
  "full": dict(layers=16, width=1024, heads=16, length=512, batch=32, m=8),
}

# (schedule, recompute), most important first; p = 4.
SETTINGS = (("1f1b", False), ("async", False), ("gpipe", False), ("1f1b", True))
# --quick: one setting, the stash's (the code path is the same for all).
QUICK_SETTINGS = (("async", False),)
STAGES = 4


def measure(size: dict, schedule: str, recompute: bool) -> dict:
  """One setting, in this process: prediction and measured peak per
  device (bytes)."""
  size = dict(size)
  m = size.pop("m")
  loss_fn, params, batch, _ = _common.language_model(**size)
  devices = jax.devices()
  # One stage per device where there are enough, else all on device 0.
  n = STAGES if len(devices) >= STAGES else 1
  pipe = jpipe.Pipeline(
    loss_fn,
    params,
    batch,
    num_stages=STAGES,
    devices=devices[:n],
    schedule=schedule,
    num_microbatches=m,
    optimizer=optax.adamw(1e-4),
    recompute=recompute,
    weight_stashing=schedule == "async",
    partition="contiguous"
    if n > 1
    else one_device_plan(loss_fn, params, batch, m, STAGES),
  )
  state = pipe.init(params)
  device_batch = jax.device_put(batch)
  for _ in range(3):
    state, metrics = pipe.step(state, device_batch)
  jax.block_until_ready((state.stage_params, metrics["loss"]))
  per_device = []
  for d, total in sorted(pipe.device_memory.items()):
    stats = devices[d].memory_stats() or {}
    peak = stats.get("peak_bytes_in_use")
    per_device.append(
      {
        "device": d,
        "predicted_bytes": total,
        "measured_peak_bytes": peak,
        "predicted_over_measured": total / peak if peak else None,
      }
    )
  return {
    "schedule": schedule,
    "recompute": recompute,
    "stages": STAGES,
    "devices_used": n,
    "per_device": per_device,
    "stage_predictions": [m.describe() for m in pipe.memory],
    "stash_versions_predicted": [m.versions for m in pipe.memory],
    "stash_versions_pipedream": [
      STAGES - s if schedule == "async" else 1 for s in range(STAGES)
    ],
  }


def main(args):
  size = SIZES["quick" if args.quick else "full"]
  results = _common.Results(args.out, "memory", dict(size))
  budget = _common.Budget(args.budget)
  for schedule, recompute in QUICK_SETTINGS if args.quick else SETTINGS:
    if budget.spent:
      results.note("stopped_by_budget", True)
      break
    request = json.dumps(
      {"size": size, "schedule": schedule, "recompute": recompute}
    )
    try:
      child = subprocess.run(
        [sys.executable, "-m", "experiments.gpu_campaign.memory", request],
        capture_output=True,
        text=True,
        timeout=budget.timeout(10.0),
      )
    except subprocess.TimeoutExpired:
      results.add(
        {
          "schedule": schedule,
          "recompute": recompute,
          "error": "the budget ran out while it ran",
        }
      )
      break
    if child.returncode != 0:
      results.add(
        {
          "schedule": schedule,
          "recompute": recompute,
          "error": child.stderr[-2000:],
        }
      )
      continue
    results.add(json.loads(child.stdout.strip().splitlines()[-1]))
  results.finish()


if __name__ == "__main__":
  request = json.loads(sys.argv[1])
  row = measure(request["size"], request["schedule"], request["recompute"])
  print(json.dumps(row), flush=True)
