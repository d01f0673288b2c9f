"""Generated-text metrics of the text-to-text tasks: T5 (``jpipe.models.
t5_v1``) or GNMT (``jpipe.models.gnmt``) continues each held-out source
greedily and the text it writes is scored as the papers score it
(``text_metrics``).

- classification (GLUE RTE, BoolQ, WiC): ``generated_accuracy``, the
  generated text is the label word;
- QA (SQuAD): ``generated_exact_match`` and ``generated_f1``, SQuAD's
  normalised answers against every gold answer;
- translation: ``bleu``, sacrebleu's corpus BLEU against the target.

All in percent, beside the teacher-forced metrics (``text_tasks``). The
decoder writes at most ``config.data.target_length`` tokens, stopping
at the tokenizer's end.
"""

import functools

import jax
import numpy as np

from jpipe.data import text_examples
from jpipe.models import gnmt, t5_v1
from jpipe.train import evaluation as evaluation_lib
from jpipe.train import input_pipeline, text_metrics


def generation(
  config, model, encoder: text_examples.Encoder, records: list, held_out: dict
) -> evaluation_lib.Generation | None:
  """The held-out ``Generation`` of a text-to-text task (None for a model
  without a decoding step: ``t5_v1.Model`` and ``gnmt.Model`` have one).

  Args:
    records: the held-out records, in order.
    held_out: their arrays ("inputs": the sources, "targets").
  """
  module = {t5_v1.Model: t5_v1, gnmt.Model: gnmt}.get(type(model))
  if module is None:
    _note(
      f"note: no generated metrics ({_GENERATED[config.data.format]}): "
      f"{type(model).__module__}.{type(model).__name__} has no decoding "
      "step (jpipe.models.t5_v1 and gnmt have one); the teacher-forced "
      "metrics only"
    )
    return None
  golds = _gold_texts(config.data, records)
  _note_cut_golds(config, encoder, golds)
  prefill_fn, decode_fn = module.decode_fns(model)
  source_length = held_out["inputs"].shape[1]
  return evaluation_lib.Generation(
    prompts=held_out["inputs"],
    decode_fn=decode_fn,
    prefill_fn=prefill_fn,
    empty_cache=functools.partial(
      module.empty_cache, model, source_length=source_length
    ),
    eos_id=encoder.end,
    start_id=0,
    max_new_tokens=config.data.target_length,
    batch_size=config.data.batch_size,
    score=_scorer(config, encoder, golds, held_out["targets"]),
  )


_GENERATED = {
  "classification": "generated label accuracy",
  "qa": "SQuAD's exact match and F1",
  "translation": "BLEU",
}


def _note(line: str) -> None:
  if jax.process_index() == 0:
    print(line)


def _gold_texts(data, records) -> list | None:
  """What generated texts are scored against, per held-out record: its
  answers (qa: a list each), its reference (translation), or None
  (classification: the labels are the targets' texts)."""
  if data.format == "qa":
    return [_golds(data, r) for r in records]
  if data.format == "translation":
    return [input_pipeline.as_text(r[data.target_key]) for r in records]
  return None


def _note_cut_golds(config, encoder, golds) -> None:
  """A note when answers or references (``_gold_texts``) are longer than
  the decoder may write (``data.target_length`` tokens, its end
  included): their scores are capped, as a cut target would be."""
  data = config.data
  if data.format == "qa":  # A question is capped if all its answers are.
    lengths = [min(len(x) for x in encoder.ids(g)) for g in golds]
    what = "answers"
  elif data.format == "translation":
    lengths = [len(x) for x in encoder.ids(golds)]
    what = "references"
  else:
    return  # (Labels are cut alike on both sides.)
  over = sum(n + 1 > data.target_length for n in lengths)
  if over:
    _note(
      f"note: {over} of {len(lengths)} held-out {what} need more than "
      f"data.target_length={data.target_length} tokens (longest "
      f"{max(lengths) + 1}): the decoder stops there, so their generated "
      "scores are capped; raise --config.data.target_length"
    )


def _golds(data, record) -> list[str]:
  return [
    input_pipeline.as_text(t)
    for t in np.atleast_1d(record[data.answers_key]["text"])
  ] or [""]


def _scorer(config, encoder, golds, targets):
  """``generated ids [N, n] -> metrics`` of the data's format, against
  ``golds`` (``_gold_texts``) or the ``targets``' texts."""
  data = config.data

  def texts(rows):
    return [text_of(encoder, row) for row in rows]

  if data.format == "classification":
    labels = texts(targets)
    return lambda rows: {
      "generated_accuracy": text_metrics.label_accuracy(texts(rows), labels)[
        "accuracy"
      ]
    }
  if data.format == "qa":

    def squad(rows):
      got = text_metrics.squad(texts(rows), golds)
      return {f"generated_{k}": v for k, v in got.items()}

    return squad
  return lambda rows: text_metrics.bleu(texts(rows), golds)


def text_of(encoder: text_examples.Encoder, row) -> str:
  """The text of generated ids: up to the first end, padding dropped,
  the encoder's offset removed."""
  row = np.asarray(row)
  ends = np.flatnonzero(row == encoder.end)
  row = row[: ends[0]] if len(ends) else row
  row = row[row > 0] - encoder.offset
  return encoder.tokenizer.decode([int(i) for i in row if i >= 0])
