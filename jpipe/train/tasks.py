"""What a config trains: data + model + loss + evaluation, as a Task.

Three ways to name it:
- a jpipe model (``config.model.name``: ``mlp``, ``resnet`` and ``vgg``
  classify images, ``gpt`` predicts the next byte of a text, ``t5``
  reconstructs T5-style corrupted spans of a text);
- the user's Flax module on one of those tasks
  (``config.model.name=package.module:Module``, built with
  ``config.model.kwargs``; the task is the config's data's: image fields
  classify, text fields model the language, span-corruption fields make
  it seq2seq);
- any model on a text task of a TFDS dataset (``config.data.format``
  ``classification``, ``qa`` or ``translation``: GLUE-, SQuAD- and
  WMT-style data; ``jpipe.train.text_tasks`` poses each text-to-text for
  an encoder-decoder, with a head for a one-input model);
- the user's whole task (``config.task=package.module:build``): a
  function of the config returning a :class:`Task` (the protocol:
  ``jpipe.train.task``), checked on return.

Batches are pure functions of the step, so a resumed run sees the data an
uninterrupted one would; so is dropout's randomness, which travels in the
batch (see ``model_calls.with_dropout``).
"""

import dataclasses
import functools
import importlib
import sys

import flax.linen as nn
import jax
import jax.numpy as jnp

from jpipe import partition as partition_lib
from jpipe.data import sequences
from jpipe.runtime import check_grad_accum_dtype
from jpipe.train import (
  errors,
  input_pipeline,
  model_calls,
  pretraining,
  stand_in_data,
  text_tasks,
  user_code,
)
from jpipe.train import evaluation as evaluation_lib
from jpipe.train.errors import UsageError
from jpipe.train.evaluation import Evaluation
from jpipe.train.task import Task, check_task

__all__ = ["Task", "build_task", "check_task", "flax_module", "task_of_data"]

TASK_OF_MODEL = {
  "mlp": "classification",
  "resnet": "classification",  # Wide ResNets (WRN-28-10: size "28-10").
  # The ImageNet ResNets, 18 to 152 ("50": PipeDream's, SD-Pipe's).
  "imagenet_resnet": "classification",
  "vgg": "classification",
  "gpt": "language_model",
  "t5": "seq2seq",
  "t5_v1": "seq2seq",  # T5 as published (v1.0 / v1.1), HF weights.
  "gnmt": "seq2seq",  # GNMT-8 / 16: LSTMs with attention (PipeDream's).
  "gpt2": "language_model",  # GPT-2 as published, HF weights.
  # BERT as published, HF weights: its classification or span head on a
  # text task's data (config.data.format classification or qa).
  "bert": "text task",
}


def build_task(config, abstract: bool = False) -> Task:
  """Loads the data and initialises the model the config names: the
  user's task (``config.task``), or a model (jpipe's, or the user's by
  import path) on the task of the config's data; its floating params in
  ``config.model.param_dtype`` where given.

  ``abstract``: for planning a model too big to hold (``python -m
  jpipe.train.plan``): the params and model state are
  ``jax.ShapeDtypeStruct``s (``jax.eval_shape`` of the init: nothing of
  the model's size is allocated) and the batches stand-ins of the
  config's shapes (``stand_in_data``: the dataset is not read). The loss
  is the training one; such a Task is traced, never run."""
  task = _build_task(config, abstract)
  dtype = check_grad_accum_dtype(config.model.get("param_dtype", ""))
  if dtype is None:
    return task
  return dataclasses.replace(task, params=_cast_params(task.params, dtype))


def _cast_params(params, dtype):
  """``params`` with their floating leaves in ``dtype`` (arrays, or avals
  of an abstract task)."""

  def cast(x):
    if not jnp.issubdtype(x.dtype, jnp.floating) or x.dtype == dtype:
      return x
    if isinstance(x, jax.ShapeDtypeStruct):
      return jax.ShapeDtypeStruct(x.shape, dtype)
    return x.astype(dtype)

  return jax.tree.map(cast, params)


def _build_task(config, abstract: bool) -> Task:
  if config.get("task"):
    if abstract:
      raise UsageError(
        f"config.task={config.task!r}: a task of your own is planned on "
        "its real params and data (python -m jpipe.train.plan plans "
        "jpipe's tasks abstractly)"
      )
    return _user_task(config)
  name = config.model.name
  if user_code.is_import_path(name):
    model_class = flax_module(name)
    kind, where = task_of_data(config.data), name
  else:
    if config.data.get("format"):  # One not in the list stops here.
      task_of_data(config.data)
    kind = TASK_OF_MODEL.get(name)
    if kind is None:
      raise UsageError(
        f"config.model.name: no model {name!r} in jpipe.models "
        f"({', '.join(TASK_OF_MODEL)}); name your own as package.module:Module"
      )
    model_class = _jpipe_model(name).Model
    where = f"jpipe.models.{name}.Model"
  kwargs = model_kwargs(config)
  try:
    model = model_class(**kwargs)
  except TypeError as e:  # An unknown or missing keyword.
    raise errors.model_kwargs_error(where, e, config.model.kwargs) from e
  if config.data.get("format") in text_tasks.FORMATS:
    return text_tasks.build(config, model, abstract)
  if "mask_rate" in config.data:  # BERT's pre-training: masked LM + NSP.
    # [CLS] a [SEP] b [SEP]: a sequence holds length - 3 text tokens.
    need = config.data.sequence_length - 2
    tokenizer, (train, test) = _tokens(config, abstract, need)
    return pretraining.build(config, model, tokenizer, train, test, abstract)
  if kind == "text task":
    raise UsageError(
      f"config.model.name={name!r} trains on a text task's data: start "
      "config.data from base_config.text_classification_data or qa_data "
      "(with config.model.kwargs.head='classification' or 'qa'), or "
      "text_data(name, masked_lm=True) to pre-train it (head 'pretraining')"
    )
  return {
    "classification": _classification,
    "language_model": _language_model,
    "seq2seq": _seq2seq,
  }[kind](config, model, abstract)


def model_kwargs(config) -> dict:
  """The model's keyword arguments: its module's ``SIZES[config.model.
  size]`` (a jpipe model's named sizes: ``t5_v1``'s "3b", "v1_1-xl",
  ``gpt2``'s "xl", ``bert``'s "large"),
  then ``config.model.kwargs`` over them."""
  kwargs = config.model.kwargs.to_dict()
  size = config.model.get("size", "")
  if not size:
    return kwargs
  name = config.model.name
  sizes = getattr(_jpipe_model(name), "SIZES", {})
  if size not in sizes:
    raise UsageError(
      f"config.model.size={size!r}: model {name!r} has "
      + (f"sizes {sorted(sizes)}" if sizes else "no named sizes")
    )
  return {**sizes[size], **kwargs}


def too_few_nodes(config, error: partition_lib.TooFewNodes) -> str:
  """The line for ``error`` (more stages than the config's model has
  nodes): a jpipe model's fix is more layers, not the partitioner's
  generic ones (named scopes, opened control flow)."""
  deeper = _depth_hint(config)
  if not deeper or error.most is None:
    return str(error)
  return f"{error.cause}; use at most {error.most} stages{deeper}"


def _depth_hint(config) -> str:
  """How to give a jpipe model more layers (``, or a deeper model
  (config.model.kwargs.num_layers=4 now)``); empty for a model of the
  user's or one without such a field."""
  name = config.model.name
  if user_code.is_import_path(name) or name not in TASK_OF_MODEL:
    return ""
  fields = dataclasses.fields(_jpipe_model(name).Model)
  now = {f.name: f.default for f in fields} | model_kwargs(config)
  for field in ("num_layers", "depth", "hidden"):
    value = now.get(field)
    if isinstance(value, int) and field != "hidden":
      return f", or a deeper model (config.model.kwargs.{field}={value} now)"
    if isinstance(value, (tuple, list)):  # The MLP: a width per layer.
      return (
        f", or more layers (config.model.kwargs.{field}={tuple(value)} now: "
        "a width per hidden layer)"
      )
  return ""


def hf_names(config) -> dict:
  """The name map of the config's model to HuggingFace checkpoints
  (``jpipe.models.<name>.hf_names``); a UsageError if it has none."""
  name = config.model.name
  module = _jpipe_model(name)
  if not hasattr(module, "hf_names"):
    takers = [m for m in TASK_OF_MODEL if hasattr(_jpipe_model(m), "hf_names")]
    raise UsageError(
      f"config.init_from={config.init_from!r}: model {name!r} cannot take "
      f"HuggingFace checkpoints; these can: {takers}"
    )
  return module.hf_names(module.Model(**model_kwargs(config)))


def _jpipe_model(name: str):
  """The module ``jpipe.models.<name>`` of a jpipe model's name; None for
  any other name (the user's, by import path)."""
  if name not in TASK_OF_MODEL:
    return None
  return importlib.import_module(f"jpipe.models.{name}")


def flax_module(path: str):
  """The model class ``config.model.name`` names by import path: a
  ``flax.linen.Module`` subclass, or an ``nnx.Module`` subclass wrapped
  to be called the same way (``nnx_models.NnxModel``)."""
  value = user_code.load(path, "model.name", want="a Flax module class")
  if _is_nnx_class(value):
    from jpipe.train import nnx_models  # (flax.nnx: ~0.3 s, only for NNX.)

    return functools.partial(nnx_models.NnxModel, value)
  if not (isinstance(value, type) and issubclass(value, nn.Module)):
    raise UsageError(
      f"config.model.name={path!r} is not a Flax module class (linen or "
      "NNX); for any other model write a task of your own (config.task)"
    )
  return value


def _is_nnx_class(value) -> bool:
  """Whether ``value`` is an ``nnx.Module`` subclass, without importing
  flax.nnx: a module defining one has imported it already."""
  nnx = sys.modules.get("flax.nnx")
  return (
    nnx is not None
    and isinstance(value, type)
    and (issubclass(value, nnx.Module))
  )


def task_of_data(data) -> str:
  """The built-in task a config's data fields describe: images classify
  (``base_config.image_data``), text models the language
  (``text_data``), with span-corruption fields it is seq2seq; a text
  task's format (``text_classification_data``, ``qa_data``,
  ``translation_data``) is its own."""
  fmt = data.get("format")
  if fmt in text_tasks.FORMATS:
    return f"text {fmt}"  # (Not "classification": that of images.)
  if fmt not in (None, "images", "text"):
    raise UsageError(
      f"config.data.format={fmt!r} is not one of "
      f"{('images', 'text') + text_tasks.FORMATS}"
    )
  if "image_key" in data:
    return "classification"
  if "noise_density" in data:
    return "seq2seq"
  if "mask_rate" in data:
    return "masked_lm"
  if "text_key" in data:
    return "language_model"
  raise UsageError(
    "config.data has neither image nor text fields, so a model named by "
    "import path has no task: start the config's data from "
    "base_config.image_data() or text_data(), or set config.task"
  )


def _user_task(config) -> Task:
  """The Task ``config.task``'s function returns, checked."""
  build = user_code.load(
    config.task, "task", want="a function config -> jpipe.train.tasks.Task"
  )
  return check_task(build(config), f"config.task={config.task!r}")


def _classification(config, model, abstract=False) -> Task:
  load = stand_in_data.images if abstract else input_pipeline.load_images
  train, test = load(config)
  bs = config.data.batch_size

  def images_at(step):
    return input_pipeline.image_batch_at(train, step, bs, config.seed)

  example = images_at(0)
  variables = model_calls.initialize(
    model,
    abstract,
    config.seed,
    example["x"][:1],
    **model_calls.mode_kwargs(model, False),
  )
  batch_at, rngs_of = model_calls.with_dropout(
    config,
    images_at,
    model_calls.needs_dropout_key(model, variables, example["x"][:1]),
  )
  _check_logits(
    config, model, variables, example["x"][:1], classes_of(config, train, test)
  )
  has_stats = "batch_stats" in variables
  loss_fn, logits_fn = _classifier_fns(
    model, has_stats, rngs_of, model_calls.label_smoothing(config)
  )
  return Task(
    "classification",
    loss_fn,
    variables["params"],
    variables.get("batch_stats"),
    batch_at,
    evaluation=_accuracy(config, logits_fn, has_stats, test, bs),
  )


def classes_of(config, train, test) -> int:
  """The classes a classifier of the config's images must score: the TFDS
  label feature's count for streamed images (0 where it gives none),
  else one more than the largest label of either split."""
  if isinstance(train, input_pipeline.StreamedImages):
    label = input_pipeline.feature(config, config.data.label_key)
    return int(getattr(label, "num_classes", 0) or 0)
  return 1 + int(max(train.labels.max(initial=-1), test.labels.max(initial=-1)))


def _check_logits(config, model, variables, x, classes: int) -> None:
  """The model's logits of images ``x`` must be [len(x), >= classes]; a
  UsageError naming their shape and the fix otherwise (too few classes
  trained to a non-finite loss, a wrong rank failed inside optax)."""
  shape = model_calls.logits_shape(model, variables, x)
  if len(shape) == 2 and shape[0] == len(x) and shape[1] >= classes:
    return
  fix = (
    f"set config.model.kwargs.num_classes={classes}"
    if hasattr(model, "num_classes")
    else f"give {config.model.name} {classes} outputs, one per class"
  )
  raise UsageError(
    f"config.model ({config.model.name}) gives logits of shape {shape} for "
    f"{len(x)} image; classifying {config.data.name} needs "
    f"[batch, classes] = [{len(x)}, {classes}] (its labels run 0.."
    f"{classes - 1}): {fix}"
  )


def _classifier_fns(model, has_stats: bool, rngs_of, smoothing=0.0):
  """``(loss_fn, logits_fn)`` of an image classifier: the mean cross
  entropy of a training batch (labels smoothed by ``smoothing``; with
  BatchNorm statistics as model state where the model has them) and
  evaluation logits ``logits_fn(params, stats, x)``."""
  train_kw, eval_kw = (
    model_calls.mode_kwargs(model, True),
    model_calls.mode_kwargs(model, False),
  )

  def xent(logits, labels):
    return model_calls.cross_entropy(
      model_calls.logits_of(logits), labels, smoothing
    )

  if has_stats:

    def loss_fn(params, stats, batch):
      logits, updates = model.apply(
        {"params": params, "batch_stats": stats},
        batch["x"],
        mutable=["batch_stats"],
        rngs=rngs_of(batch),
        **train_kw,
      )
      return xent(logits, batch["y"]).mean(), updates["batch_stats"]

    def logits_fn(params, stats, x):
      return model_calls.logits_of(
        model.apply({"params": params, "batch_stats": stats}, x, **eval_kw)
      )

    return loss_fn, logits_fn

  def plain_loss_fn(params, batch):
    logits = model.apply(
      {"params": params}, batch["x"], rngs=rngs_of(batch), **train_kw
    )
    return xent(logits, batch["y"]).mean()

  def plain_logits_fn(params, stats, x):
    del stats
    return model_calls.logits_of(model.apply({"params": params}, x, **eval_kw))

  return plain_loss_fn, plain_logits_fn


def _accuracy(config, logits_fn, has_stats, test, batch_size):
  """The accuracy on the test images, in batches of ``batch_size``."""

  def sums(params, stats, batch):
    logits = logits_fn(params, stats, batch["x"])
    hits = (jnp.argmax(logits, -1) == batch["y"]).astype(jnp.float32)
    weight = batch["weight"]
    return {"correct": jnp.sum(hits * weight), "count": jnp.sum(weight)}

  def plain_sums(params, batch):
    return sums(params, None, batch)

  if isinstance(test, input_pipeline.StreamedImages):  # Read per batch.
    count = config.data.get("eval_examples", 0)

    def batches():
      return input_pipeline.streamed_eval_batches(test, batch_size, count)

  else:
    held_out = evaluation_lib.padded_batches(
      {"x": test.images, "y": test.labels}, batch_size
    )

    def batches():
      return held_out

  return Evaluation(
    sums if has_stats else plain_sums, batches, evaluation_lib.accuracy
  )


def _language_model(config, model, abstract=False) -> Task:
  need = config.data.sequence_length + 1  # Inputs and their next tokens.
  tokenizer, (train, test) = _tokens(config, abstract, need)
  vocab = getattr(model, "vocab_size", tokenizer.vocab_size)
  if vocab < tokenizer.vocab_size:
    raise UsageError(
      f"config.model.kwargs.vocab_size={vocab} cannot hold the "
      f"{tokenizer.vocab_size} ids of tokenizer {tokenizer.name}: use >= "
      f"{tokenizer.vocab_size}"
    )
  data = config.data
  length = data.sequence_length

  def windows_at(step):
    return sequences.lm_batch_at(
      train, step, data.batch_size, length, config.seed
    )

  example = windows_at(0)
  train_kw, eval_kw = (
    model_calls.mode_kwargs(model, True),
    model_calls.mode_kwargs(model, False),
  )
  params = model_calls.initialize(
    model, abstract, config.seed, example["x"][:1], **eval_kw
  )["params"]
  batch_at, rngs_of = model_calls.with_dropout(
    config,
    windows_at,
    model_calls.needs_dropout_key(model, {"params": params}, example["x"][:1]),
  )
  _check_lm_logits(config, model, params, example["x"][:1], tokenizer)
  smoothing = model_calls.label_smoothing(config)

  def loss_fn(params, batch):
    logits = model.apply(
      {"params": params}, batch["x"], rngs=rngs_of(batch), **train_kw
    )
    return model_calls.cross_entropy(
      model_calls.logits_of(logits), batch["y"], smoothing
    ).mean()

  def sums(params, batch):
    logits = model_calls.logits_of(
      model.apply({"params": params}, batch["x"], **eval_kw)
    )
    weights = jnp.broadcast_to(batch["weight"][:, None], batch["y"].shape)
    return model_calls.token_sums(logits, batch["y"], weights)

  held_out = sequences.lm_eval_windows(test, length, data.eval_sequences)
  return Task(
    "language_model",
    loss_fn,
    params,
    None,
    batch_at,
    evaluation=evaluation_lib.held_out(
      sums, held_out, data.batch_size, evaluation_lib.token_loss
    ),
  )


def _check_lm_logits(config, model, params, x, tokenizer) -> None:
  """A language model's logits of sequences ``x`` must be [len(x),
  length, >= the tokenizer's vocabulary]; a UsageError naming their
  shape and the fix otherwise."""
  shape = model_calls.logits_shape(model, {"params": params}, x)
  want = (*x.shape, tokenizer.vocab_size)
  if len(shape) == 3 and shape[:2] == want[:2] and shape[2] >= want[2]:
    return
  fix = (
    f"set config.model.kwargs.vocab_size={want[2]}"
    if hasattr(model, "vocab_size")
    else f"give {config.model.name} {want[2]} outputs per token"
  )
  raise UsageError(
    f"config.model ({config.model.name}) gives logits of shape {shape} for "
    f"{want[0]} sequence of {want[1]} tokens; a language model needs "
    f"[batch, length, vocab] = {list(want)} ({tokenizer.name} ids run "
    f"0..{want[2] - 1}): {fix}"
  )


def _tokens(config, abstract: bool, need: int):
  """(tokenizer, (train, eval) token streams) of the config's text (each
  of at least ``need`` tokens, one sequence), or stand-ins of its shapes
  (``abstract``)."""
  if abstract:
    return stand_in_data.tokenizer(config), stand_in_data.token_streams(config)
  tokenizer = input_pipeline.tokenizer(config)
  return tokenizer, input_pipeline.load_tokens(config, tokenizer, need)


def _span_corruption(config, tokenizer, model) -> dict:
  """T5's span-corruption settings (``sequences.seq2seq_batch_at``'s
  keywords) for ``tokenizer``'s ids, checked against the model's
  vocabulary: ids shifted so that 0 is padding only, the span sentinels
  after the vocabulary."""
  data = config.data
  _, num_spans, _, _ = sequences.span_lengths(
    data.sequence_length, data.noise_density, data.mean_span_length
  )
  offset = tokenizer.seq2seq_offset
  first_sentinel = tokenizer.vocab_size + offset
  need = first_sentinel + num_spans
  if getattr(model, "vocab_size", need) < need:
    raise UsageError(
      f"config.model.kwargs.vocab_size={model.vocab_size} cannot hold the "
      f"{first_sentinel} token ids ({tokenizer.name}) and {num_spans} span "
      f"sentinels: use >= {need}"
    )
  return dict(
    noise_density=data.noise_density,
    mean_span_length=data.mean_span_length,
    offset=offset,
    first_sentinel=first_sentinel,
  )


def _seq2seq(config, model, abstract=False) -> Task:
  """T5-style span corruption on the configured text: the encoder reads
  a window with spans replaced by sentinels, the decoder writes the
  spans; held-out token loss."""
  need = config.data.sequence_length  # One window, corrupted.
  tokenizer, (train, test) = _tokens(config, abstract, need)
  data = config.data
  spans = _span_corruption(config, tokenizer, model)

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
  train_kw, eval_kw = (
    model_calls.mode_kwargs(model, True),
    model_calls.mode_kwargs(model, False),
  )
  params = model_calls.initialize(
    model,
    abstract,
    config.seed,
    example["inputs"][:1],
    example["targets"][:1],
    **eval_kw,
  )["params"]
  smoothing = model_calls.label_smoothing(config)

  def loss_fn(params, batch):
    logits = model.apply(
      {"params": params}, batch["inputs"], batch["targets"], **train_kw
    )
    weights = (batch["targets"] > 0).astype(jnp.float32)
    return model_calls.mean_token_loss(
      model_calls.logits_of(logits), batch["targets"], weights, smoothing
    )

  def sums(params, batch):
    logits = model.apply(
      {"params": params}, batch["inputs"], batch["targets"], **eval_kw
    )
    weights = (batch["targets"] > 0) * batch["weight"][:, None]
    return model_calls.token_sums(
      model_calls.logits_of(logits), batch["targets"], weights
    )

  held_out = sequences.seq2seq_eval_batch(
    test, data.sequence_length, data.eval_sequences, **spans
  )
  return Task(
    "seq2seq",
    loss_fn,
    params,
    None,
    batch_at,
    evaluation=evaluation_lib.held_out(
      sums, held_out, data.batch_size, evaluation_lib.token_loss
    ),
  )
