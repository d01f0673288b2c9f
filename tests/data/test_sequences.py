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


def test_lm_eval_windows_score_each_target_token_once():
  """Held-out windows of ``length`` targets, ``length`` apart: all that fit
  (count 0 or more than fit: every target token from 1 to fit * length
  scored exactly once, the short tail not at all) or ``count`` spread
  evenly (the plain restatement: window round(k * (fit - 1) / (count -
  1)))."""
  stream = (np.arange(300) * 7 % 256).astype(np.uint8)
  fit = (300 - 17) // 16 + 1  # 18 windows of 17 tokens, 16 apart.
  for count in (0, fit, 1000):
    got = sequences.lm_eval_windows(stream, 16, count)
    assert got["x"].shape == (fit, 16) and got["x"].dtype == np.int32
    scored = np.zeros(300, int)
    for row in range(fit):
      np.testing.assert_array_equal(
        got["x"][row], stream[row * 16 : row * 16 + 16]
      )
      np.testing.assert_array_equal(
        got["y"][row], stream[row * 16 + 1 : row * 16 + 17]
      )
      scored[row * 16 + 1 : row * 16 + 17] += 1
    assert set(scored[1 : fit * 16 + 1]) == {1} and scored.sum() == fit * 16
  got = sequences.lm_eval_windows(stream, 16, 5)
  starts = [16 * round(k * (fit - 1) / 4) for k in range(5)]
  for row, start in enumerate(starts):
    np.testing.assert_array_equal(got["x"][row], stream[start : start + 16])
  with pytest.raises(ValueError, match="lower data.sequence_length"):
    sequences.lm_eval_windows(np.zeros(16, np.uint8), 16, 2)


def test_seq2seq_eval_windows_do_not_overlap():
  stream = np.frombuffer(b"def f(x):\n  return x * 2\n" * 20, np.uint8)
  fit = len(stream) // 32
  every = sequences.seq2seq_eval_batch(stream, 32, 0, 0.15, 3.0)
  assert len(every["inputs"]) == fit
  for row in range(fit):
    original = _uncorrupt(
      every["inputs"][row], every["targets"][row], sequences.BYTE_VOCAB
    )
    np.testing.assert_array_equal(
      original - sequences.BYTE_OFFSET, stream[row * 32 : row * 32 + 32]
    )


def test_seq2seq_batch_of_a_step_is_its_seeded_windows_corrupted():
  """The batch of ``step``: windows drawn by the generator seeded with
  (seed, step), then corrupted by the same generator; a function of seed
  and step."""
  stream = np.frombuffer(b"the quick brown fox jumps over it. " * 30, np.uint8)
  args = dict(batch_size=3, length=24, noise_density=0.15, mean_span_length=3.0)
  got = sequences.seq2seq_batch_at(stream, 5, seed=2, **args)
  rng = np.random.default_rng([2, 5])
  starts = sequences.window_starts(len(stream), 24, 3, rng)
  want = sequences.seq2seq_batch(stream, starts, 24, rng, 0.15, 3.0)
  for key in ("inputs", "targets"):
    np.testing.assert_array_equal(got[key], want[key])
  for row in range(3):
    window = _uncorrupt(
      got["inputs"][row], got["targets"][row], sequences.BYTE_VOCAB
    )
    start = int(starts[row])
    np.testing.assert_array_equal(
      window - sequences.BYTE_OFFSET, stream[start : start + 24]
    )
  other = sequences.seq2seq_batch_at(stream, 6, seed=2, **args)
  assert not np.array_equal(got["inputs"], other["inputs"])
