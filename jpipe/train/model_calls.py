"""Calling a Flax model for a task: its train/eval keyword, its logits,
dropout keys carried in the batch, and the cross-entropy losses.

Shared by the built-in tasks (``jpipe.train.tasks``, ``text_tasks``);
pure functions of the model and arrays.
"""

import functools
import inspect

import flax
import jax
import jax.numpy as jnp
import numpy as np
import optax


def mode_kwargs(model, train: bool) -> dict:
  """The keyword a module's ``__call__`` takes for training or evaluation
  (jpipe's and Flax's examples' ``train``, HuggingFace's
  ``deterministic``, Keras-style ``training``); none if it takes none."""
  try:
    names = call_signature(model).parameters
  except (TypeError, ValueError):
    return {}
  if "train" in names:
    return {"train": train}
  if "training" in names:
    return {"training": train}
  if "deterministic" in names:
    return {"deterministic": not train}
  return {}


def call_signature(model) -> inspect.Signature:
  """The signature of the model's ``__call__`` (self first); a wrapped
  NNX model's is its module's (``nnx_models.NnxModel.call_signature``)."""
  own = getattr(model, "call_signature", None)
  if isinstance(own, inspect.Signature):
    return own
  return inspect.signature(type(model).__call__)


def logits_of(output):
  """A module's output as logits: the array itself, HuggingFace's
  ``ModelOutput.logits`` or a tuple's first element."""
  logits = getattr(output, "logits", None)
  if logits is not None:
    return logits
  if isinstance(output, (tuple, list)):
    return output[0]
  return output


def logits_shape(model, variables, *inputs) -> tuple:
  """The shape of the model's logits (``logits_of`` its evaluation-mode
  output) on ``inputs``, traced on shapes: nothing runs."""
  out = jax.eval_shape(
    lambda v: model.apply(v, *inputs, **mode_kwargs(model, False)), variables
  )
  return tuple(logits_of(out).shape)


def needs_dropout_key(model, variables, *inputs) -> bool:
  """Whether the model asks for a "dropout" key when training (its
  dropout rate > 0): applied abstractly in training mode without one;
  a wrapped NNX model says itself (``NnxModel.draws_random``)."""
  draws = getattr(model, "draws_random", None)
  if isinstance(draws, bool):
    return draws
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


def with_dropout(config, batch_at, needed: bool):
  """(batch_at, rngs_of) for a model that draws dropout masks
  (``needed``: ``needs_dropout_key``).

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


def label_smoothing(config) -> float:
  return config.train.get("label_smoothing", 0.0)


def mean_token_loss(logits, targets, weights, smoothing=0.0):
  """Mean cross-entropy (nats) over positions with weight 1."""
  losses = cross_entropy(logits, targets, smoothing)
  return jnp.sum(losses * weights) / jnp.maximum(jnp.sum(weights), 1.0)


def token_sums(logits, targets, weights) -> dict:
  """``{"loss": summed cross entropy (nats), "tokens": summed weights}``
  over the positions of weight 1."""
  losses = cross_entropy(logits, targets)
  return {"loss": jnp.sum(losses * weights), "tokens": jnp.sum(weights)}


def is_encoder_decoder(model) -> bool:
  """Whether the module's ``__call__`` takes two inputs (inputs,
  targets) as an encoder-decoder does (jpipe's t5), not one."""
  try:
    params = list(call_signature(model).parameters.values())
  except (TypeError, ValueError):
    return False
  required = [
    p
    for p in params[1:]  # After self.
    if p.default is inspect.Parameter.empty
    and p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
  ]
  return len(required) >= 2


def initialize(model, abstract: bool, seed: int, *inputs, **kwargs):
  """``model.init(jax.random.key(seed), *inputs, **kwargs)``, or its
  ``jax.eval_shape`` (``abstract``: ShapeDtypeStructs, nothing
  allocated)."""
  init = functools.partial(model.init, **kwargs)
  if abstract:
    return jax.eval_shape(init, jax.random.key(seed), *inputs)
  return init(jax.random.key(seed), *inputs)
