"""Text tasks of TFDS datasets by ``config.data.format``: sentence or
sentence-pair classification (GLUE-style), extractive QA (SQuAD-style)
and translation.

How a task is posed follows the model:

- an encoder-decoder (jpipe's ``t5``, or a module whose ``__call__``
  takes (inputs, targets)) gets it text-to-text, as T5 and FTPipe's T5
  fine-tuning do: "rte sentence1: ... sentence2: ..." -> the label's
  name, "question: ... context: ..." -> the answer, source -> target.
  Loss: the targets' token cross entropy. Metric: exact match -- every
  target token (its end included) is the argmax given the true prefix,
  which is exactly when greedy decoding writes the target -- beside token
  loss and perplexity.
- a one-input model (jpipe's ``gpt`` with ``num_classes``, or the
  user's): classification reads its scores [B, C], or the last real
  token's of [B, L, C] (HuggingFace's GPT2ForSequenceClassification);
  QA reads span start and end scores [B, L, 2] (its
  ...ForQuestionAnswering) and is measured by exact match and token F1
  of the best span (its end at most ``MAX_ANSWER_TOKENS`` after its
  start, HuggingFace's max_answer_length); translation is a prefix
  language model -- source, end, target -- with the loss on the target.

Training batches read their records from the TFDS data source at each
step (a pure function of the step; only the eval split is held, encoded).
"""

import dataclasses
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

from jpipe.data import text_examples
from jpipe.train import evaluation as evaluation_lib
from jpipe.train import (
  input_pipeline,
  model_calls,
  stand_in_data,
  text_generation,
)
from jpipe.train.errors import UsageError
from jpipe.train.task import Task

FORMATS = ("classification", "qa", "translation")
MAX_ANSWER_TOKENS = 30  # Longest predicted span (HuggingFace's default).
MAX_GOLD_ANSWERS = 8  # Gold answers kept per held-out QA example.


@dataclasses.dataclass(frozen=True)
class Posing:
  """How a data format meets a model.

  Attributes:
    name: what it is ("text_to_text", "classify", "span", "prefix_lm").
    arrays: ``(records, training) -> batch arrays`` (NumPy, leading N).
    inputs: ``batch -> the model's positional inputs``.
    loss: ``(logits, batch, label_smoothing) -> scalar mean loss``.
    sums: ``(logits, batch) -> {name: sum over the batch's examples}``
      (weighted by its "weight" leaf).
    metrics: ``totals -> {metric: float}``.
    check: ``logits shape -> None, or what is wrong with it``.
  """

  name: str
  arrays: Callable[[list, bool], dict]
  inputs: Callable[[dict], tuple]
  loss: Callable
  sums: Callable
  metrics: Callable[[dict], dict]
  check: Callable[[tuple], str | None]


def build(config, model, abstract: bool = False) -> Task:
  """The Task of ``model`` on ``config.data`` (a format in FORMATS);
  ``abstract``: as ``tasks.build_task``'s (abstract params, stand-in
  records of the config's shapes)."""
  data = config.data
  input_pipeline.check_splits(data)
  tokenizer = stand_in_data.tokenizer if abstract else input_pipeline.tokenizer
  encoder = text_examples.Encoder(tokenizer(config))
  vocab = getattr(model, "vocab_size", None)
  if isinstance(vocab, int) and vocab < encoder.vocab_size:
    raise UsageError(
      f"config.model.kwargs.vocab_size={vocab} cannot hold the "
      f"{encoder.vocab_size} ids of {encoder.tokenizer.name} (0 pads, ids "
      f"shifted by {encoder.offset}): use >= {encoder.vocab_size}"
    )
  posing = posing_of(config, encoder, model_calls.is_encoder_decoder(model))
  if abstract:
    train = test = stand_in_data.records(config)
  else:
    train = input_pipeline.records(config, data.train_split)
    test = input_pipeline.records(config, data.eval_split)
  count = min(len(test), data.eval_examples or len(test))
  if count == 0:
    raise UsageError(f"config.data.eval_split={data.eval_split!r} is empty")
  held_out = posing.arrays([test[i] for i in range(count)], False)

  def records_at(step):
    batch = input_pipeline.record_batch_at(
      train, step, data.batch_size, config.seed
    )
    return posing.arrays(batch, True)

  example = records_at(0)
  first = jax.tree.map(lambda x: x[:1], example)
  train_kw = model_calls.mode_kwargs(model, True)
  eval_kw = model_calls.mode_kwargs(model, False)
  params = model_calls.initialize(
    model, abstract, config.seed, *posing.inputs(first), **eval_kw
  )["params"]
  out = jax.eval_shape(
    lambda p: model.apply({"params": p}, *posing.inputs(example), **eval_kw),
    params,
  )
  problem = posing.check(model_calls.logits_of(out).shape)
  if problem:
    raise UsageError(
      f"config.model ({config.model.name}) on {data.format} data, posed "
      f"{posing.name}: {problem}"
    )
  batch_at, rngs_of = model_calls.with_dropout(
    config,
    records_at,
    model_calls.needs_dropout_key(
      model, {"params": params}, *posing.inputs(first)
    ),
  )
  smoothing = model_calls.label_smoothing(config)

  def loss_fn(params, batch):
    out = model.apply(
      {"params": params},
      *posing.inputs(batch),
      rngs=rngs_of(batch),
      **train_kw,
    )
    return posing.loss(model_calls.logits_of(out), batch, smoothing)

  def sums_fn(params, batch):
    out = model.apply({"params": params}, *posing.inputs(batch), **eval_kw)
    return posing.sums(model_calls.logits_of(out), batch)

  return Task(
    f"{data.format} ({posing.name})",
    loss_fn,
    params,
    None,
    batch_at,
    evaluation=evaluation_lib.held_out(
      sums_fn,
      held_out,
      data.batch_size,
      posing.metrics,
      text_generation.generation(
        config, model, encoder, [test[i] for i in range(count)], held_out
      )
      if posing.name == "text_to_text" and not abstract
      else None,
    ),
  )


def posing_of(config, encoder, encoder_decoder: bool) -> Posing:
  """The Posing of ``config.data``'s format for the model's kind."""
  data = config.data
  if data.format not in FORMATS:
    raise ValueError(f"not a text task format: {data.format!r}")
  if encoder_decoder:
    return _text_to_text(config, encoder)
  if data.format == "classification":
    return _classify(config, encoder)
  if data.format == "qa":
    return _span(config, encoder)
  return _prefix_lm(config, encoder)


# Reading records -------------------------------------------------------


def _text(record, key):
  try:
    return input_pipeline.as_text(record[key])
  except KeyError:
    raise UsageError(
      f"config.data: the dataset has no feature {key!r}; it has "
      f"{sorted(record)}"
    ) from None


def _text_keys(config) -> list[str]:
  keys = [k.strip() for k in config.data.text_keys.split(",") if k.strip()]
  if not keys:
    raise UsageError("config.data.text_keys: name at least one feature")
  return keys


def _segments_and_labels(config, records, keys, names):
  """([[text, ...] per example], int labels [N]) of the ``keys``
  features; labels checked against the class ``names``."""
  data = config.data
  texts = [[_text(r, k) for k in keys] for r in records]
  labels = np.asarray([int(r[data.label_key]) for r in records], np.int64)
  bad = labels[(labels < 0) | (labels >= len(names))]
  if bad.size:
    raise UsageError(
      f"config.data ({data.name}): label {int(bad[0])} is not a class of "
      f"{names} (GLUE's test splits hide their labels as -1: train and "
      "evaluate on 'train' and 'validation')"
    )
  return texts, labels


def _answers(config, record, limit):
  """[(text, answer_start)] of a QA record, at most ``limit``."""
  answers = record[config.data.answers_key]
  texts = [input_pipeline.as_text(t) for t in np.atleast_1d(answers["text"])]
  starts = np.atleast_1d(answers["answer_start"])
  return [(t, int(s)) for t, s in zip(texts, starts, strict=False)][:limit]


# Text-to-text (encoder-decoders) ----------------------------------------


def _text_to_text(config, encoder) -> Posing:
  data = config.data
  task_name = data.name.split("/")[-1].split(":")[0]
  # Teacher-forced: every target token the argmax (not SQuAD's exact
  # match: the generated metrics are, text_generation).
  metric = (
    "accuracy"
    if data.format == "classification"
    else "teacher_forced_exact_match"
  )
  if data.format == "classification":  # Read once, not per batch.
    keys = _text_keys(config)
    names = input_pipeline.class_names(config, data.label_key)

  def arrays(records, training):
    del training
    if data.format == "classification":
      texts, labels = _segments_and_labels(config, records, keys, names)
      inputs = [text_examples.prompt(task_name, keys, t) for t in texts]
      targets = [names[label] for label in labels]
    elif data.format == "qa":
      inputs = [
        f"question: {_text(r, data.question_key)} "
        f"context: {_text(r, data.context_key)}"
        for r in records
      ]
      targets = [(_answers(config, r, 1) or [("", 0)])[0][0] for r in records]
    else:
      inputs = [_text(r, data.source_key) for r in records]
      targets = [_text(r, data.target_key) for r in records]
    return text_examples.text_to_text_arrays(
      encoder, inputs, targets, data.sequence_length, data.target_length
    )

  def loss(logits, batch, smoothing):
    targets = batch["targets"]
    weights = (targets > 0).astype(jnp.float32)
    return model_calls.mean_token_loss(logits, targets, weights, smoothing)

  def sums(logits, batch):
    targets, weight = batch["targets"], batch["weight"]
    real = targets > 0
    tokens = model_calls.token_sums(logits, targets, real * weight[:, None])
    right = (jnp.argmax(logits, -1) == targets) | ~real
    exact = jnp.all(right, axis=-1).astype(jnp.float32)
    return {
      **tokens,
      "correct": jnp.sum(exact * weight),
      "count": jnp.sum(weight),
    }

  def metrics(totals):
    return {
      metric: totals["correct"] / totals["count"],
      **evaluation_lib.token_loss(totals),
    }

  return Posing(
    "text_to_text",
    arrays,
    lambda b: (b["inputs"], b["targets"]),
    loss,
    sums,
    metrics,
    _vocab_logits(encoder, data.target_length),
  )


def _vocab_logits(encoder, length):
  def check(shape):
    if len(shape) != 3 or shape[1] != length:
      return f"expected logits [batch, {length}, vocab], got {list(shape)}"
    if shape[-1] < encoder.vocab_size:
      return (
        f"its {shape[-1]} logits per token cannot score the "
        f"{encoder.vocab_size} token ids: set config.model.kwargs."
        f"vocab_size >= {encoder.vocab_size}"
      )
    return None

  return check


# Classification (one input) ---------------------------------------------


def pooled(logits, last):
  """Scores [B, C]: ``logits`` [B, C] as they are, or [B, L, C] at each
  example's last real token ``last`` [B] (a causal model has read all of
  the example there)."""
  if logits.ndim == 2:
    return logits
  return jnp.take_along_axis(logits, last[:, None, None], axis=1)[:, 0]


def _classify(config, encoder) -> Posing:
  data = config.data
  keys = _text_keys(config)
  names = input_pipeline.class_names(config, data.label_key)
  num_classes = len(names)

  def arrays(records, training):
    del training
    texts, labels = _segments_and_labels(config, records, keys, names)
    return text_examples.classification_arrays(
      encoder, texts, labels, data.sequence_length
    )

  def loss(logits, batch, smoothing):
    scores = pooled(logits, batch["last"])
    return model_calls.cross_entropy(scores, batch["y"], smoothing).mean()

  def sums(logits, batch):
    scores = pooled(logits, batch["last"])
    hits = (jnp.argmax(scores, -1) == batch["y"]).astype(jnp.float32)
    weight = batch["weight"]
    return {"correct": jnp.sum(hits * weight), "count": jnp.sum(weight)}

  def check(shape):
    if len(shape) in (2, 3) and shape[-1] == num_classes:
      return None
    return (
      f"expected scores [batch, {num_classes}] or [batch, length, "
      f"{num_classes}] for the {num_classes} classes, got {list(shape)}: "
      f"set config.model.kwargs.num_classes={num_classes} (jpipe's gpt) or "
      f"give the module {num_classes} outputs"
    )

  return Posing(
    "classify",
    arrays,
    lambda b: (b["x"],),
    loss,
    sums,
    evaluation_lib.accuracy,
    check,
  )


# Extractive QA (one input) ----------------------------------------------


def best_span(start_scores, end_scores):
  """(start [B], end [B]) maximising start + end scores over spans with
  start <= end < start + MAX_ANSWER_TOKENS; scores [B, L]."""
  length = start_scores.shape[-1]
  pos = jnp.arange(length)
  allowed = (pos[None, :] >= pos[:, None]) & (
    pos[None, :] < pos[:, None] + MAX_ANSWER_TOKENS
  )  # [start, end]
  total = start_scores[:, :, None] + end_scores[:, None, :]
  total = jnp.where(allowed[None], total, -jnp.inf).reshape(len(total), -1)
  best = jnp.argmax(total, axis=-1)
  return best // length, best % length


def span_scores(predicted_start, predicted_end, gold_start, gold_end):
  """(exact [B], f1 [B]): against the best of each example's gold spans
  [B, K] (-1: none), exact match and token-overlap F1 (SQuAD's F1 on
  tokens instead of normalised words)."""
  ps, pe = predicted_start[:, None], predicted_end[:, None]
  real = gold_start >= 0
  exact = jnp.any(real & (ps == gold_start) & (pe == gold_end), axis=-1)
  overlap = jnp.maximum(
    0, jnp.minimum(pe, gold_end) - jnp.maximum(ps, gold_start) + 1
  )
  precision = overlap / jnp.maximum(pe - ps + 1, 1)
  recall = overlap / jnp.maximum(gold_end - gold_start + 1, 1)
  f1 = jnp.where(
    real & (overlap > 0),
    2 * precision * recall / jnp.maximum(precision + recall, 1e-9),
    0.0,
  )
  return exact.astype(jnp.float32), jnp.max(f1, axis=-1)


def _span(config, encoder) -> Posing:
  data = config.data

  def arrays(records, training):
    limit = 1 if training else MAX_GOLD_ANSWERS
    answers = [_answers(config, r, limit) for r in records]
    return text_examples.span_arrays(
      encoder,
      [_text(r, data.question_key) for r in records],
      [_text(r, data.context_key) for r in records],
      answers,
      data.sequence_length,
      max_answers=max(1, max(len(a) for a in answers)),
    )

  def loss(logits, batch, smoothing):
    start, end = batch["start"][:, 0], batch["end"][:, 0]
    # An answer cut off by the length (span -1) teaches nothing.
    has = (start >= 0).astype(jnp.float32)
    xent = model_calls.cross_entropy
    per_example = 0.5 * (
      xent(logits[..., 0], jnp.maximum(start, 0), smoothing)
      + xent(logits[..., 1], jnp.maximum(end, 0), smoothing)
    )
    return jnp.sum(per_example * has) / jnp.maximum(jnp.sum(has), 1.0)

  def sums(logits, batch):
    ps, pe = best_span(logits[..., 0], logits[..., 1])
    exact, f1 = span_scores(ps, pe, batch["start"], batch["end"])
    weight = batch["weight"]
    return {
      "exact": jnp.sum(exact * weight),
      "f1": jnp.sum(f1 * weight),
      "count": jnp.sum(weight),
    }

  def metrics(totals):
    return {
      # Of answer positions in the context, not SQuAD's normalised text.
      "span_exact_match": totals["exact"] / totals["count"],
      "span_f1": totals["f1"] / totals["count"],
    }

  def check(shape):
    if len(shape) == 3 and shape[1:] == (data.sequence_length, 2):
      return None
    return (
      f"expected span scores [batch, {data.sequence_length}, 2] (start, "
      f"end), got {list(shape)}: set config.model.kwargs.num_classes=2 "
      "(jpipe's gpt) or give the module 2 outputs per token"
    )

  return Posing("span", arrays, lambda b: (b["x"],), loss, sums, metrics, check)


# Translation (one input): a prefix language model ------------------------


def _prefix_lm(config, encoder) -> Posing:
  data = config.data

  def arrays(records, training):
    del training
    return text_examples.prefix_lm_arrays(
      encoder,
      [_text(r, data.source_key) for r in records],
      [_text(r, data.target_key) for r in records],
      data.sequence_length,
    )

  def loss(logits, batch, smoothing):
    return model_calls.mean_token_loss(
      logits, batch["y"], batch["mask"], smoothing
    )

  def sums(logits, batch):
    weights = batch["mask"] * batch["weight"][:, None]
    return model_calls.token_sums(logits, batch["y"], weights)

  return Posing(
    "prefix_lm",
    arrays,
    lambda b: (b["x"],),
    loss,
    sums,
    evaluation_lib.token_loss,
    _vocab_logits(encoder, data.sequence_length),
  )
