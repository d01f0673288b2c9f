"""Token sequences from a token stream (bytes, or a tokenizer's ids): LM
windows and T5 span corruption.

Pure NumPy functions of (stream, seed, step), so a resumed run draws the
same batches as an uninterrupted one.
"""

import numpy as np

BYTE_OFFSET = 1  # seq2seq tokens are byte + 1: token 0 is padding.
BYTE_VOCAB = 256 + BYTE_OFFSET  # Byte tokens of seq2seq; sentinels follow.


def window_starts(
  stream_length: int, length: int, count: int, rng: np.random.Generator
) -> np.ndarray:
  """int64 [count]: uniform random starts of ``length``-long windows."""
  if stream_length < length:
    raise ValueError(
      f"the text has {stream_length} tokens, fewer than one sequence of "
      f"{length}: lower data.sequence_length"
    )
  return rng.integers(0, stream_length - length + 1, size=count)


def lm_batch_at(
  stream: np.ndarray, step: int, batch_size: int, length: int, seed: int
) -> dict:
  """Next-byte prediction batch of ``step``.

  Returns:
    {"x": int32 [B, length] input bytes, "y": int32 [B, length] the next
    byte of each position}; windows start at random offsets drawn from
    (seed, step).
  """
  rng = np.random.default_rng([seed, step])
  starts = window_starts(len(stream), length + 1, batch_size, rng)
  windows = stream[starts[:, None] + np.arange(length + 1)].astype(np.int32)
  return {"x": windows[:, :-1], "y": windows[:, 1:]}


def eval_window_starts(
  stream_length: int, window: int, stride: int, count: int
) -> np.ndarray:
  """int64 [k]: starts of held-out windows of ``window`` tokens, ``stride``
  apart (``stride`` = the tokens each scores: no token scored twice),
  all that fit (``count`` 0, or more than fit) or ``count`` of them
  evenly spread over the text (a long one's sample)."""
  if stream_length < window:
    raise ValueError(
      f"the eval text has {stream_length} tokens, fewer than one sequence "
      f"of {window}: lower data.sequence_length"
    )
  fit = (stream_length - window) // stride + 1
  if count <= 0 or count >= fit:
    chosen = np.arange(fit)
  else:  # (Spacing >= 1: distinct after rounding.)
    chosen = np.round(np.linspace(0, fit - 1, count)).astype(np.int64)
  return chosen.astype(np.int64) * stride


def lm_eval_windows(stream: np.ndarray, length: int, count: int) -> dict:
  """Held-out windows as ``lm_batch_at``'s: consecutive ones scoring
  every target token once (``eval_window_starts``; ``count``: at most
  that many, 0 = all; a tail shorter than a window is not scored)."""
  starts = eval_window_starts(len(stream), length + 1, length, count)
  windows = stream[starts[:, None] + np.arange(length + 1)].astype(np.int32)
  return {"x": windows[:, :-1], "y": windows[:, 1:]}


def span_lengths(
  length: int, noise_density: float, mean_span_length: float
) -> tuple[int, int, int, int]:
  """(noise tokens, spans, inputs length, targets length) of one window.

  As T5's ``random_spans_noise_mask``: round(length * density) noise
  tokens in round(noise / mean_span_length) spans (at least one); inputs
  keep the rest plus one sentinel per span, targets hold a sentinel per
  span followed by that span's tokens.
  """
  noise = int(round(length * noise_density))
  noise = min(max(noise, 1), length - 1)
  spans = max(int(round(noise / mean_span_length)), 1)
  spans = min(spans, noise, length - noise)
  return noise, spans, length - noise + spans, noise + spans


def _segment(total: int, parts: int, rng: np.random.Generator) -> np.ndarray:
  """int [parts]: a random composition of ``total`` into positive parts."""
  cuts = np.sort(rng.choice(np.arange(1, total), parts - 1, replace=False))
  return np.diff(np.concatenate([[0], cuts, [total]]))


def span_corrupt(
  tokens: np.ndarray,
  rng: np.random.Generator,
  noise_density: float,
  mean_span_length: float,
  first_sentinel: int,
) -> tuple[np.ndarray, np.ndarray]:
  """T5's span-corruption objective on one window.

  Args:
    tokens: int [L], no padding.
    rng: draws the span boundaries.
    noise_density: fraction of tokens masked (T5: 0.15).
    mean_span_length: mean masked span length (T5: 3).
    first_sentinel: id of sentinel 0; span k uses ``first_sentinel + k``.

  Returns:
    (inputs int32 [Li], targets int32 [Lt]) with the lengths of
    :func:`span_lengths`: inputs alternate kept runs and sentinels (a kept
    run first), targets list each sentinel followed by its masked span.
  """
  noise, spans, _, _ = span_lengths(
    len(tokens), noise_density, mean_span_length
  )
  noise_runs = _segment(noise, spans, rng)
  kept_runs = _segment(len(tokens) - noise, spans, rng)
  inputs, targets, at = [], [], 0
  for k, (kept, masked) in enumerate(zip(kept_runs, noise_runs, strict=True)):
    inputs.extend(tokens[at : at + kept])
    at += kept
    inputs.append(first_sentinel + k)
    targets.append(first_sentinel + k)
    targets.extend(tokens[at : at + masked])
    at += masked
  return np.asarray(inputs, np.int32), np.asarray(targets, np.int32)


def seq2seq_batch(
  stream: np.ndarray,
  starts: np.ndarray,
  length: int,
  rng: np.random.Generator,
  noise_density: float,
  mean_span_length: float,
  offset: int = BYTE_OFFSET,
  first_sentinel: int = BYTE_VOCAB,
) -> dict:
  """Span-corrupted windows: {"inputs": int32 [B, Li], "targets": int32
  [B, Lt]}; tokens are the stream's + ``offset`` (0 stays padding),
  sentinels from ``first_sentinel`` (bytes: ``BYTE_OFFSET``,
  ``BYTE_VOCAB``)."""
  pairs = [
    span_corrupt(
      stream[s : s + length].astype(np.int32) + offset,
      rng,
      noise_density,
      mean_span_length,
      first_sentinel,
    )
    for s in starts
  ]
  return {
    "inputs": np.stack([p[0] for p in pairs]),
    "targets": np.stack([p[1] for p in pairs]),
  }


def seq2seq_batch_at(
  stream: np.ndarray,
  step: int,
  batch_size: int,
  length: int,
  seed: int,
  noise_density: float,
  mean_span_length: float,
  **ids,
) -> dict:
  """The span-corruption training batch of ``step`` (see seq2seq_batch;
  ``ids``: its ``offset`` and ``first_sentinel``)."""
  rng = np.random.default_rng([seed, step])
  starts = window_starts(len(stream), length, batch_size, rng)
  return seq2seq_batch(
    stream, starts, length, rng, noise_density, mean_span_length, **ids
  )


def seq2seq_eval_batch(
  stream: np.ndarray,
  length: int,
  count: int,
  noise_density: float,
  mean_span_length: float,
  **ids,
) -> dict:
  """Held-out windows with fixed (seed 0) spans, none overlapping
  (``eval_window_starts``: ``count`` at most, 0 = all; ``ids``: as
  ``seq2seq_batch_at``)."""
  starts = eval_window_starts(len(stream), length, length, count)
  return seq2seq_batch(
    stream,
    starts,
    length,
    np.random.default_rng(0),
    noise_density,
    mean_span_length,
    **ids,
  )
