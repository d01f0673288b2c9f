r"""Weight-version memory per stage under the asynchronous schedule.

A GPT-style model (untied head: asynchronous stages cannot share params)
on n in {4, 8} stages, ``async`` over m = 4n microbatches, with weight
stashing, stashing + prediction, and Gap-Aware + stashing. For every stage
the driver counts the distinct param versions it held at once (live,
stashed, predicted: a version is a set of device buffers kept alive by
reference); times the stage's param bytes that is its peak weight memory.
PipeDream's model: stage s of n keeps d + 1 = n - s versions.

Writes results/stash_memory.{md,json}.

Usage: python -m experiments.runtime.stash_memory
"""

import json
import os

import flax.linen as nn
import jax
import numpy as np
import optax

import jpipe
from jpipe.models import gpt

OUT = os.path.join(os.path.dirname(__file__), "results")


class UntiedLm(nn.Module):
  """GPT blocks with a separate output head (no tied embedding)."""

  layers: int
  width: int

  @nn.compact
  def __call__(self, tokens):
    x = nn.Embed(256, self.width, name="embed")(tokens)
    for i in range(self.layers):
      x = gpt.Block(num_heads=2, name=f"block_{i}")(x, train=False)
    return nn.Dense(256, name="head")(nn.LayerNorm(name="ln_f")(x))


def _lm(layers, width, length, batch):
  model = UntiedLm(layers, width)
  tokens = jax.random.randint(jax.random.key(0), (batch, length + 1), 0, 256)
  params = model.init(jax.random.key(1), tokens[:1, :-1])

  def loss_fn(params, batch):
    logits = model.apply(params, batch[:, :-1])
    return optax.softmax_cross_entropy_with_integer_labels(
      logits, batch[:, 1:]
    ).mean()

  return loss_fn, params, tokens


VARIANTS = {
  "ws": {"weight_stashing": True},
  "ws+wp": {"weight_stashing": True, "prediction": "msnag"},
  "ws+ga": {
    "weight_stashing": True,
    "gap_aware": "ga",
    "gap_aware_options": {"optimizer": "adamw", "learning_rate": 1e-3},
  },
}


def main():
  jax.config.update("jax_disable_most_optimizations", True)
  rows, records = [], []
  for n in (4, 8):
    m = 4 * n
    loss_fn, params, batch = _lm(2 * n - 2, 32, 16, 2 * m)
    for name, kwargs in VARIANTS.items():
      pipe = jpipe.Pipeline(
        loss_fn,
        params,
        batch,
        num_stages=n,
        devices=jax.devices()[:n],
        schedule="async",
        num_microbatches=m,
        optimizer=optax.adamw(1e-3),
        **kwargs,
      )
      state = pipe.init(params)
      state, metrics = pipe.step(state, batch)
      stage_bytes = [
        sum(np.asarray(x).nbytes for x in leaves)
        for leaves in state.stage_params
      ]
      for s in range(pipe.stages.num_stages):
        held = metrics["param_versions"][s]
        model = n - s
        records.append(
          {
            "stages": n,
            "variant": name,
            "stage": s,
            "delay": n - 1 - s,
            "versions_held": held,
            "pipedream_versions": model,
            "param_bytes": stage_bytes[s],
            "peak_weight_bytes": held * stage_bytes[s],
          }
        )
        rows.append(
          f"| {n} | {name} | {s} | {n - 1 - s} | {held} | {model} | "
          f"{stage_bytes[s] / 1e3:.1f} | {held * stage_bytes[s] / 1e3:.1f} |"
        )
  table = (
    "| n | variant | stage | delay d | versions held | d + 1 | "
    "stage params kB | peak weights kB |\n|---|---|---|---|---|---|---|---|\n"
    + "\n".join(rows)
  )
  os.makedirs(OUT, exist_ok=True)
  with open(os.path.join(OUT, "stash_memory.md"), "w") as f:
    f.write(table + "\n")
  with open(os.path.join(OUT, "stash_memory.json"), "w") as f:
    json.dump(records, f, separators=(",", ":"))
  print(table)


if __name__ == "__main__":
  main()
