"""The embedded text-to-text tasks: every QA answer is the span its
``answer_start`` names (and, restated by a regular expression, the line
after the signature of the function the question names), every target
is its source's words reversed, and the split is by file."""

import re

from jpipe.data import prepared_source, stdlib_tasks, text


def _all(builder, split):
  source = prepared_source(builder, split, None)
  return [source[i] for i in range(len(source))]


def _str(x):
  return x.decode() if isinstance(x, bytes) else str(x)


def test_qa_answers_are_their_spans_of_the_context():
  records = _all(stdlib_tasks.StdlibQa, "test")
  assert len(records) > 100
  for r in records:
    context, question = _str(r["context"]), _str(r["question"])
    (answer,), (start,) = r["answers"]["text"], r["answers"]["answer_start"]
    answer = _str(answer)
    assert context[start : start + len(answer)] == answer
    # A restatement: "def NAME(ARGS): LINE" asked as "What does NAME do?".
    name, line = re.fullmatch(r"def (\w+)\([^)]*\): (.+)", context).groups()
    assert question == f"What does {name} do?" and answer == line
    assert 0 < len(line) <= stdlib_tasks.MAX_LINE


def test_translation_targets_are_the_sources_words_reversed():
  records = _all(stdlib_tasks.StdlibTranslation, "test")
  for r in records:
    source, target = _str(r["source"]).split(), _str(r["target"]).split()
    assert target == source[::-1] and source


def test_the_split_is_by_file():
  test = list(stdlib_tasks.functions(True))
  files = {key.split(":")[0] for key, *_ in test}
  assert len(files) > 5 and all(text.is_test_file(f) for f in files)
  assert len(_all(stdlib_tasks.StdlibQa, "test")) == len(test)
