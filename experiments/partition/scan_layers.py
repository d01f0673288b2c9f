r"""A scanned stack of layers split per layer, at Aceso's scale.

A plain-JAX language model whose ``--layers`` layers (width ``--width``)
run under one ``jax.lax.scan`` over stacked params, with abstract shapes
only (``jax.ShapeDtypeStruct``: nothing is allocated): the time to trace
it (one node per layer, ``partition._scan_layers``), to cost it
(analytic FLOPs) and to plan it into each stage count, and the plan's
balance (slowest stage over the mean).

Usage: python -m experiments.partition.scan_layers [--layers 1000]
"""

import time

import jax
import jax.numpy as jnp
import numpy as np
from absl import app, flags

from jpipe import partition

FLAGS = flags.FLAGS
flags.DEFINE_integer("layers", 1000, "Scanned layers.")
flags.DEFINE_integer("width", 1024, "Model width d (MLP 4d, vocab 32k).")
flags.DEFINE_integer("seq", 1024, "Tokens per example.")
flags.DEFINE_list("stages", ["8", "64"], "Stage counts.")


def _layer(x, p):
  h = x * p["g"][None, None]
  q, k, v = h @ p["wq"], h @ p["wk"], h @ p["wv"]
  att = jax.nn.softmax(jnp.einsum("btd,bsd->bts", q, k), -1)
  x = x + (att @ v) @ p["wo"]
  return x + jax.nn.gelu(x @ p["w1"]) @ p["w2"], None


def _model(layers, d, seq, vocab=32768):
  f32 = jnp.float32

  def s(*shape):
    return jax.ShapeDtypeStruct(shape, f32)

  params = {
    "emb": s(vocab, d),
    "layers": {
      "g": s(layers, d),
      **{w: s(layers, d, d) for w in ("wq", "wk", "wv", "wo")},
      "w1": s(layers, d, 4 * d),
      "w2": s(layers, 4 * d, d),
    },
    "head": s(d, vocab),
  }
  batch = {
    "x": jax.ShapeDtypeStruct((1, seq), jnp.int32),
    "y": jax.ShapeDtypeStruct((1, seq), jnp.int32),
  }

  def loss_fn(params, batch):
    x = params["emb"][batch["x"]]
    x, _ = jax.lax.scan(_layer, x, params["layers"])
    logp = jax.nn.log_softmax(x @ params["head"])
    return -jnp.mean(jnp.take_along_axis(logp, batch["y"][..., None], -1))

  return loss_fn, params, batch


def main(argv):
  del argv
  loss_fn, params, batch = _model(FLAGS.layers, FLAGS.width, FLAGS.seq)
  start = time.perf_counter()
  traced = partition.trace(loss_fn, params, batch)
  trace_s = time.perf_counter() - start
  start = time.perf_counter()
  costs = partition.profile_nodes(traced, params, batch, method="analytic")
  cost_s = time.perf_counter() - start
  print(
    f"{FLAGS.layers} layers, d = {FLAGS.width}: {traced.num_nodes} nodes, "
    f"{len(traced.jaxpr.eqns)} equations; trace {trace_s:.2f} s, "
    f"analytic costs {cost_s:.2f} s"
  )
  for n in map(int, FLAGS.stages):
    start = time.perf_counter()
    plan = partition.plan_traced(traced, costs, n)
    plan_s = time.perf_counter() - start
    seconds = np.asarray(plan.stage_seconds)
    per_stage = np.bincount(plan.stage_of_node, minlength=n)
    print(
      f"{n} stages: plan {plan_s:.2f} s (trace + costs + plan "
      f"{trace_s + cost_s + plan_s:.2f} s); slowest / mean "
      f"{seconds.max() / seconds.mean():.3f}; nodes per stage "
      f"{per_stage.min()}-{per_stage.max()}"
    )


if __name__ == "__main__":
  app.run(main)
