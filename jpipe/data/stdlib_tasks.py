"""Two small text-to-text tasks built from the standard library's own
functions (``text.stdlib_files``), so that QA and translation configs run
with no download: each function with a docstring gives one example.

- ``stdlib_qa`` (SQuAD's features): the context is the function's
  signature and its docstring's first line, ``"def NAME(ARGS): LINE"``;
  the question asks what NAME does; the answer is LINE, a span of the
  context (``answer_start`` in characters) of several words, so that
  token F1 gives partial credit as SQuAD's does.
- ``stdlib_translation``: the source is the docstring's first line, the
  target the same words in reverse order (a reordering a sequence-to-
  sequence model must learn; not a natural language pair).

The split is ``text.is_test_file``'s (by file). Toy tasks for the test
suite and the seeds' small variants, not benchmarks.
"""

import ast

import numpy as np
import tensorflow_datasets as tfds

from jpipe.data import text

MAX_LINE = 60  # Characters of a docstring's first line kept (longer: skipped).
MAX_NAME = 15  # Characters of a function's name (longer: skipped).


def functions(test: bool):
  """(key, name, argument names, docstring's first line) of each
  function of the split's files whose docstring's first line and name
  are short enough, in file and source order."""
  for path in text.stdlib_files():
    base = path.rsplit("/", 1)[-1]
    if text.is_test_file(base) != test:
      continue
    with open(path, "rb") as f:
      try:
        tree = ast.parse(f.read())
      except (SyntaxError, ValueError):
        continue
    for node in ast.walk(tree):
      if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
        continue
      doc = ast.get_docstring(node)
      line = doc.strip().splitlines()[0].strip() if doc and doc.strip() else ""
      if not line or len(line) > MAX_LINE or len(node.name) > MAX_NAME:
        continue
      args = [a.arg for a in node.args.args]
      yield f"{base}:{node.lineno}", node.name, args, line


class StdlibQa(text.StdlibBuilder):
  """SQuAD-style records: question, context, answers {text, answer_start}."""

  def _info(self) -> tfds.core.DatasetInfo:
    return tfds.core.DatasetInfo(
      builder=self,
      description=__doc__,
      features=tfds.features.FeaturesDict(
        {
          "question": tfds.features.Text(),
          "context": tfds.features.Text(),
          "answers": tfds.features.Sequence(
            {"text": tfds.features.Text(), "answer_start": np.int32}
          ),
        }
      ),
    )

  def _generate_examples(self, test: bool):
    for key, name, args, line in functions(test):
      signature = f"def {name}({', '.join(args)}): "
      yield (
        key,
        {
          "question": f"What does {name} do?",
          "context": signature + line,
          "answers": {"text": [line], "answer_start": [len(signature)]},
        },
      )


class StdlibTranslation(text.StdlibBuilder):
  """Translation records: source (a line), target (its words reversed)."""

  def _info(self) -> tfds.core.DatasetInfo:
    return tfds.core.DatasetInfo(
      builder=self,
      description=__doc__,
      features=tfds.features.FeaturesDict(
        {"source": tfds.features.Text(), "target": tfds.features.Text()}
      ),
    )

  def _generate_examples(self, test: bool):
    for key, _, _, line in functions(test):
      words = line.split()
      yield key, {"source": " ".join(words), "target": " ".join(words[::-1])}


BUILDERS = {"stdlib_qa": StdlibQa, "stdlib_translation": StdlibTranslation}
