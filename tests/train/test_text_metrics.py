"""Task metrics of generated text against hand-worked examples and, for
BLEU, a plain restatement of BLEU-4."""

import collections
import math

import numpy as np
import pytest

from jpipe.train import text_metrics


def test_normalisation_drops_case_punctuation_articles_spaces():
  assert text_metrics.normalize_answer("The  Cat, sat on a mat!") == (
    "cat sat on mat"
  )
  # Articles only as whole words: "another", "theory" stay.
  assert text_metrics.normalize_answer("An another theory") == (
    "another theory"
  )


def test_exact_match_takes_the_best_gold_answer():
  assert text_metrics.exact_match(
    "the Eiffel Tower.", ["Paris", "Eiffel tower"]
  )
  assert not text_metrics.exact_match("Eiffel", ["Eiffel tower"])


def test_f1_by_hand():
  # Prediction {in, eiffel, tower}, gold {eiffel, tower, in, paris}:
  # 3 shared, precision 1, recall 3/4, F1 = 2 * 3/4 / (7/4) = 6/7.
  assert text_metrics.f1("in the Eiffel Tower", ["Eiffel Tower in Paris"]) == (
    pytest.approx(6 / 7)
  )
  # A bag, not a set: "a b b" vs "b b c" share two b's: P = R = 2/3.
  assert text_metrics.f1("x y y", ["y y z"]) == pytest.approx(2 / 3)
  # The best of the gold answers; nothing shared is 0.
  assert text_metrics.f1("paris", ["london", "Paris"]) == 1.0
  assert text_metrics.f1("paris", ["london"]) == 0.0


def test_squad_means_in_percent():
  got = text_metrics.squad(
    ["in the Eiffel Tower", "Paris"], [["Eiffel Tower in Paris"], ["paris"]]
  )
  assert got["exact_match"] == pytest.approx(50.0)
  assert got["f1"] == pytest.approx(100 * (6 / 7 + 1) / 2)


def test_label_accuracy_counts_exact_label_words():
  got = text_metrics.label_accuracy(
    [" entailment", "not_entailment", "entailment."],
    ["entailment", "entailment", "entailment"],
  )
  assert got["accuracy"] == pytest.approx(100 / 3)


def test_mismatched_lengths_are_refused():
  with pytest.raises(ValueError, match="2 predictions for 1"):
    text_metrics.squad(["a", "b"], [["a"]])
  with pytest.raises(ValueError, match="non-empty list"):
    text_metrics.f1("a", "a")


def _reference_bleu(hypotheses, references):
  """BLEU-4 restated: corpus brevity penalty, clipped n-gram precisions
  summed over the corpus, their geometric mean (whitespace tokens)."""
  matched, total = [0] * 4, [0] * 4
  hyp_len = ref_len = 0
  for hyp, refs in zip(hypotheses, references, strict=True):
    h = hyp.split()
    rs = [r.split() for r in refs]
    hyp_len += len(h)
    # The reference length closest to the hypothesis (shorter on a tie).
    ref_len += min((abs(len(r) - len(h)), len(r)) for r in rs)[1]
    for n in range(1, 5):
      grams = collections.Counter(
        tuple(h[i : i + n]) for i in range(len(h) - n + 1)
      )
      most = collections.Counter()
      for r in rs:
        for g, c in collections.Counter(
          tuple(r[i : i + n]) for i in range(len(r) - n + 1)
        ).items():
          most[g] = max(most[g], c)
      matched[n - 1] += sum(min(c, most[g]) for g, c in grams.items())
      total[n - 1] += max(len(h) - n + 1, 0)
  log_p = sum(math.log(m / t) for m, t in zip(matched, total, strict=True)) / 4
  bp = 1.0 if hyp_len > ref_len else math.exp(1 - ref_len / hyp_len)
  return 100 * bp * math.exp(log_p)


CORPUS = [
  ("the cat sat on the mat today", ["the cat is sitting on the mat today"]),
  ("a dog ran in the big park", ["the dog ran in the big green park"]),
  ("he reads the the the book slowly", ["he reads the book very slowly"]),
]


@pytest.mark.parametrize(
  "corpus",
  [
    CORPUS,
    # Two references each; the hypotheses short (brevity penalty).
    [
      (
        "the cat sat on the mat",
        ["the cat sat on a mat", "a cat sat on the mat here"],
      ),
      ("it is a dog", ["it is a big dog indeed", "this is a big dog"]),
    ],
  ],
)
def test_bleu_matches_a_restatement(corpus):
  hyps = [h for h, _ in corpus]
  refs = [r for _, r in corpus]
  want = _reference_bleu(hyps, refs)
  if len(refs[0]) == 1:
    got = text_metrics.bleu(hyps, [r[0] for r in refs], tokenize="none")
  else:
    got = text_metrics.bleu(hyps, refs, tokenize="none")
  assert 0 < want < 100
  assert got["bleu"] == pytest.approx(want, rel=1e-9)


def test_bleu_properties():
  sentences = ["the cat sat on the mat", "a dog ran in the park"]
  assert text_metrics.bleu(sentences, sentences)["bleu"] == pytest.approx(100)
  # 13a tokenisation splits punctuation off: "mat." matches "mat ."
  assert text_metrics.bleu(
    ["the cat sat on the mat."], ["the cat sat on the mat ."]
  )["bleu"] == pytest.approx(100)
  with pytest.raises(ValueError, match="references per hypothesis differ"):
    text_metrics.bleu(["a", "b"], [["a"], ["b", "c"]])


def test_no_answer_questions_score_as_squad_v2_does():
  """SQuAD v2.0's compute_f1: an empty answer against an empty gold is
  1 (it was 0: an all-correct batch scored F1 50)."""
  got = text_metrics.squad(["", "Paris"], [[""], ["Paris"]])
  assert got == {"exact_match": 100.0, "f1": 100.0}
  assert text_metrics.f1("", ["Paris"]) == 0.0
  assert text_metrics.f1("Paris", [""]) == 0.0


def test_array_inputs_and_a_bad_tokeniser_are_clear():
  got = text_metrics.squad(
    np.array(["a cat", "dog"]), np.array([["cat"], ["dog"]])
  )
  assert got["exact_match"] == 100.0
  with pytest.raises(ValueError, match="'14z' is not a sacrebleu tokeniser"):
    text_metrics.bleu(["a b"], ["a b"], tokenize="14z")
