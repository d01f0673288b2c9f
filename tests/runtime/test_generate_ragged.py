"""``Pipeline.generate`` of prompts of different lengths in one batch:
GPT-2's left-padded (each row's positions from its first token, its
padding slots masked), T5's and GNMT's sources right-padded (the
encoder masks them); each row equals its prompt generated alone by a
single-device greedy loop that reruns the whole model every step."""

import functools

import jax
import numpy as np
import pytest

from jpipe.models import gnmt, gpt2, t5_v1
from jpipe.runtime.execute import generation
from tests.runtime import test_generate, test_generate_t5


def _gpt2_alone(model, params, prompts, steps):
  """The reference: each prompt on its own, the whole sequence through
  the model every step (one shape per prompt: the tokens not written yet
  are zeros after the last, which causal attention never reads)."""
  forward = jax.jit(lambda p, x: model.apply({"params": p}, x, train=False))
  out = []
  for prompt in prompts:
    n, seq = len(prompt), np.zeros((1, len(prompt) + steps), np.int32)
    seq[0, :n] = prompt
    for t in range(steps):
      logits = np.asarray(forward(params, seq))
      seq[0, n + t] = np.argmax(logits[0, n + t - 1])
    out.append(seq[0, n:])
  return np.stack(out)


def _encoder_decoder_alone(model, params, sources, steps):
  """The reference: each source on its own, encoder and decoder on the
  tokens so far every step (the decoder's later inputs zeros: causal)."""
  forward = jax.jit(
    lambda p, x, y: model.apply({"params": p}, x, y, train=False)
  )
  out = np.zeros((len(sources), steps), np.int32)
  for row, source in enumerate(sources):
    for t in range(steps):
      # The decoder reads its targets shifted right: position t sees out.
      logits = np.asarray(forward(params, source[None], out[row : row + 1]))
      out[row, t] = np.argmax(logits[0, t])
  return out


def _ragged(rows, lengths):
  return [
    np.asarray(r[:n], np.int32) for r, n in zip(rows, lengths, strict=True)
  ]


def test_gpt2_prompts_of_different_lengths_equal_each_alone():
  model, params, prompts = test_generate._tiny()
  ragged = _ragged(prompts, (5, 2, 4, 1))
  pipe, state = test_generate._pipeline(model, params, prompts, 2)
  got = np.asarray(test_generate._generate(pipe, state, model, ragged, 6))
  want = _gpt2_alone(model, params, ragged, 6)
  np.testing.assert_array_equal(got, want)
  # Not the rows of the padded array read as if unpadded.
  padded, pad = generation.padded_prompts(ragged, encoder_decoder=False)
  np.testing.assert_array_equal(pad, [0, 3, 1, 4])
  np.testing.assert_array_equal(padded[1], [0, 0, 0, *prompts[1, :2]])
  unaware = _gpt2_alone(model, params, padded, 6)
  assert (unaware != want).any()


def test_a_decode_fn_without_pad_is_refused_for_ragged_prompts():
  model, params, prompts = test_generate._tiny()
  pipe, state = test_generate._pipeline(model, params, prompts, 1)

  def no_pad(params, batch):
    logits, cache = model.apply(
      {"params": params},
      batch["tokens"],
      train=False,
      cache=batch["cache"],
      index=batch["index"][0],
    )
    return logits[:, -1], cache

  ragged = _ragged(prompts, (5, 2, 4, 1))
  with pytest.raises(ValueError, match=r"must read batch\['pad'\]"):
    pipe.generate(
      state,
      ragged,
      no_pad,
      functools.partial(gpt2.empty_cache, model),
      max_new_tokens=2,
    )
  with pytest.raises(ValueError, match="non-empty 1-D"):
    test_generate._generate(
      pipe, state, model, [prompts[0], prompts[1, :0]] * 2, 2
    )


def _encoder_decoder(module, model, params, sources, targets, steps):
  ragged = [s[s > 0] for s in sources]
  width = max(len(s) for s in ragged)
  pipe, state = test_generate_t5._pipeline(model, params, sources, targets, 2)
  prefill_fn, decode_fn = module.decode_fns(model)
  got = pipe.generate(
    state,
    ragged,
    decode_fn,
    functools.partial(module.empty_cache, model, source_length=width),
    max_new_tokens=steps,
    prefill_fn=prefill_fn,
  )
  want = _encoder_decoder_alone(model, params, ragged, steps)
  np.testing.assert_array_equal(np.asarray(got), want)
  assert len({tuple(row) for row in want}) > 1


def test_t5_sources_of_different_lengths_equal_each_alone():
  model, params, sources, targets = test_generate_t5._model("1.1")
  lengths = (sources > 0).sum(1)
  assert len(set(lengths)) > 1  # The reference's sources vary.
  _encoder_decoder(t5_v1, model, params, sources, targets, 5)


@pytest.mark.slow
def test_gnmt_sources_of_different_lengths_equal_each_alone():
  model = gnmt.Model(vocab_size=40, hidden=16, num_layers=3, dropout=0.0)
  rng = np.random.RandomState(0)
  sources = rng.randint(1, 40, (4, 9)).astype(np.int32)
  for row, n in enumerate((9, 4, 7, 2)):
    sources[row, n:] = 0
  targets = rng.randint(1, 40, (2, 5)).astype(np.int32)
  params = model.init(jax.random.key(0), sources, targets[[0, 1, 0, 1]])
  _encoder_decoder(gnmt, model, params["params"], sources, targets, 5)
