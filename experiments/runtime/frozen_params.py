r"""Frozen params held as model state (``jpipe.frozen_loss``) against the
same leaves frozen by the optimizer (``jpipe.train.pretrained.freeze``:
zero updates, but every gradient still computed), paired in one run: a
GPT (``jpipe.models.gpt``, tied embedding) of p stages on one device
with its token embedding frozen, ms per 1F1B step (median) and the
gradient bytes the stages no longer make per microbatch.

Writes results/frozen_params_<platform>.{md,json}.

Usage: python -m experiments.runtime.frozen_params [--vocab 16384]
  [--width 128] [--layers 4] [--stages 2] [--steps 8]
"""

import argparse
import os
import time

import jax
import numpy as np
import optax

import jpipe
from experiments.gpu_campaign import _common
from experiments.gpu_campaign.overhead import one_device_plan
from jpipe.train.pretrained import freeze

PATTERN = "^embed/"


def _pipeline(loss_fn, params, batch, tx, plan, m, model_state=None):
  # (One device: the stages take turns, so the difference is the work.)
  return jpipe.Pipeline(
    loss_fn,
    params,
    batch,
    model_state=model_state,
    num_stages=plan.num_stages,
    devices=jax.devices()[:1],
    schedule="1f1b",
    num_microbatches=m,
    optimizer=tx,
    partition=plan,
  )


def _ms_per_step(pipe, state, batch, steps: int) -> tuple[float, object]:
  for _ in range(2):  # Compiles.
    state, out = pipe.step(state, batch)
  jax.block_until_ready(out["loss"])
  times = []
  for _ in range(steps):
    start = time.perf_counter()
    state, out = pipe.step(state, batch)
    jax.block_until_ready(out["loss"])
    times.append(time.perf_counter() - start)
  return float(np.median(times)) * 1e3, state


def measure(vocab, width, layers, stages, steps, m=4) -> dict:
  """Both runs, their step times interleaved over ``steps`` rounds."""
  loss_fn, params, batch, _ = _common.language_model(
    layers=layers, width=width, heads=4, length=32, batch=16, vocab=vocab
  )
  tx = optax.adamw(1e-4)
  plan = one_device_plan(loss_fn, params, batch, m, stages)  # (Both's.)
  by_optimizer = _pipeline(loss_fn, params, batch, freeze(tx, PATTERN), plan, m)
  fl = jpipe.frozen_loss(loss_fn, params, PATTERN)
  as_state = _pipeline(
    fl.loss_fn, fl.params, batch, tx, plan, m, fl.model_state
  )
  a, b = by_optimizer.init(params), as_state.init(fl.params, fl.model_state)
  ms_a, ms_b = [], []
  for _ in range(3):  # Interleaved: drift hits both.
    t, a = _ms_per_step(by_optimizer, a, batch, steps)
    ms_a.append(t)
    t, b = _ms_per_step(as_state, b, batch, steps)
    ms_b.append(t)
  embed = params["embed"]["embedding"]
  return {
    "vocab": vocab,
    "width": width,
    "layers": layers,
    "stages": stages,
    "microbatches": m,
    "ms_freeze_by_optimizer": round(float(np.median(ms_a)), 2),
    "ms_frozen_as_state": round(float(np.median(ms_b)), 2),
    "ratio": round(float(np.median(ms_b) / np.median(ms_a)), 3),
    "gradient_bytes_saved_per_microbatch": int(embed.size * embed.itemsize),
  }


def main(argv=None):
  parser = argparse.ArgumentParser(
    prog="python -m experiments.runtime.frozen_params"
  )
  parser.add_argument("--vocab", type=int, default=16384)
  parser.add_argument("--width", type=int, default=128)
  parser.add_argument("--layers", type=int, default=4)
  parser.add_argument("--stages", type=int, default=2)
  parser.add_argument("--steps", type=int, default=8)
  parser.add_argument(
    "--out_dir", default=os.path.join(os.path.dirname(__file__), "results")
  )
  args = parser.parse_args(argv)
  row = measure(args.vocab, args.width, args.layers, args.stages, args.steps)
  print(row)
  table = (
    "| vocab | width | layers | p | ms / step, freeze() | ms / step, "
    "frozen_loss | ratio | gradient bytes saved / microbatch |\n"
    "|---|---|---|---|---|---|---|---|\n"
    f"| {row['vocab']} | {row['width']} | {row['layers']} | {row['stages']} "
    f"| {row['ms_freeze_by_optimizer']} | {row['ms_frozen_as_state']} "
    f"| {row['ratio']} | {row['gradient_bytes_saved_per_microbatch']} |\n"
  )
  name = f"frozen_params_{jax.devices()[0].platform}"
  _common.write_table(
    args.out_dir, name, table, {**_common.metadata(), "rows": [row]}
  )


if __name__ == "__main__":
  main()
