"""The Task protocol: what ``python -m jpipe.train`` trains, and its check.

A function named by ``config.task=package.module:build`` takes the config
and returns a :class:`Task`; :func:`check_task` checks it on shapes before
any work (``jpipe.train.tasks`` builds the built-in ones).
"""

import dataclasses
import hashlib
from collections.abc import Callable

import jax
import numpy as np

from jpipe.train.errors import UsageError
from jpipe.train.evaluation import Evaluation


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
    has_aux: ``loss_fn`` returns ``(loss, {name: scalar})`` (with model
      state ``(loss, (new_model_state, {name: scalar}))``): training
      metrics beside the loss (an accuracy), each computed on the stage
      that makes it, averaged over a log window's steps and logged as
      ``train/<name>`` beside ``train/loss`` (``jpipe.Pipeline``'s
      ``has_aux``).
  """

  kind: str
  loss_fn: Callable
  params: object
  model_state: object
  batch_at: Callable[[int], dict]
  evaluate: Callable[[object, object], dict] | None = None
  evaluation: Evaluation | None = None
  has_aux: bool = False

  def __post_init__(self):
    if self.evaluate is None and self.evaluation is not None:
      # (A default derived from another field of the frozen value.)
      object.__setattr__(self, "evaluate", self.evaluation.on_one_device)


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
  sizes = _check_first_batch(task, batch, fail)
  out = _shapes_of(task, "loss_fn", task.loss_fn, batch, fail)
  loss = _loss_and_aux(task, out, fail)
  if getattr(loss, "shape", None) != ():
    fail(
      f"Task.loss_fn{_signature(task)} must return a scalar loss (the "
      f"batch's mean); it returned {loss}"
    )
  if task.evaluation is not None:
    _check_evaluation(task, sizes.pop(), fail)
  return task


def _check_first_batch(task, batch, fail) -> set:
  """``batch`` (``batch_at(0)``) the same when asked again, its leaves
  sharing a leading batch axis; that axis' size, in a set."""
  if batch_digest(task.batch_at(0)) != batch_digest(batch):
    fail(
      "Task.batch_at(0) gave another batch when called again: batch_at "
      "must be a pure function of the step (seed any randomness from it, "
      "e.g. np.random.default_rng([seed, step])), as a resumed run and "
      "every process of a multi-process run read batch_at(step) anew"
    )
  sizes = _leading_sizes(batch)
  if not sizes or None in sizes or len(sizes) > 1:
    fail(
      f"Task.batch_at(0) must give arrays sharing a leading batch axis; "
      f"got leading sizes {sorted(sizes, key=str)}"
    )
  return sizes


# Names the loop logs as train/<name> itself.
_RESERVED = ("loss", "examples_per_second", "learning_rate", "epoch_seconds")


def _loss_and_aux(task, out, fail):
  """The loss of ``loss_fn``'s output (on shapes), its structure checked:
  with ``has_aux``, a dict of named scalars beside it."""
  state, has_aux = task.model_state is not None, task.has_aux
  wants = {
    (False, False): "the loss",
    (False, True): "(loss, {name: scalar})",
    (True, False): "(loss, new_model_state)",
    (True, True): "(loss, (new_model_state, {name: scalar}))",
  }[(state, has_aux)]
  pair = isinstance(out, tuple) and len(out) == 2
  if (state or has_aux) and not pair:
    fail(f"Task.loss_fn{_signature(task)} must return {wants}")
  if not has_aux:
    loss = out[0] if state else out
    if isinstance(loss, tuple):  # (loss, metrics) without has_aux
      fail(
        f"Task.loss_fn{_signature(task)} returned a tuple where it must "
        f"return {wants}: for metrics beside the loss set "
        "Task(..., has_aux=True)"
      )
    return loss
  aux = out[1][1] if state else out[1]
  if state and not (isinstance(out[1], tuple) and len(out[1]) == 2):
    fail(f"Task.loss_fn{_signature(task)} must return {wants}")
  if not isinstance(aux, dict) or any(
    not isinstance(k, str) or getattr(v, "shape", None) != ()
    for k, v in aux.items()
  ):
    fail(
      f"with has_aux, Task.loss_fn{_signature(task)} must return {wants}: "
      f"its metrics a dict of named scalars; got {aux}"
    )
  clash = sorted(set(aux) & set(_RESERVED))
  if clash:
    fail(
      f"Task.loss_fn's metric {clash[0]!r} would overwrite the loop's own "
      f"train/{clash[0]}: rename it"
    )
  return out[0]


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


def batch_digest(batch) -> str:
  """A hash of a batch's structure, shapes, dtypes and values (typed
  PRNG keys by their key data), 16 hex digits."""
  digest = hashlib.sha256(str(jax.tree.structure(batch)).encode())
  for leaf in jax.tree.leaves(batch):
    if jax.dtypes.issubdtype(getattr(leaf, "dtype", None), jax.dtypes.prng_key):
      leaf = jax.random.key_data(leaf)
    array = np.ascontiguousarray(np.asarray(leaf))
    digest.update(f"{array.dtype}{array.shape}".encode())
    digest.update(array.tobytes())
  return digest.hexdigest()[:16]
