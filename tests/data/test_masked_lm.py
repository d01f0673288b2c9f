"""BERT's pre-training examples against their definition: [CLS] A [SEP]
B [SEP] with B the next window or a random one, 15 % of A and B chosen,
80/10/10 [MASK] / random / kept, labels exactly at the chosen tokens."""

import numpy as np
import pytest

from jpipe.data import masked_lm, tokenizers

VOCAB = masked_lm.Vocabulary(offset=1, words=50, cls=51, sep=52, mask=53)


def _stream(n=4000, seed=0):
  return np.random.default_rng(seed).integers(0, 50, n).astype(np.int32)


def _windows(stream, length):
  """Every (start, window) of ``length`` tokens of the stream, shifted."""
  shifted = stream + VOCAB.offset
  return {
    tuple(shifted[s : s + length]): s for s in range(len(stream) - length + 1)
  }


def test_examples_are_bert_pairs_with_their_masks():
  stream = _stream()
  length, batch = 23, 64
  first, second = (length - 3) // 2, length - 3 - ((length - 3) // 2)
  b = masked_lm.pretraining_batch(stream, 5, batch, length, 0, VOCAB)
  assert b["x"].shape == b["types"].shape == (batch, length)
  original = np.where(b["mlm_weights"] > 0, b["mlm_labels"], b["x"])
  assert (original[:, 0] == VOCAB.cls).all()
  assert (original[:, first + 1] == VOCAB.sep).all()
  assert (original[:, -1] == VOCAB.sep).all()
  assert (b["types"][:, : first + 2] == 0).all()
  assert (b["types"][:, first + 2 :] == 1).all()
  firsts = _windows(stream, first + second)
  for i in range(batch):
    a = original[i, 1 : first + 1]
    rest = original[i, first + 2 : -1]
    joined = tuple(np.concatenate([a, rest]))
    if b["nsp_labels"][i] == 0:  # B follows A in the stream.
      assert joined in firsts
    # The chosen tokens: round(15 %) of A and B, never a special.
    chosen = np.flatnonzero(b["mlm_weights"][i])
    assert len(chosen) == round(0.15 * (first + second))
    assert not np.isin(chosen, [0, first + 1, length - 1]).any()
    assert (b["mlm_labels"][i][b["mlm_weights"][i] == 0] == 0).all()
  # Half the pairs are random (binomial: 64 draws).
  assert 16 <= b["nsp_labels"].sum() <= 48


def test_mask_random_and_kept_proportions():
  stream = _stream(20000, 1)
  counts = np.zeros(3)
  for step in range(20):
    b = masked_lm.pretraining_batch(stream, step, 64, 64, 3, VOCAB)
    chosen = b["mlm_weights"] > 0
    x, labels = b["x"][chosen], b["mlm_labels"][chosen]
    masked = x == VOCAB.mask
    kept = ~masked & (x == labels)
    counts += [masked.sum(), (~masked & ~kept).sum(), kept.sum()]
  share = counts / counts.sum()
  # 0.8 / 0.1 / 0.1 (a random token equal to the original counts as kept:
  # 1 in 50 of the 10 %).
  np.testing.assert_allclose(share, [0.8, 0.098, 0.102], atol=0.02)


def test_a_step_is_a_pure_function():
  stream = _stream()
  one = masked_lm.pretraining_batch(stream, 3, 8, 16, 7, VOCAB)
  two = masked_lm.pretraining_batch(stream, 3, 8, 16, 7, VOCAB)
  other = masked_lm.pretraining_batch(stream, 4, 8, 16, 7, VOCAB)
  for key in one:
    np.testing.assert_array_equal(one[key], two[key])
  assert not np.array_equal(one["x"], other["x"])
  with pytest.raises(ValueError, match="shorter than one example"):
    masked_lm.pretraining_batch(stream[:10], 0, 2, 16, 0, VOCAB)


def test_vocabulary_of_bytes_and_of_a_wordpiece_tokenizer(tmp_path):
  bytes_vocab = masked_lm.Vocabulary.of(tokenizers.load(""))
  assert bytes_vocab == masked_lm.Vocabulary(1, 256, 257, 258, 259)
  assert bytes_vocab.size == 260
  from tokenizers import Tokenizer, models, pre_tokenizers

  words = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "the", "cat"]
  tok = Tokenizer(
    models.WordLevel({w: i for i, w in enumerate(words)}, "[UNK]")
  )
  tok.pre_tokenizer = pre_tokenizers.Whitespace()
  path = str(tmp_path / "tokenizer.json")
  tok.save(path)
  wordpiece = tokenizers.load(path)
  # BERT's own ids, unshifted: [PAD] is 0 (padding only).
  assert wordpiece.pad_id == 0 and wordpiece.seq2seq_offset == 0
  assert masked_lm.Vocabulary.of(wordpiece) == masked_lm.Vocabulary(
    0, 7, 2, 3, 4
  )
