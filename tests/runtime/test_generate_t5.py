"""``Pipeline.generate`` of an encoder-decoder: HuggingFace's tiny T5
(v1.0 and v1.1, the weights whose logits jpipe matches), the encoder
once, then the decoder one token at a time with its self- and cross-
attention keys and values cached on each block's stage; against a
single-device greedy loop that reruns the whole model every step."""

import functools
import os

import jax
import numpy as np
import optax
import pytest

import jpipe
from jpipe.models import gnmt, t5_v1
from tests.models import hf_loading
from tests.models.test_t5_v1 import TINY
from tests.tiers import slow

REFERENCE = os.path.join(
  os.path.dirname(__file__), "..", "models", "hf_reference"
)


def _model(version, scale=8.0):
  directory = os.path.join(REFERENCE, f"t5-v{version}")
  ref = np.load(os.path.join(directory, "reference.npz"))
  model = t5_v1.Model(**TINY, dropout=0.0, version=version)
  params = hf_loading.load(
    model, t5_v1.hf_names(model), directory, ref["inputs"], ref["targets"]
  )
  # Scaled: the tiny random model's greedy continuations are one token
  # repeated; these vary (and are as exact a check).
  params = jax.tree.map(lambda x: scale * np.asarray(x), params)
  # Four sources (two padded), two microbatches of two.
  inputs = ref["inputs"]
  shifted = np.where(inputs > 0, (inputs + 7) % 299 + 1, 0)
  sources = np.concatenate([inputs, shifted]).astype(np.int32)
  return model, params, sources, ref["targets"]


def _greedy_recomputing(model, params, sources, steps):
  """The reference: every step the whole model (encoder and decoder)
  on the tokens so far; the argmax at the last position appended."""
  forward = jax.jit(
    lambda p, x, y: model.apply({"params": p}, x, y, train=False)
  )
  # The decoder reads its targets shifted right: position t sees the
  # tokens before it (later positions, causal, change nothing there:
  # one length, one compile).
  targets = np.zeros((len(sources), steps), np.int32)
  for t in range(steps):
    logits = np.asarray(forward(params, sources, targets))
    targets[:, t] = np.argmax(logits[:, t], -1)
  return targets


def _loss_fn(model):
  def loss_fn(params, batch):
    logits = model.apply(
      {"params": params}, batch["x"], batch["y"], train=False
    )
    return optax.softmax_cross_entropy_with_integer_labels(
      logits, batch["y"]
    ).mean()

  return loss_fn


def _pipeline(model, params, sources, targets, stages, **options):
  batch = {"x": sources, "y": np.concatenate([targets, targets])}
  pipe = jpipe.Pipeline(
    _loss_fn(model),
    params,
    batch,
    num_stages=stages,
    num_microbatches=2,
    optimizer=optax.sgd(0.0),
    devices=jax.devices()[:stages],
    **options,
  )
  return pipe, pipe.init(params)


def _generate_t5(pipe, state, model, sources):
  prefill_fn, decode_fn = t5_v1.decode_fns(model)
  return pipe.generate(
    state,
    sources,
    decode_fn,
    functools.partial(t5_v1.empty_cache, model, source_length=sources.shape[1]),
    max_new_tokens=6,
    prefill_fn=prefill_fn,
  )


@pytest.mark.parametrize(
  "version,stages",
  [
    slow("1.1", 1, id="1.1-1"),
    ("1.1", 2),
    slow("1.0", 2, id="1.0-2"),
    slow("1.1", 4, id="1.1-4"),
  ],
)
def test_t5_through_stages_equals_recomputing_greedy(version, stages):
  model, params, sources, targets = _model(version)
  pipe, state = _pipeline(model, params, sources, targets, stages)
  assert len(pipe.stages.specs) == stages
  got = _generate_t5(pipe, state, model, sources)
  want = _greedy_recomputing(model, params, sources, 6)
  np.testing.assert_array_equal(np.asarray(got), want)
  # A real decode: the continuations differ across sources and steps.
  assert len({tuple(row) for row in want}) == 4
  assert len(set(want[0])) > 1


def test_t5_cut_inside_cross_attention_equals_recomputing_greedy():
  """Stages finer than layers (FTPipe's mixed pipe cuts so): the loss's
  first decoder block cut between its cross-attention's value projection
  and the attention. A cached step skips the key and value projections,
  so the attention's own code after them is named by another call count
  than the loss's; it still goes after the attention it reads."""
  model, params, sources, targets = _model("1.1")
  batch = {"x": sources, "y": np.concatenate([targets, targets])}
  names = jpipe.partition.trace(
    _loss_fn(model), params, batch, depth=3
  ).node_names
  cut = names.index("decoder_block_0/cross_attention/v") + 1
  assert names[cut].startswith("decoder_block_0/cross_attention#")
  split = jpipe.partition.Split(nodes_per_stage=(cut, len(names) - cut))
  pipe, state = _pipeline(
    model, params, sources, targets, 2, partition=split, depth=3
  )
  got = _generate_t5(pipe, state, model, sources)
  want = _greedy_recomputing(model, params, sources, 6)
  np.testing.assert_array_equal(np.asarray(got), want)


def test_t5_cached_steps_equal_the_full_model():
  """The model alone: the prefill and cached steps give the logits of
  the whole model on the same decoder inputs (float tolerance)."""
  model, params, sources, targets = _model("1.1", scale=1.0)
  targets = np.concatenate([targets, targets])
  full = model.apply({"params": params}, sources, targets, train=False)
  shifted = np.pad(targets, ((0, 0), (1, 0)))[:, :-1]
  prefill_fn, decode_fn = t5_v1.decode_fns(model)
  cache = t5_v1.empty_cache(model, 4, targets.shape[1], sources.shape[1])
  for i in range(targets.shape[1]):
    batch = {
      "inputs": sources,
      "tokens": shifted[:, i : i + 1],
      "index": np.full(4, i, np.int32),
      "cache": cache,
    }
    logits, cache = (prefill_fn if i == 0 else decode_fn)(params, batch)
    np.testing.assert_allclose(logits, full[:, i], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("stages", [2, slow(4, id="4")])
def test_gnmt_through_stages_equals_recomputing_greedy(stages):
  """GNMT: each decoder LSTM's state and the attention's encoder outputs
  cached on their stages (an LSTM's cache is its last state)."""
  model = gnmt.Model(vocab_size=40, hidden=16, num_layers=3, dropout=0.0)
  rng = np.random.RandomState(0)
  sources = rng.randint(1, 40, (4, 9)).astype(np.int32)
  sources[1, 6:] = 0
  targets = rng.randint(1, 40, (2, 5)).astype(np.int32)
  params = model.init(jax.random.key(0), sources, targets[[0, 1, 0, 1]])
  params = params["params"]
  pipe, state = _pipeline(model, params, sources, targets, stages)
  assert len(pipe.stages.specs) == stages
  prefill_fn, decode_fn = gnmt.decode_fns(model)
  got = pipe.generate(
    state,
    sources,
    decode_fn,
    functools.partial(gnmt.empty_cache, model, source_length=9),
    max_new_tokens=6,
    prefill_fn=prefill_fn,
  )
  want = _greedy_recomputing(model, params, sources, 6)
  np.testing.assert_array_equal(np.asarray(got), want)
  assert len({tuple(row) for row in want}) == 4
