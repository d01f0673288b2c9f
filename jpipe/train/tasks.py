"""What a config trains: data + model + loss + evaluation, as a Task.

The model decides the task: ``mlp``, ``resnet`` and ``vgg`` classify
images, ``gpt`` predicts the next byte of a text, ``t5`` reconstructs
T5-style corrupted spans of a text. Batches are pure functions of the
step, so a resumed run sees the data an uninterrupted one would; so is
dropout's randomness, which travels in the batch (see ``_dropout``).
"""

import dataclasses
import importlib
import math
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jpipe.data import sequences
from jpipe.train import input_pipeline
from jpipe.train.errors import UsageError

TASK_OF_MODEL = {
  "mlp": "classification",
  "resnet": "classification",
  "vgg": "classification",
  "gpt": "language_model",
  "t5": "seq2seq",
}


@dataclasses.dataclass(frozen=True)
class Task:
  """A model with its loss, its data and its evaluation.

  Attributes:
    kind: "classification", "language_model" or "seq2seq".
    loss_fn: ``(params, batch) -> loss``, or with BatchNorm
      ``(params, model_state, batch) -> (loss, new_model_state)``.
    params: the initial parameters.
    model_state: BatchNorm statistics, or None.
    batch_at: step -> the training batch of that step (host arrays).
    evaluate: (params, model_state) -> {metric name: value} on the eval
      split: "accuracy" for classification, "loss" (nats per token) and
      "perplexity" for text.
  """

  kind: str
  loss_fn: Callable
  params: object
  model_state: object
  batch_at: Callable[[int], dict]
  evaluate: Callable[[object, object], dict]


def build_task(config) -> Task:
  """Loads the data and initialises the model the config names."""
  kind = TASK_OF_MODEL.get(config.model.name)
  if kind is None:
    raise UsageError(
      f"config.model.name: no model {config.model.name!r} in jpipe.models "
      f"({', '.join(TASK_OF_MODEL)})"
    )
  module = importlib.import_module(f"jpipe.models.{config.model.name}")
  try:
    model = module.Model(**config.model.kwargs.to_dict())
  except TypeError as e:  # An unknown or missing keyword.
    raise UsageError(
      f"config.model.kwargs of jpipe.models.{config.model.name}.Model: {e}"
    ) from e
  return {
    "classification": _classification,
    "language_model": _language_model,
    "seq2seq": _seq2seq,
  }[kind](config, model)


def _dropout(config, batch_at):
  """(batch_at, rngs_of) for a model with ``kwargs.dropout`` > 0.

  Dropout keys ride in the batch as ``dropout_key`` uint32 [B, 2] (raw
  threefry key data, one row per example, drawn from (seed, step)): the
  pipeline splits them with the batch, each microbatch seeds its masks
  from its first row, and a resumed run redraws the same masks -- the RNG
  state is the step. Without dropout, batches are unchanged.
  """
  if not config.model.kwargs.to_dict().get("dropout"):
    return batch_at, lambda batch: {}

  def with_keys(step):
    batch = batch_at(step)
    size = len(next(iter(batch.values())))
    rng = np.random.default_rng([config.seed, step, 1])
    keys = rng.integers(0, 2**32, size=(size, 2), dtype=np.uint32)
    return {**batch, "dropout_key": keys}

  def rngs_of(batch):
    return {"dropout": jax.random.wrap_key_data(batch["dropout_key"][0])}

  return with_keys, rngs_of


def _classification(config, model) -> Task:
  train, test = input_pipeline.load_images(config)
  bs = config.data.batch_size

  def images_at(step):
    return input_pipeline.image_batch_at(train, step, bs, config.seed)

  batch_at, rngs_of = _dropout(config, images_at)
  example = batch_at(0)
  variables = model.init(jax.random.key(config.seed), example["x"][:1])
  loss_fn, logits_fn = _classifier_fns(
    model, "batch_stats" in variables, rngs_of
  )
  return Task(
    "classification",
    loss_fn,
    variables["params"],
    variables.get("batch_stats"),
    batch_at,
    _accuracy(logits_fn, test),
  )


def _classifier_fns(model, has_stats: bool, rngs_of):
  """``(loss_fn, logits_fn)`` of an image classifier: the mean cross
  entropy of a training batch (with BatchNorm statistics as model state
  where the model has them) and evaluation logits
  ``logits_fn(params, stats, x)``."""

  def xent(logits, labels):
    return optax.softmax_cross_entropy_with_integer_labels(logits, labels)

  if has_stats:

    def loss_fn(params, stats, batch):
      logits, updates = model.apply(
        {"params": params, "batch_stats": stats},
        batch["x"],
        mutable=["batch_stats"],
        rngs=rngs_of(batch),
      )
      return xent(logits, batch["y"]).mean(), updates["batch_stats"]

    def logits_fn(params, stats, x):
      return model.apply(
        {"params": params, "batch_stats": stats}, x, train=False
      )

    return loss_fn, logits_fn

  def plain_loss_fn(params, batch):
    logits = model.apply({"params": params}, batch["x"], rngs=rngs_of(batch))
    return xent(logits, batch["y"]).mean()

  def plain_logits_fn(params, stats, x):
    del stats
    return model.apply({"params": params}, x, train=False)

  return plain_loss_fn, plain_logits_fn


def _accuracy(logits_fn, test):
  """``evaluate(params, stats)``: the accuracy on the test images."""

  @jax.jit
  def correct(params, stats, x, y):
    return jnp.sum(jnp.argmax(logits_fn(params, stats, x), -1) == y)

  def evaluate(params, stats, batch_size=512):
    hits = 0
    for i in range(0, len(test.labels), batch_size):
      hits += int(
        correct(
          params,
          stats,
          test.images[i : i + batch_size],
          test.labels[i : i + batch_size],
        )
      )
    return {"accuracy": hits / len(test.labels)}

  return evaluate


def _mean_token_loss(logits, targets, weights):
  """Mean cross-entropy (nats) over positions with weight 1."""
  losses = optax.softmax_cross_entropy_with_integer_labels(logits, targets)
  return jnp.sum(losses * weights) / jnp.maximum(jnp.sum(weights), 1.0)


def _eval_loss(loss_of_batch, params, batch: dict, batch_size=32) -> dict:
  """Token-weighted mean loss over ``batch`` in chunks; + perplexity."""
  n = len(next(iter(batch.values())))
  total, tokens = 0.0, 0.0
  for i in range(0, n, batch_size):
    chunk = {k: v[i : i + batch_size] for k, v in batch.items()}
    loss, count = loss_of_batch(params, chunk)
    total += float(loss) * float(count)
    tokens += float(count)
  loss = total / tokens
  return {"loss": loss, "perplexity": math.exp(loss)}


def _language_model(config, model) -> Task:
  train, test = input_pipeline.load_text(config)
  data = config.data
  length = data.sequence_length

  def windows_at(step):
    return sequences.lm_batch_at(
      train, step, data.batch_size, length, config.seed
    )

  batch_at, rngs_of = _dropout(config, windows_at)
  example = batch_at(0)
  params = model.init(jax.random.key(config.seed), example["x"][:1])["params"]

  def loss_fn(params, batch):
    logits = model.apply({"params": params}, batch["x"], rngs=rngs_of(batch))
    return optax.softmax_cross_entropy_with_integer_labels(
      logits, batch["y"]
    ).mean()

  @jax.jit
  def loss_and_count(params, batch):
    logits = model.apply({"params": params}, batch["x"], train=False)
    weights = jnp.ones(batch["y"].shape, jnp.float32)
    return _mean_token_loss(logits, batch["y"], weights), weights.sum()

  held_out = sequences.lm_eval_windows(test, length, data.eval_sequences)

  def evaluate(params, stats):
    del stats
    return _eval_loss(loss_and_count, params, held_out)

  return Task("language_model", loss_fn, params, None, batch_at, evaluate)


def _seq2seq(config, model) -> Task:
  train, test = input_pipeline.load_text(config)
  data = config.data
  _, num_spans, _, _ = sequences.span_lengths(
    data.sequence_length, data.noise_density, data.mean_span_length
  )
  need = sequences.BYTE_VOCAB + num_spans
  if model.vocab_size < need:
    raise UsageError(
      f"config.model.kwargs.vocab_size={model.vocab_size} cannot hold the "
      f"{sequences.BYTE_VOCAB} byte tokens and {num_spans} span "
      f"sentinels: use >= {need}"
    )
  spans = dict(
    noise_density=data.noise_density, mean_span_length=data.mean_span_length
  )

  def batch_at(step):
    return sequences.seq2seq_batch_at(
      train,
      step,
      data.batch_size,
      data.sequence_length,
      config.seed,
      **spans,
    )

  example = batch_at(0)
  params = model.init(
    jax.random.key(config.seed),
    example["inputs"][:1],
    example["targets"][:1],
  )["params"]

  def loss_fn(params, batch):
    logits = model.apply({"params": params}, batch["inputs"], batch["targets"])
    weights = (batch["targets"] > 0).astype(jnp.float32)
    return _mean_token_loss(logits, batch["targets"], weights)

  @jax.jit
  def loss_and_count(params, batch):
    logits = model.apply(
      {"params": params}, batch["inputs"], batch["targets"], train=False
    )
    weights = (batch["targets"] > 0).astype(jnp.float32)
    return _mean_token_loss(logits, batch["targets"], weights), weights.sum()

  held_out = sequences.seq2seq_eval_batch(
    test, data.sequence_length, data.eval_sequences, **spans
  )

  def evaluate(params, stats):
    del stats
    return _eval_loss(loss_and_count, params, held_out)

  return Task("seq2seq", loss_fn, params, None, batch_at, evaluate)
