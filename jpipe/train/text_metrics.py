"""Task metrics over generated text: SQuAD exact match and F1, accuracy of
generated label words, corpus BLEU.

Pure functions of strings (host Python, no JAX), each returning a
``{metric: float}`` dict in percent as the papers report them:

- ``squad``: SQuAD v1.1's official script (``evaluate-v1.1.py``) restated:
  answers normalised (lower case, punctuation removed, the articles
  "a", "an", "the" dropped, whitespace collapsed), exact match and
  token-bag F1 against each gold answer, the best gold answer counted.
- ``label_accuracy``: T5's text-to-text classification (GLUE RTE, BoolQ,
  WiC): the generated text is right when, stripped of surrounding
  whitespace, it is the label word itself (T5's postprocessor maps any
  other string to an invalid label, counted wrong).
- ``bleu``: corpus BLEU-4 by ``sacrebleu`` (Post 2018), the field's
  standard: its default 13a tokenisation, brevity penalty over the
  corpus, clipped n-gram precisions, their geometric mean.

References:
  Rajpurkar et al., `SQuAD: 100,000+ Questions for Machine Comprehension
  of Text <https://arxiv.org/abs/1606.05250>`_, 2016.
  Raffel et al., `Exploring the Limits of Transfer Learning with a
  Unified Text-to-Text Transformer <https://arxiv.org/abs/1910.10683>`_,
  2020.
  Post, `A Call for Clarity in Reporting BLEU Scores
  <https://arxiv.org/abs/1804.08771>`_, 2018.
"""

import collections
import re
import string
from collections.abc import Sequence

_ARTICLES = re.compile(r"\b(a|an|the)\b")
_PUNCTUATION = frozenset(string.punctuation)


def normalize_answer(text: str) -> str:
  """SQuAD's normalisation: lower case, no punctuation, no articles,
  single spaces."""
  text = "".join(ch for ch in text.lower() if ch not in _PUNCTUATION)
  return " ".join(_ARTICLES.sub(" ", text).split())


def exact_match(prediction: str, golds: Sequence[str]) -> float:
  """1.0 if the normalised prediction equals a normalised gold answer."""
  _check_golds(golds)
  ours = normalize_answer(prediction)
  return float(any(ours == normalize_answer(g) for g in golds))


def f1(prediction: str, golds: Sequence[str]) -> float:
  """The best token-bag F1 (in [0, 1]) of the normalised prediction
  against each normalised gold answer."""
  _check_golds(golds)
  return max(_token_f1(prediction, g) for g in golds)


def _token_f1(prediction: str, gold: str) -> float:
  """F1 of the two answers' normalised token multisets."""
  ours = normalize_answer(prediction).split()
  theirs = normalize_answer(gold).split()
  if not ours or not theirs:  # SQuAD v2's no-answer: right only if both.
    return float(ours == theirs)
  common = collections.Counter(ours) & collections.Counter(theirs)
  same = sum(common.values())
  if same == 0:
    return 0.0
  precision, recall = same / len(ours), same / len(theirs)
  return 2 * precision * recall / (precision + recall)


def squad(
  predictions: Sequence[str], golds: Sequence[Sequence[str]]
) -> dict[str, float]:
  """``{"exact_match", "f1"}`` in percent: the means over questions of
  ``exact_match`` and ``f1`` (each question: its gold answers)."""
  _check_lengths(predictions, golds)
  n = len(predictions)
  return {
    "exact_match": 100.0 * sum(map(exact_match, predictions, golds)) / n,
    "f1": 100.0 * sum(map(f1, predictions, golds)) / n,
  }


def label_accuracy(
  predictions: Sequence[str], labels: Sequence[str]
) -> dict[str, float]:
  """``{"accuracy"}`` in percent: generated texts that are their label
  word (surrounding whitespace stripped)."""
  _check_lengths(predictions, labels)
  right = sum(
    p.strip() == y.strip() for p, y in zip(predictions, labels, strict=True)
  )
  return {"accuracy": 100.0 * right / len(predictions)}


def bleu(
  hypotheses: Sequence[str],
  references: Sequence[str] | Sequence[Sequence[str]],
  *,
  tokenize: str = "13a",
) -> dict[str, float]:
  """``{"bleu"}``: sacrebleu's corpus BLEU-4 (0-100) of the hypotheses
  against one reference each (a list of strings) or several (a list of
  lists, the same count per hypothesis). ``tokenize``: sacrebleu's
  tokeniser name ("13a", its default; "none" for pre-tokenised text)."""
  import sacrebleu  # Imported here: only a translation task needs it.

  _check_lengths(hypotheses, references)
  if all(isinstance(r, str) for r in references):
    streams = [list(references)]
  else:
    counts = {len(r) for r in references}
    if len(counts) != 1:
      raise ValueError(
        f"references per hypothesis differ ({sorted(counts)}): give each "
        "hypothesis the same number"
      )
    streams = [list(r) for r in zip(*references, strict=True)]
  try:
    score = sacrebleu.corpus_bleu(list(hypotheses), streams, tokenize=tokenize)
  except KeyError as e:  # (sacrebleu's own: a bare KeyError of the name.)
    if str(e).strip("'") != tokenize:
      raise
    raise ValueError(
      f"bleu: tokenize={tokenize!r} is not a sacrebleu tokeniser (e.g. "
      "'13a', 'none', 'intl', 'char', 'zh')"
    ) from None
  return {"bleu": float(score.score)}


def _check_golds(golds) -> None:
  if isinstance(golds, str | bytes) or len(golds) == 0:
    raise ValueError(
      f"gold answers must be a non-empty list of strings, got {golds!r}"
    )


def _check_lengths(predictions, truths) -> None:
  if len(predictions) == 0 or len(predictions) != len(truths):
    raise ValueError(
      f"{len(predictions)} predictions for {len(truths)} references: give "
      "one prediction per example (at least one)"
    )
