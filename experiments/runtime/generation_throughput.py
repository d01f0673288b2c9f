r"""Greedy decoding throughput through 1, 2 and 4 stages, with and
without the key/value cache.

A GPT-2-shaped model (``--layers`` blocks of width ``--width``) is built
into pipelines of 1, 2 and 4 stages (one device each, ``--microbatches``
microbatches of the ``--batch`` prompts), then the prompts are
continued by ``--new`` tokens twice per pipeline:

- cache: ``Pipeline.generate`` -- the prompts once (prefill), then one
  token per step through the stages, each block's keys and values kept
  on its stage;
- no cache: every step the whole sequence so far forward through the
  stages (``Pipeline.predict`` of its last position's argmax), as a
  model without a cache must.

Each is run once to compile (every length, for the no-cache path) and
then timed (``--repeats``, the median). Tokens/s: generated tokens
(batch x new) over the timed seconds; both give the same tokens (checked).

Writes results/generation_throughput_<platform>.{md,json}.

Usage: python -m experiments.runtime.generation_throughput [--new 32]
"""

import functools
import json
import os
import time

from jpipe.train.host_devices import default_cpu_device_count

default_cpu_device_count(8)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from absl import app, flags  # noqa: E402

import jpipe  # noqa: E402
from jpipe.models import gpt2  # noqa: E402

OUT = os.path.join(os.path.dirname(__file__), "results")
flags.DEFINE_integer("width", 256, "d_model")
flags.DEFINE_integer("layers", 8, "transformer blocks")
flags.DEFINE_integer("vocab", 2048, "vocabulary size")
flags.DEFINE_integer("batch", 8, "prompts")
flags.DEFINE_integer("microbatches", 4, "microbatches of the prompts")
flags.DEFINE_integer("prompt", 16, "prompt tokens")
flags.DEFINE_integer("new", 32, "generated tokens per prompt")
flags.DEFINE_integer("repeats", 3, "timed runs (median)")
FLAGS = flags.FLAGS


def _pipeline(model, params, prompts, stages):
  def loss_fn(params, batch):
    logits = model.apply({"params": params}, batch, train=False)
    return optax.softmax_cross_entropy_with_integer_labels(
      logits[:, :-1], batch[:, 1:]
    ).mean()

  pipe = jpipe.Pipeline(
    loss_fn,
    params,
    prompts,
    num_stages=stages,
    num_microbatches=FLAGS.microbatches,
    optimizer=optax.sgd(0.0),
    devices=jax.devices()[:stages],
  )
  return pipe, pipe.init(params)


def _without_cache(pipe, state, model, prompts, predict_fn):
  seq = prompts
  for _ in range(FLAGS.new):
    nxt = np.asarray(pipe.predict(state, seq, predict_fn))
    seq = np.concatenate([seq, nxt[:, None].astype(seq.dtype)], axis=1)
  return seq[:, prompts.shape[1] :]


def _timed(run):
  out = run()  # Compiles.
  times = []
  for _ in range(FLAGS.repeats):
    start = time.perf_counter()
    again = run()
    times.append(time.perf_counter() - start)
    np.testing.assert_array_equal(again, out)
  return out, float(np.median(times))


def main(_):
  model = gpt2.Model(
    vocab_size=FLAGS.vocab,
    n_positions=FLAGS.prompt + FLAGS.new,
    d_model=FLAGS.width,
    num_layers=FLAGS.layers,
    num_heads=max(FLAGS.width // 64, 1),
    dropout=0.0,
  )
  prompts = (
    np.random.RandomState(0)
    .randint(0, FLAGS.vocab, (FLAGS.batch, FLAGS.prompt))
    .astype(np.int32)
  )
  params = model.init(jax.random.key(0), prompts[:1], train=False)["params"]
  # A fresh wrapper per stage count would recompile; one function.
  decode = gpt2.decode_fn(model)

  def predict_fn(params, batch):
    logits = model.apply({"params": params}, batch, train=False)
    return jnp.argmax(logits[:, -1], axis=-1).astype(jnp.int32)

  rows, tokens = [], FLAGS.batch * FLAGS.new
  for stages in (1, 2, 4):
    pipe, state = _pipeline(model, params, prompts, stages)
    cached, t_cache = _timed(
      lambda p=pipe, s=state: np.asarray(
        p.generate(
          s,
          prompts,
          decode,
          functools.partial(gpt2.empty_cache, model),
          max_new_tokens=FLAGS.new,
        )
      )
    )
    recomputed, t_full = _timed(
      lambda p=pipe, s=state: _without_cache(p, s, model, prompts, predict_fn)
    )
    np.testing.assert_array_equal(cached, recomputed)
    rows.append(
      dict(
        stages=stages,
        cache_s=t_cache,
        no_cache_s=t_full,
        cache_tokens_per_s=tokens / t_cache,
        no_cache_tokens_per_s=tokens / t_full,
      )
    )
    print(rows[-1], flush=True)
  _write(rows, model)


def _write(rows, model):
  platform = jax.devices()[0].platform
  config = {
    k: FLAGS[k].value
    for k in (
      "width",
      "layers",
      "vocab",
      "batch",
      "microbatches",
      "prompt",
      "new",
    )
  }
  os.makedirs(OUT, exist_ok=True)
  base = os.path.join(OUT, f"generation_throughput_{platform}")
  with open(base + ".json", "w") as f:
    json.dump({"config": config, "rows": rows}, f, indent=1)
  lines = [
    f"GPT-2 shape {config}, {jax.devices()[0].device_kind}",
    "",
    "| stages | cache: s | tokens/s | no cache: s | tokens/s | speed-up |",
    "| --- | --- | --- | --- | --- | --- |",
  ]
  for r in rows:
    lines.append(
      f"| {r['stages']} | {r['cache_s']:.3f} | {r['cache_tokens_per_s']:.0f} "
      f"| {r['no_cache_s']:.3f} | {r['no_cache_tokens_per_s']:.0f} "
      f"| {r['no_cache_s'] / r['cache_s']:.1f}x |"
    )
  with open(base + ".md", "w") as f:
    f.write("\n".join(lines) + "\n")
  print("\n".join(lines))


if __name__ == "__main__":
  app.run(main)
