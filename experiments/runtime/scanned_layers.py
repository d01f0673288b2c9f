r"""A scanned GPT against the same model unrolled, in a 4-stage pipeline.

A plain-JAX GPT of ``--layers`` layers (width ``--width``), written twice:
its layers under one ``jax.lax.scan`` over stacked params (as production
JAX code writes them), and unrolled (a Python loop, one
``jax.named_scope`` per layer, so both trace to the same nodes and take
the same plan). Each is built as a 1F1B pipeline of ``--stages`` stages
on fake CPU devices; printed per model: the build time (trace, plan,
compile), the first step (its programs compiled), the median of
``--steps`` later steps, and whether the two train alike.

Usage: python -m experiments.runtime.scanned_layers
"""

from jpipe.train.host_devices import default_cpu_device_count

default_cpu_device_count(4)

import time  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from absl import app, flags  # noqa: E402

import jpipe  # noqa: E402

FLAGS = flags.FLAGS
flags.DEFINE_integer("layers", 16, "Layers.")
flags.DEFINE_integer("width", 256, "Model width d (4 heads, MLP 4d).")
flags.DEFINE_integer("seq", 64, "Tokens per example.")
flags.DEFINE_integer("batch", 16, "Examples per step (4 microbatches).")
flags.DEFINE_integer("stages", 4, "Pipeline stages.")
flags.DEFINE_integer("steps", 5, "Timed steps after the first.")
VOCAB, HEADS = 512, 4


def _params(layers, d):
  k = jax.random.split(jax.random.key(0), 8)

  def w(key, *shape):
    return jax.random.normal(key, shape) * shape[-2] ** -0.5

  return {
    "emb": jax.random.normal(k[0], (VOCAB, d)) * 0.02,
    "layers": {
      "ln1": jnp.ones((layers, d)),
      "ln2": jnp.ones((layers, d)),
      "qkv": w(k[1], layers, d, 3 * d),
      "out": w(k[2], layers, d, d),
      "up": w(k[3], layers, d, 4 * d),
      "down": w(k[4], layers, 4 * d, d),
    },
    "head": w(k[5], d, VOCAB),
  }


def _norm(x, g):
  x = x - x.mean(-1, keepdims=True)
  return x * jax.lax.rsqrt((x * x).mean(-1, keepdims=True) + 1e-5) * g


def _layer(x, p):
  b, t, d = x.shape
  qkv = _norm(x, p["ln1"]) @ p["qkv"]
  q, k, v = jnp.split(qkv.reshape(b, t, 3 * HEADS, d // HEADS), 3, axis=2)
  att = jax.nn.dot_product_attention(q, k, v, is_causal=True)
  x = x + att.reshape(b, t, d) @ p["out"]
  return x + jax.nn.gelu(_norm(x, p["ln2"]) @ p["up"]) @ p["down"], None


def _xent(x, params, y):
  logp = jax.nn.log_softmax(x @ params["head"])
  return -jnp.mean(jnp.take_along_axis(logp, y[..., None], -1))


def scanned_loss(params, batch):
  x = params["emb"][batch["x"]]
  x, _ = jax.lax.scan(_layer, x, params["layers"])
  return _xent(x, params, batch["y"])


def unrolled_loss(params, batch):
  x = params["emb"][batch["x"]]
  for k, p in enumerate(params["layers"]):
    with jax.named_scope(f"scan[{k}]"):
      x, _ = _layer(x, p)
  return _xent(x, params, batch["y"])


def _unrolled(params):
  layers = params["layers"]
  n = jax.tree.leaves(layers)[0].shape[0]
  return {
    **params,
    "layers": [jax.tree.map(lambda x, k=k: x[k], layers) for k in range(n)],
  }


def _run(loss_fn, params, batch, partition):
  start = time.perf_counter()
  pipe = jpipe.Pipeline(
    loss_fn,
    params,
    batch,
    num_stages=FLAGS.stages,
    devices=jax.devices()[: FLAGS.stages],
    schedule="1f1b",
    num_microbatches=4,
    optimizer=optax.adam(1e-3),
    partition=partition,
  )
  state = pipe.init(params)
  build = time.perf_counter() - start
  start = time.perf_counter()
  state, m = pipe.step(state, batch)
  float(m["loss"])
  first = time.perf_counter() - start
  times = []
  for _ in range(FLAGS.steps):
    start = time.perf_counter()
    state, m = pipe.step(state, batch)
    float(m["loss"])
    times.append(time.perf_counter() - start)
  return pipe, state, build, first, float(np.median(times))


def main(argv):
  del argv
  params = _params(FLAGS.layers, FLAGS.width)
  tokens = np.random.RandomState(0).randint(0, VOCAB, (FLAGS.batch, FLAGS.seq))
  batch = {"x": jnp.asarray(tokens), "y": jnp.asarray((tokens + 1) % VOCAB)}
  scanned = _run(scanned_loss, params, batch, "contiguous")
  plan = scanned[0].plan
  unrolled = _run(unrolled_loss, _unrolled(params), batch, plan)
  print(
    f"{FLAGS.layers}-layer GPT, d = {FLAGS.width}, {FLAGS.stages} stages "
    f"(layers per stage {np.bincount(plan.stage_of_node).tolist()}), "
    f"1F1B, 4 microbatches of {FLAGS.batch // 4} x {FLAGS.seq} tokens"
  )
  print("model     build s  first step s  step s (median)")
  for name, (_, _, build, first, step) in (
    ("scanned", scanned),
    ("unrolled", unrolled),
  ):
    print(f"{name:8}  {build:7.2f}  {first:12.2f}  {step:15.4f}")
  a = scanned[0].gather_params(scanned[1])
  b = unrolled[0].gather_params(unrolled[1])
  b = {**b, "layers": jax.tree.map(lambda *x: np.stack(x), *b["layers"])}
  diff = max(
    float(np.abs(np.asarray(x) - np.asarray(y)).max())
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True)
  )
  print(f"largest param difference after {FLAGS.steps + 1} steps: {diff:.2e}")


if __name__ == "__main__":
  app.run(main)
