"""``Pipeline.generate``: greedy decoding through the stages with each
layer's key/value cache on its stage, against a single-device greedy
loop that recomputes the whole prefix every step (no cache)."""

import functools
import os

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jpipe
from jpipe.models import gpt2
from tests.models import hf_loading
from tests.tiers import slow

TINY = dict(
  vocab_size=64, n_positions=32, d_model=16, num_layers=4, num_heads=2
)
HF_REFERENCE = os.path.join(
  os.path.dirname(__file__), "..", "models", "hf_reference", "gpt2"
)
HF_TINY = dict(
  vocab_size=300, n_positions=64, d_model=24, num_layers=2, num_heads=3
)


def _greedy_recomputing(model, params, prompts, steps):
  """The reference: the full sequence through the model on one device
  each step, the argmax of its last position appended."""
  forward = jax.jit(lambda p, x: model.apply({"params": p}, x, train=False))
  return greedy_at_one_length(forward, params, prompts, steps)


def greedy_at_one_length(forward, params, prompts, steps):
  """Greedy continuations [batch, steps] of a causal decoder's
  ``forward(params, tokens) -> logits``, rerun on the whole sequence each
  step at one padded length (one compile: a position's logits do not see
  the zeros after it)."""
  length = prompts.shape[1]
  seq = np.pad(np.asarray(prompts), ((0, 0), (0, steps)))
  for t in range(length, length + steps):
    logits = np.asarray(forward(params, seq))
    seq[:, t] = np.argmax(logits[:, t - 1], axis=-1)
  return seq[:, length:]


def _pipeline(model, params, prompts, stages, microbatches=2, **options):
  def loss_fn(params, batch):
    logits = model.apply({"params": params}, batch["x"], train=False)
    return optax.softmax_cross_entropy_with_integer_labels(
      logits[:, :-1], batch["x"][:, 1:]
    ).mean()

  pipe = jpipe.Pipeline(
    loss_fn,
    params,
    {"x": prompts},
    num_stages=stages,
    num_microbatches=microbatches,
    optimizer=optax.sgd(0.0),
    devices=jax.devices()[:stages],
    **options,
  )
  return pipe, pipe.init(params)


def _tiny(seed=0):
  model = gpt2.Model(**TINY, dropout=0.0)
  rng = np.random.RandomState(seed)
  prompts = rng.randint(0, TINY["vocab_size"], (4, 5)).astype(np.int32)
  params = model.init(jax.random.key(seed), prompts, train=False)["params"]
  return model, params, prompts


def _generate(pipe, state, model, prompts, steps, eos_id=None):
  return np.asarray(
    pipe.generate(
      state,
      prompts,
      gpt2.decode_fn(model),
      functools.partial(gpt2.empty_cache, model),
      max_new_tokens=steps,
      eos_id=eos_id,
    )
  )


@pytest.mark.parametrize("stages", [1, 2, slow(4, id="4")])
def test_generate_through_stages_equals_recomputing_greedy(stages):
  model, params, prompts = _tiny()
  pipe, state = _pipeline(model, params, prompts, stages)
  assert len(pipe.stages.specs) == stages
  got = _generate(pipe, state, model, prompts, 8)
  want = _greedy_recomputing(model, params, prompts, 8)
  assert got.shape == (4, 8)
  np.testing.assert_array_equal(got, want)
  # Again: the same programs (one decode function per model), no new ones.
  programs = len(pipe.forward_programs)
  np.testing.assert_array_equal(_generate(pipe, state, model, prompts, 8), want)
  assert len(pipe.forward_programs) == programs
  # The continuations differ across prompts: a real decode, not a constant.
  assert len({tuple(row) for row in got}) > 1


def test_cache_stays_on_the_stage_of_its_layer():
  """Every cache leaf is read and rewritten by the stage that holds its
  block's params (each program checks it; here: the stage's layers)."""
  model, params, prompts = _tiny()
  pipe, state = _pipeline(model, params, prompts, 2)
  _generate(pipe, state, model, prompts, 2)
  (step,) = [
    p
    for key, p in pipe.forward_programs.items()
    if key[0] != "written" and key[2][-1][0][-1:] == (1,)  # tokens [b, 1]
  ]
  names = [
    "/".join(str(k.key) for k in path)
    for path, _ in jax.tree.flatten_with_path(gpt2.empty_cache(model, 1, 2))[0]
  ]
  for k, name in enumerate(names):
    s = step.stage_of_result[1 + k]
    held = {pipe.leaf_names[i] for i in pipe.stages.specs[s].param_leaves}
    block = name.split("/")[0]
    assert any(h.startswith(block + "/") for h in held), (name, s)


def test_huggingface_gpt2_through_two_stages():
  """HuggingFace's tiny GPT-2 (the weights whose logits jpipe matches)."""
  ref = np.load(os.path.join(HF_REFERENCE, "reference.npz"))
  model = gpt2.Model(**HF_TINY, dropout=0.0)
  params = hf_loading.load(
    model, gpt2.hf_names(model), HF_REFERENCE, ref["tokens"]
  )
  prompts = ref["tokens"][:, :6].astype(np.int32)
  pipe, state = _pipeline(model, params, prompts, 2)
  np.testing.assert_array_equal(
    _generate(pipe, state, model, prompts, 6),
    _greedy_recomputing(model, params, prompts, 6),
  )


def test_eos_ends_a_sequence_and_all_ends_stop_decoding():
  model, params, prompts = _tiny()
  pipe, state = _pipeline(model, params, prompts, 2)
  want = _greedy_recomputing(model, params, prompts, 8)
  eos = int(want[0, 2])  # Sequence 0 ends at step 2 (or earlier).
  got = _generate(pipe, state, model, prompts, 8, eos_id=eos)
  for row, ref in zip(got, want, strict=False):
    hits = np.flatnonzero(ref == eos)
    end = hits[0] + 1 if len(hits) else len(ref)
    np.testing.assert_array_equal(row[:end], ref[: len(row)][:end])
    assert (row[end:] == eos).all()
  # Every sequence ended by the first step: one step kept, not eight.
  first = int(want[0, 0])
  ones = np.repeat(prompts[:1], 4, axis=0)
  got = _generate(pipe, state, model, ones, 8, eos_id=first)
  np.testing.assert_array_equal(got, np.full((4, 1), first))


def test_prompts_that_do_not_split_decode_as_their_own():
  """3 and 1 prompts with microbatches of 2: copies of the last prompt
  fill the last microbatch and are dropped; each row as a full batch's."""
  model, params, prompts = _tiny()
  pipe, state = _pipeline(model, params, prompts, 2)
  want = _greedy_recomputing(model, params, prompts, 4)
  for n in (3, 1):
    got = _generate(pipe, state, model, prompts[:n], 4)
    np.testing.assert_array_equal(got, want[:n])
  with pytest.raises(ValueError, match="n_positions"):
    _generate(pipe, state, model, prompts, 40)


@pytest.mark.parametrize("stages", [2, slow(3, id="3")])
def test_scanned_layers_generate_as_recomputing_greedy(stages):
  """scan_layers=True: params and the KV cache stacked by layer, the
  scan split by layer over the stages, each layer's cache rows on its
  stage (``execute/cache_rows.py``); the prompt in one prefill call."""
  model = gpt2.Model(**TINY, dropout=0.0, scan_layers=True)
  prompts = np.random.RandomState(0).randint(0, 64, (4, 5)).astype(np.int32)
  params = model.init(jax.random.key(0), prompts, train=False)["params"]
  pipe, state = _pipeline(model, params, prompts, stages)
  assert pipe.traced.param_layout is not None  # Split by layer.
  np.testing.assert_array_equal(
    _generate(pipe, state, model, prompts, 4),
    _greedy_recomputing(model, params, prompts, 4),
  )


def test_decoding_step_with_cache_equals_full_forward():
  """The model alone: prefill then single tokens against the cache give
  the logits of the whole sequence (float tolerance)."""
  model, params, prompts = _tiny()
  seq = np.concatenate([prompts, prompts[:, :3]], axis=1)
  full = model.apply({"params": params}, seq, train=False)
  decode = jax.jit(gpt2.decode_fn(model))
  cache = gpt2.empty_cache(model, 4, seq.shape[1])
  pad = {"pad": jnp.zeros(4, jnp.int32)}
  batch = {"tokens": seq[:, :5], "index": jnp.zeros(4, jnp.int32)} | pad
  logits, cache = decode(params, batch | {"cache": cache})
  np.testing.assert_allclose(logits, full[:, 4], atol=1e-5)
  for i in range(5, seq.shape[1]):
    batch = {"tokens": seq[:, i : i + 1], "index": jnp.full(4, i, jnp.int32)}
    batch |= pad
    logits, cache = decode(params, batch | {"cache": cache})
    np.testing.assert_allclose(logits, full[:, i], atol=1e-5)
