"""Text examples as token arrays: sentences with a label, a question with
its answer's span in a context, a source with its target.

Pure NumPy functions of texts and a tokenizer. Ids are the tokenizer's
shifted by ``Encoder.offset`` so that 0 is padding only (the tokenizer's
``seq2seq_offset``: 0 for T5's, which pads with 0, else 1), and every
segment ends with the tokenizer's end id (shifted): bytes end with byte 0
(id 1), T5's SentencePiece with ``</s>``, GPT-2's with ``<|endoftext|>``.
A model's vocabulary needs ``Encoder.vocab_size`` ids.

Over-long inputs are cut as HuggingFace's "longest_first": the longest
segment loses a token until the whole fits; every segment keeps its end.
"""

import dataclasses

import numpy as np

from jpipe.data.tokenizers import Tokenizer

NO_SPAN = -1  # start / end of a gold answer that is absent (padding).


@dataclasses.dataclass(frozen=True)
class Encoder:
  """A tokenizer's ids shifted by ``offset``: 0 pads, ``end`` ends."""

  tokenizer: Tokenizer

  @property
  def offset(self) -> int:
    return self.tokenizer.seq2seq_offset

  @property
  def end(self) -> int:
    return self.tokenizer.end_id + self.offset

  @property
  def vocab_size(self) -> int:
    """Ids a model's vocabulary must hold: [0, vocab_size)."""
    return self.tokenizer.vocab_size + self.offset

  def ids(self, texts: list[str]) -> list[np.ndarray]:
    """int32 [len] ids of each text (no end appended)."""
    return [
      np.asarray(ids, np.int32) + self.offset
      for ids in self.tokenizer.encode_many([str(t) for t in texts])
    ]


def fit_lengths(lengths: list[int], budget: int) -> list[int]:
  """Segment lengths cut longest-first until their sum is <= ``budget``
  (ties: the earlier segment is cut first, as HuggingFace's)."""
  lengths = list(lengths)
  while sum(lengths) > budget:
    longest = max(range(len(lengths)), key=lambda i: (lengths[i], -i))
    lengths[longest] -= 1
  return lengths


def pack(segments: list[np.ndarray], end: int, length: int):
  """``segments`` each followed by ``end``, cut longest-first to fit and
  padded with 0 to ``length``.

  Returns:
    (int32 [length] tokens, the index of the last real token).
  """
  if length < 2 * len(segments):
    raise ValueError(
      f"data.sequence_length={length} cannot hold {len(segments)} "
      "segments of one token and an end each"
    )
  keep = fit_lengths([len(s) for s in segments], length - len(segments))
  out = np.zeros([length], np.int32)
  at = 0
  for segment, n in zip(segments, keep, strict=True):
    out[at : at + n] = segment[:n]
    out[at + n] = end
    at += n + 1
  return out, at - 1


def classification_arrays(
  encoder: Encoder, texts: list[list[str]], labels, length: int
) -> dict:
  """Sentence (or sentence-pair, ...) classification for a one-input
  model.

  Args:
    texts: per example, its segments (one sentence, or a pair).
    labels: int [N].
    length: tokens per example.

  Returns:
    {"x": int32 [N, length] the segments packed, "last": int32 [N] the
    index of the last real token (where a causal model has read all of
    it), "y": int32 [N] the labels}.
  """
  columns = [encoder.ids(list(c)) for c in zip(*texts, strict=True)]
  packed = [
    pack([column[i] for column in columns], encoder.end, length)
    for i in range(len(texts))
  ]
  return {
    "x": np.stack([p[0] for p in packed]),
    "last": np.asarray([p[1] for p in packed], np.int32),
    "y": np.asarray(labels, np.int32),
  }


def text_to_text_arrays(
  encoder: Encoder,
  inputs: list[str],
  targets: list[str],
  input_length: int,
  target_length: int,
) -> dict:
  """Text-to-text pairs for an encoder-decoder (T5's format: translation,
  classification by label word, generative QA).

  Returns:
    {"inputs": int32 [N, input_length], "targets": int32 [N,
    target_length]}: each text's ids and end, cut to fit, padded with 0.
  """
  return {
    "inputs": np.stack(
      [pack([s], encoder.end, input_length)[0] for s in encoder.ids(inputs)]
    ),
    "targets": np.stack(
      [pack([s], encoder.end, target_length)[0] for s in encoder.ids(targets)]
    ),
  }


def prompt(task: str, keys: list[str], texts: list[str]) -> str:
  """T5's text-to-text input of a classification example: "rte
  sentence1: ... sentence2: ..." (Raffel et al. 2020, appendix D)."""
  parts = [task] + [f"{k}: {t}" for k, t in zip(keys, texts, strict=True)]
  return " ".join(p for p in parts if p)


def prefix_lm_arrays(
  encoder: Encoder, sources: list[str], targets: list[str], length: int
) -> dict:
  """Source -> target for a decoder-only model: the sequence source, end,
  target, end, read left to right; the loss is on the target's tokens.

  Returns:
    {"x": int32 [N, length] inputs, "y": int32 [N, length] the next token
    of each position, "mask": float32 [N, length] 1 where y is a target
    token (or its end)}.
  """
  xs, ys, masks = [], [], []
  for source, target in zip(
    encoder.ids(sources), encoder.ids(targets), strict=True
  ):
    seq, _ = pack([source, target], encoder.end, length + 1)
    n_source, n_target = fit_lengths([len(source), len(target)], length - 1)
    mask = np.zeros([length + 1], np.float32)
    # Target tokens and their end: positions n_source+1 .. +n_target+1.
    mask[n_source + 1 : n_source + n_target + 2] = 1.0
    xs.append(seq[:-1])
    ys.append(seq[1:])
    masks.append(mask[1:])
  return {"x": np.stack(xs), "y": np.stack(ys), "mask": np.stack(masks)}


def answer_char_span(context: str, text: str, start: int) -> tuple[int, int]:
  """The answer's (start, end) characters in the context: at ``start``
  where the text is there (SQuAD's ``answer_start``), else its first
  occurrence; (-1, -1) where the context does not contain it."""
  if 0 <= start and context[start : start + len(text)] == text and text:
    return start, start + len(text)
  found = context.find(text) if text else -1
  return (found, found + len(text)) if found >= 0 else (-1, -1)


def span_arrays(
  encoder: Encoder,
  questions: list[str],
  contexts: list[str],
  answers: list[list[tuple[str, int]]],
  length: int,
  max_answers: int = 1,
) -> dict:
  """Extractive QA (SQuAD): the question, its end, then the context; the
  answer is a span of the context's tokens.

  The context is encoded in three pieces -- before the answer, the
  answer, after it -- so the span is exact whatever the tokenizer (a
  merge across an answer's edge is not made). The question keeps at most
  a quarter of ``length`` (HuggingFace's max_query_length 64 of 384);
  an answer cut off by ``length``, or not in the context, has span
  (-1, -1). Further gold answers are located by encoding the context up
  to them: exact for bytes, within a token of a subword tokenizer's
  merge.

  Args:
    answers: per example, its gold answers (text, answer_start character).
    max_answers: gold answers kept per example (SQuAD's validation set
      has up to 6 per question; training 1).

  Returns:
    {"x": int32 [N, length], "start", "end": int32 [N, max_answers] token
    positions in x (inclusive; -1: none)}.
  """
  xs, starts, ends = [], [], []
  question_ids = encoder.ids(questions)
  for question, context, golds in zip(
    question_ids, contexts, answers, strict=True
  ):
    question = question[: max(length // 4 - 1, 1)]
    spans = [answer_char_span(context, t, s) for t, s in golds][:max_answers]
    first = next(((a, b) for a, b in spans if a >= 0), None)
    if first is None:
      pieces = [context]
    else:
      pieces = [context[: first[0]], context[first[0] : first[1]]]
      pieces.append(context[first[1] :])
    piece_ids = encoder.ids(pieces)
    context_ids = np.concatenate(piece_ids)
    x, _ = pack([question, context_ids], encoder.end, length)
    context_at = len(question) + 1
    start_row = np.full([max_answers], NO_SPAN, np.int32)
    end_row = np.full([max_answers], NO_SPAN, np.int32)
    kept = fit_lengths([len(question), len(context_ids)], length - 2)[1]
    for k, (a, b) in enumerate(spans):
      if a < 0:
        continue
      if (a, b) == first:
        s = context_at + len(piece_ids[0])
        e = s + len(piece_ids[1]) - 1
      else:
        before, inside = encoder.ids([context[:a], context[a:b]])
        s = context_at + len(before)
        e = s + len(inside) - 1
      if s <= e < context_at + kept:  # Not cut off by the length.
        start_row[k], end_row[k] = s, e
    xs.append(x)
    starts.append(start_row)
    ends.append(end_row)
  return {"x": np.stack(xs), "start": np.stack(starts), "end": np.stack(ends)}
