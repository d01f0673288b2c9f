"""Text examples as token arrays: truncation against HuggingFace's
"longest_first", and each layout decoded back to its texts."""

import numpy as np
import pytest
from tokenizers import Tokenizer, models, pre_tokenizers

from jpipe.data import text_examples, tokenizers
from tests.data import tokenizer_files

BYTES = text_examples.Encoder(tokenizers.ByteTokenizer())


def _decode(encoder, ids):
  ids = [int(i) - encoder.offset for i in ids if i > 0]
  return encoder.tokenizer.decode(ids)


@pytest.mark.parametrize(
  "lengths, budget",
  [((5, 3), 6), ((4, 4), 5), ((3, 7), 4), ((6, 6), 7), ((9, 2), 20)],
)
def test_fit_lengths_cuts_as_huggingface_longest_first(lengths, budget):
  # One character per token: the reference cuts "a..." and "b..." itself.
  letters = {c: i for i, c in enumerate("ab")}
  reference = Tokenizer(models.WordLevel(letters, unk_token="a"))
  reference.pre_tokenizer = pre_tokenizers.Split("", "isolated")
  reference.enable_truncation(budget, strategy="longest_first")
  ids = reference.encode(
    "a" * lengths[0], "b" * lengths[1], add_special_tokens=False
  ).ids
  expected = [ids.count(0), ids.count(1)]
  assert text_examples.fit_lengths(list(lengths), budget) == expected


@pytest.mark.parametrize("seed", range(5))
def test_fit_lengths_properties(seed):
  rng = np.random.default_rng(seed)
  lengths = list(rng.integers(0, 30, size=rng.integers(1, 5)))
  budget = int(rng.integers(0, 60))
  kept = text_examples.fit_lengths(lengths, budget)
  assert sum(kept) == min(sum(lengths), budget)
  assert all(0 <= k <= n for k, n in zip(kept, lengths, strict=True))
  # Longest-first: a segment cut at all is not shorter than any other
  # segment's kept length by more than one.
  for k, n in zip(kept, lengths, strict=True):
    if k < n:
      assert all(k >= other - 1 for other in kept)


def test_classification_arrays_pack_segments_with_ends():
  out = text_examples.classification_arrays(
    BYTES, [["ab", "xyz"], ["hello world", "q"]], [1, 0], length=8
  )
  end = BYTES.end
  assert end == 1  # Byte 0 (the corpus separator), shifted past padding.
  first = [ord("a") + 1, ord("b") + 1, end, ord("x") + 1]
  first += [ord("y") + 1, ord("z") + 1, end, 0]
  np.testing.assert_array_equal(out["x"][0], first)
  assert out["last"][0] == 6
  # 11 + 1 tokens into 6 of room: "hello" keeps 5, "q" its 1.
  assert _decode(BYTES, out["x"][1][:5]) == "hello"
  assert out["x"][1][7] == end and out["last"][1] == 7
  np.testing.assert_array_equal(out["y"], [1, 0])


@pytest.mark.parametrize("kind", ["bytes", "sentencepiece", "huggingface"])
def test_answer_spans_decode_to_the_answers(kind, tmp_path):
  if kind == "bytes":
    encoder = BYTES
  elif kind == "sentencepiece":
    path = tokenizer_files.sentencepiece_model(tmp_path)
    encoder = text_examples.Encoder(tokenizers.load(path))
  else:
    path = tokenizer_files.huggingface_json(tmp_path)
    encoder = text_examples.Encoder(tokenizers.load(path))
  contexts = [
    "The import statement binds names in the local namespace.",
    "A dictionary maps keys to values; lists hold sequences.",
    "Exceptions unwind the stack until a handler catches them.",
  ]
  answers = [
    [("local namespace", contexts[0].index("local namespace"))],
    # answer_start wrong: the text is found where it is.
    [("keys to values", 3)],
    # Not in the context: no span.
    [("generators", 0)],
  ]
  out = text_examples.span_arrays(
    encoder, ["where?", "what?", "who?"], contexts, answers, length=64
  )
  for i in range(2):
    s, e = out["start"][i, 0], out["end"][i, 0]
    assert 0 < s <= e
    assert _decode(encoder, out["x"][i, s : e + 1]).strip() == answers[i][0][0]
  assert (out["start"][2], out["end"][2]) == (-1, -1)


def test_an_answer_cut_off_by_the_length_has_no_span():
  context = "x" * 40 + " the answer"
  out = text_examples.span_arrays(
    BYTES, ["q"], [context], [[("the answer", 41)]], length=24
  )
  assert out["start"][0, 0] == -1 and out["end"][0, 0] == -1
  longer = text_examples.span_arrays(
    BYTES, ["q"], [context], [[("the answer", 41)]], length=64
  )
  s, e = longer["start"][0, 0], longer["end"][0, 0]
  assert _decode(BYTES, longer["x"][0, s : e + 1]) == "the answer"


def test_several_gold_answers_each_have_their_span():
  context = "alpha beta gamma delta"
  golds = [("beta", 6), ("beta gamma", 6), ("delta", 17)]
  out = text_examples.span_arrays(
    BYTES, ["q"], [context], [golds], length=40, max_answers=4
  )
  for k, (text, _) in enumerate(golds):
    s, e = out["start"][0, k], out["end"][0, k]
    assert _decode(BYTES, out["x"][0, s : e + 1]) == text
  assert out["start"][0, 3] == -1


def test_prefix_lm_loss_positions_are_the_target():
  out = text_examples.prefix_lm_arrays(
    BYTES, ["guten tag", "a much longer source sentence"], ["hi", "x"], 16
  )
  for i, target in enumerate(["hi", "x"]):
    predicted = out["y"][i][out["mask"][i] == 1]
    assert predicted[-1] == BYTES.end
    assert _decode(BYTES, predicted[:-1]) == target
    # x is y shifted right by one.
    np.testing.assert_array_equal(out["x"][i][1:], out["y"][i][:-1])
  # The long source was cut; the target kept whole.
  assert out["mask"][1].sum() == 2


def test_text_to_text_arrays_and_prompt():
  inputs = [
    text_examples.prompt("rte", ["sentence1", "sentence2"], ["A b.", "C."])
  ]
  assert inputs[0] == "rte sentence1: A b. sentence2: C."
  out = text_examples.text_to_text_arrays(
    BYTES, inputs, ["entailment"], input_length=40, target_length=6
  )
  assert _decode(BYTES, out["inputs"][0]) == inputs[0] + "\0"
  # Cut to 5 tokens and the end.
  assert _decode(BYTES, out["targets"][0][:5]) == "entai"
  assert out["targets"][0][5] == BYTES.end
