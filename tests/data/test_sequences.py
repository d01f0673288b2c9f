"""LM windows and T5 span corruption against plain restatements."""

import numpy as np
import pytest

from jpipe.data import sequences


def _uncorrupt(inputs, targets, first_sentinel):
  """The original window: each sentinel in ``inputs`` replaced by the
  tokens that follow the same sentinel in ``targets``."""
  spans, current = {}, None
  for token in targets:
    if token >= first_sentinel:
      current = int(token)
      spans[current] = []
    else:
      spans[current].append(int(token))
  out = []
  for token in inputs:
    out.extend(spans[int(token)] if token >= first_sentinel else [int(token)])
  return np.asarray(out)


@pytest.mark.parametrize(
  "length, density, mean", [(128, 0.15, 3.0), (50, 0.3, 2.0), (10, 0.15, 3.0)]
)
def test_span_corruption_is_invertible_and_has_t5_lengths(
  length, density, mean
):
  rng = np.random.default_rng(1)
  tokens = rng.integers(1, 200, size=length)
  inputs, targets = sequences.span_corrupt(tokens, rng, density, mean, 300)
  noise, spans, li, lt = sequences.span_lengths(length, density, mean)
  assert noise == max(1, round(length * density))
  assert (len(inputs), len(targets)) == (li, lt)
  # Sentinels appear once each, in order, in both.
  sentinel = np.arange(300, 300 + spans)
  np.testing.assert_array_equal(inputs[inputs >= 300], sentinel)
  np.testing.assert_array_equal(targets[targets >= 300], sentinel)
  assert targets[0] == 300 and inputs[0] < 300  # Kept run first.
  np.testing.assert_array_equal(_uncorrupt(inputs, targets, 300), tokens)


def test_span_boundaries_vary_and_mean_span_length_holds():
  rng = np.random.default_rng(0)
  tokens = np.arange(1, 1001)
  lengths = []
  for _ in range(20):
    _, targets = sequences.span_corrupt(tokens, rng, 0.15, 3.0, 2000)
    starts = np.flatnonzero(targets >= 2000)
    lengths.extend(np.diff(np.append(starts, len(targets))) - 1)
  assert np.mean(lengths) == pytest.approx(3.0)
  assert len(set(lengths)) > 3


def test_lm_batch_is_a_shifted_window_and_a_function_of_seed_and_step():
  stream = np.arange(1000, dtype=np.uint8) % 251
  batch = sequences.lm_batch_at(stream, 7, 4, 16, seed=3)
  assert batch["x"].shape == (4, 16) and batch["x"].dtype == np.int32
  np.testing.assert_array_equal(batch["x"][:, 1:], batch["y"][:, :-1])
  for row_x, row_y in zip(batch["x"], batch["y"], strict=True):
    start = int(np.flatnonzero(stream == row_x[0])[0])
    np.testing.assert_array_equal(stream[start : start + 16], row_x)
    np.testing.assert_array_equal(stream[start + 1 : start + 17], row_y)
  again = sequences.lm_batch_at(stream, 7, 4, 16, seed=3)
  np.testing.assert_array_equal(batch["x"], again["x"])
  other = sequences.lm_batch_at(stream, 8, 4, 16, seed=3)
  assert not np.array_equal(batch["x"], other["x"])


def test_seq2seq_tokens_are_bytes_plus_one_and_eval_is_fixed():
  stream = np.frombuffer(b"def f(x):\n  return x * 2\n" * 20, np.uint8)
  a = sequences.seq2seq_eval_batch(stream, 32, 5, 0.15, 3.0)
  b = sequences.seq2seq_eval_batch(stream, 32, 5, 0.15, 3.0)
  np.testing.assert_array_equal(a["inputs"], b["inputs"])
  assert a["inputs"].min() >= sequences.BYTE_OFFSET  # 0 stays padding.
  first = _uncorrupt(a["inputs"][0], a["targets"][0], sequences.BYTE_VOCAB)
  np.testing.assert_array_equal(first - sequences.BYTE_OFFSET, stream[:32])


def test_a_stream_shorter_than_a_sequence_is_a_clear_error():
  with pytest.raises(ValueError, match="lower data.sequence_length"):
    sequences.lm_batch_at(np.zeros(10, np.uint8), 0, 2, 16, seed=0)
