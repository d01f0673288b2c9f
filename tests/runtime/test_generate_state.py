"""``Pipeline.generate`` of a model with state: GPT-2 whose logits pass a
BatchNorm (running statistics, ``batch_stats``), decoded with
``decode_fn(params, model_state, batch)`` after a training step moved
the statistics; equal to a single-device greedy loop at the gathered
params and statistics, which the decoding reads and leaves unchanged."""

import functools

import flax.linen as nn
import jax
import numpy as np
import optax
import pytest

import jpipe
from jpipe.models import gpt2
from tests.runtime.test_generate import TINY


class _NormedLm(nn.Module):
  """GPT-2's logits through a BatchNorm over the vocabulary."""

  @nn.compact
  def __call__(self, tokens, train, **cache_args):
    out = gpt2.Model(**TINY, dropout=0.0, name="lm")(
      tokens, train=train, **cache_args
    )
    logits, cache = out if cache_args else (out, None)
    # Momentum 0: the statistics become the last step's (they move far).
    norm = nn.BatchNorm(
      use_running_average=not train, momentum=0.0, name="norm"
    )
    logits = norm(logits)
    return logits if cache is None else (logits, cache)


def _loss_fn(model):
  def loss_fn(params, stats, batch):
    logits, new = model.apply(
      {"params": params, "batch_stats": stats},
      batch["x"],
      train=True,
      mutable=["batch_stats"],
    )
    loss = optax.softmax_cross_entropy_with_integer_labels(
      logits[:, :-1], batch["x"][:, 1:]
    ).mean()
    return loss, new["batch_stats"]

  return loss_fn


def _decode_fn(model):
  def decode(params, stats, batch):
    logits, cache = model.apply(
      {"params": params, "batch_stats": stats},
      batch["tokens"],
      train=False,
      cache=batch["cache"],
      index=batch["index"][0],
      pad=batch["pad"],
    )
    return logits[:, -1], cache

  return decode


def _greedy(model, params, stats, prompts, steps):
  forward = jax.jit(
    lambda p, s, x: model.apply({"params": p, "batch_stats": s}, x, False)
  )
  seq = np.asarray(prompts)
  for _ in range(steps):
    nxt = np.argmax(np.asarray(forward(params, stats, seq))[:, -1], axis=-1)
    seq = np.concatenate([seq, nxt[:, None].astype(seq.dtype)], axis=1)
  return seq[:, prompts.shape[1] :]


@pytest.mark.slow
def test_generate_reads_model_state_on_its_stage():
  model = _NormedLm()
  prompts = np.random.RandomState(0).randint(0, 64, (4, 5)).astype(np.int32)
  variables = model.init(jax.random.key(0), prompts, train=False)
  pipe = jpipe.Pipeline(
    _loss_fn(model),
    variables["params"],
    {"x": prompts},
    num_stages=2,
    num_microbatches=2,
    optimizer=optax.sgd(0.1),
    devices=jax.devices()[:2],
    model_state=variables["batch_stats"],
  )
  state = pipe.init(variables["params"], variables["batch_stats"])
  state, _ = pipe.step(state, {"x": prompts})  # The statistics move.
  params, stats = pipe.gather_params(state), pipe.gather_model_state(state)
  moved = jax.tree.leaves(variables["batch_stats"])
  assert any(
    not np.allclose(a, b)
    for a, b in zip(moved, jax.tree.leaves(stats), strict=True)
  )
  got = pipe.generate(
    state,
    prompts,
    _decode_fn(model),
    functools.partial(gpt2.empty_cache, gpt2.Model(**TINY)),
    max_new_tokens=6,
  )
  want = _greedy(model, params, stats, prompts, 6)
  np.testing.assert_array_equal(np.asarray(got), want)
  assert len({tuple(row) for row in want}) > 1
  # The statistics matter: the initial ones decode otherwise.
  initial = variables["batch_stats"]
  assert (_greedy(model, params, initial, prompts, 6) != want).any()
  after = pipe.gather_model_state(state)
  for a, b in zip(jax.tree.leaves(stats), jax.tree.leaves(after), strict=True):
    np.testing.assert_array_equal(a, b)
