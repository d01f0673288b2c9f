"""BERT's pre-training examples from a token stream: masked-LM and
next-sentence prediction (Devlin et al. 2019).

Each example is ``[CLS] A [SEP] B [SEP]``: A a window of the stream, B
the window after it (next-sentence label 0, "is next") or, with
probability 1/2, a window from a random place (label 1), A and B
splitting the ``length - 3`` tokens between them. Of the tokens of A and
B, ``mask_rate`` (at least one) are chosen; each chosen one is replaced
by [MASK] with probability 0.8, by a random token of the vocabulary with
0.1, and kept with 0.1; the model predicts the original at exactly the
chosen positions (HuggingFace's ``DataCollatorForLanguageModeling`` and
Google's ``create_pretraining_data``). Token types are 0 for [CLS] A
[SEP], 1 for B [SEP].

Pure NumPy functions of (stream, step, seed): a resumed run draws the
examples an uninterrupted one would.
"""

import dataclasses

import numpy as np

from jpipe.data.tokenizers import Tokenizer

MASK_PROBABILITY = 0.8  # Of a chosen token: [MASK] ...
RANDOM_PROBABILITY = 0.1  # ... a random token; the rest stay.


@dataclasses.dataclass(frozen=True)
class Vocabulary:
  """Ids as the model sees them: the tokenizer's shifted by ``offset``
  (so that 0 is padding only) in [offset, offset + words), and the three
  specials -- the tokenizer's own [CLS], [SEP], [MASK] where it has them
  (BERT's WordPiece), else appended after its ids."""

  offset: int
  words: int
  cls: int
  sep: int
  mask: int

  @property
  def size(self) -> int:
    """Ids a model's vocabulary must hold: [0, size)."""
    return max(self.offset + self.words, self.cls, self.sep, self.mask) + 1

  @classmethod
  def of(cls, tokenizer: Tokenizer) -> "Vocabulary":
    offset = tokenizer.seq2seq_offset
    words = tokenizer.vocab_size
    specials = []
    for k, token in enumerate(("[CLS]", "[SEP]", "[MASK]")):
      own = tokenizer.token_id(token)
      specials.append(own + offset if own is not None else words + offset + k)
    return cls(offset, words, *specials)


def pretraining_batch(
  stream: np.ndarray,
  step: int,
  batch_size: int,
  length: int,
  seed: int,
  vocab: Vocabulary,
  mask_rate: float = 0.15,
) -> dict:
  """The pre-training batch of ``step`` from token ``stream`` (the
  tokenizer's ids, unshifted).

  Returns:
    {"x": int32 [B, L] tokens, "types": int32 [B, L] token types,
    "mlm_labels": int32 [B, L] (the original id where chosen, else 0),
    "mlm_weights": float32 [B, L] (1 where chosen), "nsp_labels": int32
    [B] (0: B follows A; 1: B is random)}.
  """
  if length < 5:
    raise ValueError(f"sequence length {length} < 5: [CLS] a [SEP] b [SEP]")
  first = (length - 3) // 2
  second = length - 3 - first
  span = len(stream) - (first + second)
  if span <= 0:
    raise ValueError(
      f"a stream of {len(stream)} tokens is shorter than one example "
      f"({first + second} tokens)"
    )
  rng = np.random.default_rng([seed, step, 7])
  starts = rng.integers(0, span, batch_size)
  random_next = rng.random(batch_size) < 0.5
  others = rng.integers(0, len(stream) - second + 1, batch_size)
  x = np.zeros((batch_size, length), np.int32)
  types = np.zeros((batch_size, length), np.int32)
  for i in range(batch_size):
    a = stream[starts[i] : starts[i] + first]
    b_start = others[i] if random_next[i] else starts[i] + first
    b = stream[b_start : b_start + second]
    x[i] = np.concatenate(
      [
        [vocab.cls],
        a + vocab.offset,
        [vocab.sep],
        b + vocab.offset,
        [vocab.sep],
      ]
    )
    types[i, first + 2 :] = 1
  labels, weights, x = _mask(x, rng, vocab, mask_rate)
  return {
    "x": x,
    "types": types,
    "mlm_labels": labels,
    "mlm_weights": weights,
    "nsp_labels": random_next.astype(np.int32),
  }


def _mask(x, rng, vocab: Vocabulary, mask_rate: float):
  """(labels, weights, masked x) with ``mask_rate`` of each row's
  non-special tokens chosen (at least one)."""
  special = (x == vocab.cls) | (x == vocab.sep) | (x == 0)
  labels = np.zeros_like(x)
  weights = np.zeros(x.shape, np.float32)
  out = x.copy()
  for i in range(x.shape[0]):
    candidates = np.flatnonzero(~special[i])
    count = max(1, int(round(mask_rate * len(candidates))))
    chosen = rng.choice(candidates, count, replace=False)
    labels[i, chosen] = x[i, chosen]
    weights[i, chosen] = 1.0
    draw = rng.random(count)
    masked = chosen[draw < MASK_PROBABILITY]
    randomized = chosen[
      (draw >= MASK_PROBABILITY)
      & (draw < MASK_PROBABILITY + RANDOM_PROBABILITY)
    ]
    out[i, masked] = vocab.mask
    out[i, randomized] = vocab.offset + rng.integers(
      0, vocab.words, len(randomized)
    )
  return labels, weights, out
