"""One process of the generation-across-processes test (or the
one-process reference): greedy decoding through a pipeline's stages,
the tokens written by process 0.

  python tests/distributed/generate_worker.py OUT.npz

Under ``jpipe.launch`` stage s runs on process s's device; without the
launcher's environment it is the one-process reference on
JPIPE_CPU_DEVICES devices. Two decodings:

- "gpt2": jpipe's GPT-2, prompts of different lengths (left-padded), an
  end token that ends some sequences early (the token row 0 generates
  second on one device, so every process knows it without decoding);
- "seq2seq": an encoder-decoder on Flax's own decoding cache whose every
  decoder block reads the encoder's outputs from the cache (a cache leaf
  copied to readers on other processes);
- "scanned": nn.scan-ed blocks, their stacked cache as rows on the
  stages of their layers, the prompt fed one position per call.
"""

import functools
import os
import sys

from jpipe import distributed

distributed.initialize()

import jax  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))
import jpipe  # noqa: E402
from jpipe.models import gpt2  # noqa: E402
from tests.runtime import test_generate_flax_cache as flax_cache  # noqa: E402

STAGES = 3


def _pipeline(loss_fn, params, batch):
  return jpipe.Pipeline(
    loss_fn,
    params,
    batch,
    num_stages=STAGES,
    num_microbatches=2,
    optimizer=optax.sgd(0.0),
    devices=jax.devices()[:STAGES],
    partition="contiguous",
  )


def gpt2_tokens():
  model = gpt2.Model(
    vocab_size=64, n_positions=32, d_model=16, num_layers=4, num_heads=2
  )
  rng = np.random.RandomState(0)
  x = rng.randint(0, 64, (4, 6)).astype(np.int32)
  params = model.init(jax.random.key(0), x, train=False)["params"]

  def loss_fn(params, batch):
    logits = model.apply({"params": params}, batch["x"], train=False)
    return optax.softmax_cross_entropy_with_integer_labels(
      logits[:, :-1], batch["x"][:, 1:]
    ).mean()

  # Row 0's second token on one device (no pipeline): the end token.
  seq = x[:1, :5]
  for _ in range(2):
    logits = model.apply({"params": params}, seq, train=False)
    seq = np.concatenate([seq, np.argmax(logits[:, -1:], -1)], axis=1)
  eos = int(seq[0, -1])
  prompts = [x[0, :5], x[1, :3], x[2, :5], x[3, :2]]
  pipe = _pipeline(loss_fn, params, {"x": x})
  return pipe.generate(
    pipe.init(params),
    prompts,
    gpt2.decode_fn(model),
    functools.partial(gpt2.empty_cache, model),
    max_new_tokens=6,
    eos_id=eos,
  )


def seq2seq_tokens():
  sources = jax.random.randint(jax.random.key(1), (4, flax_cache.SOURCE), 0, 16)
  targets = jax.random.randint(jax.random.key(2), (4, 6), 0, 16)
  model = flax_cache.SEQ2SEQ
  params = model.init(jax.random.key(0), sources, targets)["params"]

  def loss_fn(params, batch):
    logits = model.apply({"params": params}, batch["x"], batch["y"])
    return optax.softmax_cross_entropy_with_integer_labels(
      logits, batch["y"]
    ).mean()

  pipe = _pipeline(loss_fn, params, {"x": sources, "y": targets})
  return pipe.generate(
    pipe.init(params),
    np.asarray(sources),
    flax_cache._seq2seq_step_fn,
    flax_cache._seq2seq_empty_cache,
    max_new_tokens=4,
    prefill_fn=flax_cache._seq2seq_prefill,
  )


def scanned_tokens():
  x = jax.random.randint(jax.random.key(1), (4, 6), 0, 16)
  params = flax_cache.SCANNED.init(jax.random.key(0), x)["params"]
  pipe = _pipeline(
    flax_cache._next_token_loss(flax_cache.SCANNED), params, {"x": x}
  )
  return pipe.generate(
    pipe.init(params),
    np.asarray(x[:, :3]),
    flax_cache._one_position_decode_fn(flax_cache.SCANNED_DECODE),
    flax_cache._empty_cache_of(flax_cache.SCANNED_DECODE),
    max_new_tokens=3,
    one_position=True,
  )


def main():
  out = {
    "gpt2": np.asarray(gpt2_tokens()),
    "seq2seq": np.asarray(seq2seq_tokens()),
    "scanned": np.asarray(scanned_tokens()),
  }
  # Every process has the tokens: each writes its own copy to compare.
  np.savez(f"{sys.argv[1]}.p{jax.process_index()}.npz", **out)
  print(f"process {jax.process_index()}: generated {out['gpt2'].shape}")


if __name__ == "__main__":
  main()
