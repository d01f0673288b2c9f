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
- the user's whole task (``config.task=package.module:build``): a
  function of the config returning a :class:`Task` -- the protocol below,
  checked on return.

Batches are pure functions of the step, so a resumed run sees the data an
uninterrupted one would; so is dropout's randomness, which travels in the
batch (see ``_dropout``).
"""

import dataclasses
import importlib
import inspect
from collections.abc import Callable

import flax
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax

from jpipe.data import sequences
from jpipe.train import evaluation as evaluation_lib
from jpipe.train import input_pipeline, user_code
from jpipe.train.errors import UsageError
from jpipe.train.evaluation import Evaluation

TASK_OF_MODEL = {
  "mlp": "classification",
  "resnet": "classification",
  "vgg": "classification",
  "gpt": "language_model",
  "t5": "seq2seq",
}


@dataclasses.dataclass(frozen=True)
class Task:
  """A model with its loss, its data and its evaluation: what
  ``python -m jpipe.train`` trains. A function named by
  ``config.task=package.module:build`` takes the config and returns one.

  Attributes:
    kind: what it is, for people ("classification", "language_model",
      "seq2seq" or the user's own word).
    loss_fn: ``loss_fn(params, batch) -> loss`` (a scalar: the batch's
      mean), or with model state (BatchNorm statistics) ``loss_fn(params,
      model_state, batch) -> (loss, new_model_state)``. The pipeline
      traces it on one microbatch and splits it into stages at the
      modules it calls (Flax modules, or ``jax.named_scope`` blocks).
    params: the initial parameters (a pytree of arrays).
    model_state: the initial model state, or None.
    batch_at: ``step -> batch``: the training batch of a step, a pytree
      of host arrays with the batch on their leading axis (size
      ``config.data.batch_size``, split into microbatches). A pure
      function of the step: a resumed run reads what an uninterrupted
      one would. Randomness such as dropout keys rides in the batch.
    evaluate: ``(params, model_state) -> {metric name: float}`` on the
      held-out data at whole params, on one device: the data-parallel
      mode's averaged params, and any mode's where ``evaluation`` is
      None. Default: ``evaluation`` on one device.
    evaluation: the held-out evaluation as per-batch sums
      (``jpipe.train.evaluation.Evaluation``): the CLI runs it forward
      through the pipeline's stages after each ``eval_every`` steps,
      gathering nothing (what a model too big for one device needs).
      None: the CLI gathers the params to process 0 and calls
      ``evaluate`` there.
  """

  kind: str
  loss_fn: Callable
  params: object
  model_state: object
  batch_at: Callable[[int], dict]
  evaluate: Callable[[object, object], dict] | None = None
  evaluation: Evaluation | None = None

  def __post_init__(self):
    if self.evaluate is None and self.evaluation is not None:
      # (A default derived from another field of the frozen value.)
      object.__setattr__(self, "evaluate", self.evaluation.on_one_device)


def build_task(config) -> Task:
  """Loads the data and initialises the model the config names: the
  user's task (``config.task``), or a model (jpipe's, or the user's by
  import path) on the task of the config's data."""
  if config.get("task"):
    return _user_task(config)
  name = config.model.name
  if user_code.is_import_path(name):
    model_class = flax_module(name)
    kind, where = task_of_data(config.data), name
  else:
    kind = TASK_OF_MODEL.get(name)
    if kind is None:
      raise UsageError(
        f"config.model.name: no model {name!r} in jpipe.models "
        f"({', '.join(TASK_OF_MODEL)}); name your own as package.module:Module"
      )
    model_class = importlib.import_module(f"jpipe.models.{name}").Model
    where = f"jpipe.models.{name}.Model"
  try:
    model = model_class(**config.model.kwargs.to_dict())
  except TypeError as e:  # An unknown or missing keyword.
    raise UsageError(f"config.model.kwargs of {where}: {e}") from e
  return {
    "classification": _classification,
    "language_model": _language_model,
    "seq2seq": _seq2seq,
  }[kind](config, model)


def flax_module(path: str):
  """The ``flax.linen.Module`` subclass ``config.model.name`` names by
  import path."""
  value = user_code.load(path, "model.name", want="a Flax module class")
  if not (isinstance(value, type) and issubclass(value, nn.Module)):
    raise UsageError(
      f"config.model.name={path!r} is not a flax.linen.Module subclass; "
      "for any other model write a task of your own (config.task)"
    )
  return value


def task_of_data(data) -> str:
  """The built-in task a config's data fields describe: images classify
  (``base_config.image_data``), text models the language
  (``text_data``), with span-corruption fields it is seq2seq."""
  if "image_key" in data:
    return "classification"
  if "noise_density" in data:
    return "seq2seq"
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


def check_task(task, where: str) -> Task:
  """``task`` if it keeps the Task protocol; else a UsageError naming
  what is wrong (``where``: whose task it is). Abstract: the loss is
  evaluated on shapes only, nothing runs."""

  def fail(why):
    raise UsageError(f"{where}: {why}")

  if not isinstance(task, Task):
    fail(
      f"returned a {type(task).__name__}, not a jpipe.train.tasks.Task; "
      "return Task(kind, loss_fn, params, model_state, batch_at, "
      "evaluation=...)"
    )
  if task.evaluate is None:
    fail(
      "give Task.evaluation (held-out sums, run through the pipeline) or "
      "Task.evaluate (params, model_state) -> metrics"
    )
  if task.evaluation is not None and not isinstance(
    task.evaluation, Evaluation
  ):
    fail(
      f"Task.evaluation is a {type(task.evaluation).__name__}, not a "
      "jpipe.train.evaluation.Evaluation"
    )
  for field in ("loss_fn", "batch_at", "evaluate"):
    if not callable(getattr(task, field)):
      fail(
        f"Task.{field} is a {type(getattr(task, field)).__name__}, "
        "not a function"
      )
  if not all(hasattr(x, "shape") for x in jax.tree.leaves(task.params)) or (
    not jax.tree.leaves(task.params)
  ):
    fail(
      "Task.params must be a non-empty pytree of arrays (e.g. "
      "model.init(key, x)['params'])"
    )
  batch = task.batch_at(0)
  sizes = _leading_sizes(batch)
  if not sizes or None in sizes or len(sizes) > 1:
    fail(
      f"Task.batch_at(0) must give arrays sharing a leading batch axis; "
      f"got leading sizes {sorted(sizes, key=str)}"
    )
  out = _shapes_of(task, "loss_fn", task.loss_fn, batch, fail)
  loss = out[0] if task.model_state is not None else out
  if task.model_state is not None and not (
    isinstance(out, tuple) and len(out) == 2
  ):
    fail(
      "with model_state, Task.loss_fn(params, model_state, batch) must "
      "return (loss, new_model_state)"
    )
  if getattr(loss, "shape", None) != ():
    fail(
      f"Task.loss_fn{_signature(task)} must return a scalar loss (the "
      f"batch's mean); it returned {loss}"
    )
  if task.evaluation is not None:
    _check_evaluation(task, sizes.pop(), fail)
  return task


def _check_evaluation(task, batch_size: int, fail) -> None:
  """The evaluation's first batch: the training batch's size, and sums
  that are scalars (on shapes)."""
  evaluation = task.evaluation
  first = next(iter(evaluation.batches()), None)
  if first is None:
    fail("Task.evaluation.batches() gave no batch")
  sizes = _leading_sizes(first)
  if sizes != {batch_size}:
    fail(
      f"Task.evaluation's batches must have the training batch's size "
      f"{batch_size} (they split into its microbatches; pad the last with "
      f"jpipe.train.evaluation.padded_batches); the first has "
      f"{sorted(sizes, key=str)}"
    )
  sums = _shapes_of(task, "evaluation.sums_fn", evaluation.sums_fn, first, fail)
  if not isinstance(sums, dict) or any(
    getattr(v, "shape", None) != () for v in sums.values()
  ):
    fail(
      f"Task.evaluation.sums_fn{_signature(task)} must return {{name: a "
      f"scalar sum over the batch}}; it returned {sums}"
    )


def _leading_sizes(batch) -> set:
  """The leading sizes of a batch's leaves (None for a scalar leaf)."""
  return {
    np.shape(x)[0] if np.ndim(x) else None for x in jax.tree.leaves(batch)
  }


def _shapes_of(task, name, fn, batch, fail):
  """``fn(params, [model_state,] batch)`` on shapes; ``fail`` with the
  first line of what it raised (``name``: ``fn``'s field in the Task)."""
  args = (task.params, batch)
  if task.model_state is not None:
    args = (task.params, task.model_state, batch)
  try:
    return jax.eval_shape(fn, *args)
  except Exception as e:
    first = str(e).strip().splitlines()[0] if str(e).strip() else ""
    fail(f"Task.{name}{_signature(task)} raised {type(e).__name__}: {first}")


def _signature(task) -> str:
  if task.model_state is None:
    return "(params, batch)"
  return "(params, model_state, batch)"


def mode_kwargs(model, train: bool) -> dict:
  """The keyword a module's ``__call__`` takes for training or evaluation
  (jpipe's and Flax's examples' ``train``, HuggingFace's
  ``deterministic``, Keras-style ``training``); none if it takes none."""
  try:
    names = inspect.signature(type(model).__call__).parameters
  except (TypeError, ValueError):
    return {}
  if "train" in names:
    return {"train": train}
  if "training" in names:
    return {"training": train}
  if "deterministic" in names:
    return {"deterministic": not train}
  return {}


def logits_of(output):
  """A module's output as logits: the array itself, HuggingFace's
  ``ModelOutput.logits`` or a tuple's first element."""
  logits = getattr(output, "logits", None)
  if logits is not None:
    return logits
  if isinstance(output, (tuple, list)):
    return output[0]
  return output


def _needs_dropout_key(model, variables, *inputs) -> bool:
  """Whether the model asks for a "dropout" key when training (its
  dropout rate > 0): applied abstractly in training mode without one."""
  try:
    jax.eval_shape(
      lambda v: model.apply(
        v, *inputs, mutable=True, **mode_kwargs(model, True)
      ),
      variables,
    )
  except flax.errors.InvalidRngError:
    return True
  return False


def _dropout(config, batch_at, needed: bool):
  """(batch_at, rngs_of) for a model that draws dropout masks
  (``needed``: ``_needs_dropout_key``).

  Dropout keys ride in the batch as ``dropout_key`` uint32 [B, 2] (raw
  threefry key data, one row per example, drawn from (seed, step)): the
  pipeline splits them with the batch, each microbatch seeds its masks
  from its first row, and a resumed run redraws the same masks -- the RNG
  state is the step. Without dropout, batches are unchanged.
  """
  if not needed:
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

  example = images_at(0)
  variables = model.init(
    jax.random.key(config.seed), example["x"][:1], **mode_kwargs(model, False)
  )
  batch_at, rngs_of = _dropout(
    config, images_at, _needs_dropout_key(model, variables, example["x"][:1])
  )
  has_stats = "batch_stats" in variables
  loss_fn, logits_fn = _classifier_fns(
    model, has_stats, rngs_of, _smoothing(config)
  )
  return Task(
    "classification",
    loss_fn,
    variables["params"],
    variables.get("batch_stats"),
    batch_at,
    evaluation=_accuracy(logits_fn, has_stats, test, bs),
  )


def _classifier_fns(model, has_stats: bool, rngs_of, smoothing=0.0):
  """``(loss_fn, logits_fn)`` of an image classifier: the mean cross
  entropy of a training batch (labels smoothed by ``smoothing``; with
  BatchNorm statistics as model state where the model has them) and
  evaluation logits ``logits_fn(params, stats, x)``."""
  train_kw, eval_kw = mode_kwargs(model, True), mode_kwargs(model, False)

  def xent(logits, labels):
    return cross_entropy(logits_of(logits), labels, smoothing)

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
      return logits_of(
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
    return logits_of(model.apply({"params": params}, x, **eval_kw))

  return plain_loss_fn, plain_logits_fn


def _accuracy(logits_fn, has_stats, test, batch_size):
  """The accuracy on the test images, in batches of ``batch_size``."""

  def sums(params, stats, batch):
    logits = logits_fn(params, stats, batch["x"])
    hits = (jnp.argmax(logits, -1) == batch["y"]).astype(jnp.float32)
    weight = batch["weight"]
    return {"correct": jnp.sum(hits * weight), "count": jnp.sum(weight)}

  def plain_sums(params, batch):
    return sums(params, None, batch)

  held_out = evaluation_lib.padded_batches(
    {"x": test.images, "y": test.labels}, batch_size
  )
  return Evaluation(
    sums if has_stats else plain_sums,
    lambda: held_out,
    evaluation_lib.accuracy,
  )


def cross_entropy(logits, labels, smoothing: float = 0.0):
  """Per-example cross entropy (nats) of integer ``labels`` [...] against
  ``logits`` [..., classes], the targets smoothed to ``(1 - smoothing)``
  on the label plus ``smoothing / classes`` on every class (Szegedy et
  al. 2016; ``optax.smooth_labels``)."""
  if not smoothing:
    return optax.softmax_cross_entropy_with_integer_labels(logits, labels)
  targets = optax.smooth_labels(
    jax.nn.one_hot(labels, logits.shape[-1], dtype=logits.dtype), smoothing
  )
  return optax.softmax_cross_entropy(logits, targets)


def _smoothing(config) -> float:
  return config.train.get("label_smoothing", 0.0)


def _mean_token_loss(logits, targets, weights, smoothing=0.0):
  """Mean cross-entropy (nats) over positions with weight 1."""
  losses = cross_entropy(logits, targets, smoothing)
  return jnp.sum(losses * weights) / jnp.maximum(jnp.sum(weights), 1.0)


def _token_sums(logits, targets, weights) -> dict:
  """``{"loss": summed cross entropy (nats), "tokens": summed weights}``
  over the positions of weight 1."""
  losses = cross_entropy(logits, targets)
  return {"loss": jnp.sum(losses * weights), "tokens": jnp.sum(weights)}


def _held_out_tokens(sums, held_out: dict, batch_size):
  """Token loss and perplexity of ``sums`` over ``held_out`` windows."""
  batches = evaluation_lib.padded_batches(held_out, batch_size)
  return Evaluation(sums, lambda: batches, evaluation_lib.token_loss)


def _language_model(config, model) -> Task:
  tokenizer = input_pipeline.tokenizer(config)
  train, test = input_pipeline.load_tokens(config, tokenizer)
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
  train_kw, eval_kw = mode_kwargs(model, True), mode_kwargs(model, False)
  params = model.init(jax.random.key(config.seed), example["x"][:1], **eval_kw)[
    "params"
  ]
  batch_at, rngs_of = _dropout(
    config,
    windows_at,
    _needs_dropout_key(model, {"params": params}, example["x"][:1]),
  )
  smoothing = _smoothing(config)

  def loss_fn(params, batch):
    logits = model.apply(
      {"params": params}, batch["x"], rngs=rngs_of(batch), **train_kw
    )
    return cross_entropy(logits_of(logits), batch["y"], smoothing).mean()

  def sums(params, batch):
    logits = logits_of(model.apply({"params": params}, batch["x"], **eval_kw))
    weights = jnp.broadcast_to(batch["weight"][:, None], batch["y"].shape)
    return _token_sums(logits, batch["y"], weights)

  held_out = sequences.lm_eval_windows(test, length, data.eval_sequences)
  return Task(
    "language_model",
    loss_fn,
    params,
    None,
    batch_at,
    evaluation=_held_out_tokens(sums, held_out, data.batch_size),
  )


def _seq2seq(config, model) -> Task:
  tokenizer = input_pipeline.tokenizer(config)
  train, test = input_pipeline.load_tokens(config, tokenizer)
  data = config.data
  _, num_spans, _, _ = sequences.span_lengths(
    data.sequence_length, data.noise_density, data.mean_span_length
  )
  # Ids shifted so that 0 is padding only; sentinels after the vocabulary.
  offset = tokenizer.seq2seq_offset
  first_sentinel = tokenizer.vocab_size + offset
  need = first_sentinel + num_spans
  if getattr(model, "vocab_size", need) < need:
    raise UsageError(
      f"config.model.kwargs.vocab_size={model.vocab_size} cannot hold the "
      f"{first_sentinel} token ids ({tokenizer.name}) and {num_spans} span "
      f"sentinels: use >= {need}"
    )
  spans = dict(
    noise_density=data.noise_density,
    mean_span_length=data.mean_span_length,
    offset=offset,
    first_sentinel=first_sentinel,
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
  train_kw, eval_kw = mode_kwargs(model, True), mode_kwargs(model, False)
  params = model.init(
    jax.random.key(config.seed),
    example["inputs"][:1],
    example["targets"][:1],
    **eval_kw,
  )["params"]
  smoothing = _smoothing(config)

  def loss_fn(params, batch):
    logits = model.apply(
      {"params": params}, batch["inputs"], batch["targets"], **train_kw
    )
    weights = (batch["targets"] > 0).astype(jnp.float32)
    return _mean_token_loss(
      logits_of(logits), batch["targets"], weights, smoothing
    )

  def sums(params, batch):
    logits = model.apply(
      {"params": params}, batch["inputs"], batch["targets"], **eval_kw
    )
    weights = (batch["targets"] > 0) * batch["weight"][:, None]
    return _token_sums(logits_of(logits), batch["targets"], weights)

  held_out = sequences.seq2seq_eval_batch(
    test, data.sequence_length, data.eval_sequences, **spans
  )
  return Task(
    "seq2seq",
    loss_fn,
    params,
    None,
    batch_at,
    evaluation=_held_out_tokens(sums, held_out, data.batch_size),
  )
