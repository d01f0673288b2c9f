"""PipeMare's learning-rate rescheduling for delayed gradients.

Source: B. Yang, J. Zhang, J. Li, C. Re, C. Aberger, C. De Sa, "PipeMare:
Asynchronous Pipeline Parallel DNN Training", MLSys 2021, technique T1: a
stage whose gradients arrive tau steps late steps with

  alpha_{k, tau} = alpha_k * tau ** -p_k,   p_k = 1 - min(k / K, 1),

its learning rate divided by the delay at the start and annealed back to
the base schedule over K steps (the delay makes early, large steps
unstable; later the steps are small enough). As the authors of the
asynchronous Nesterov method restate it in their code (AsyncPP,
``adjust_learning_rate(lr_correction=True)``): ``lr / d ** (1 - min((1 +
step) / K, 1))`` for d > 1, where d is the stage's delay and ``step``
counts from 0. Delays 0 and 1 leave the rate as it is.

PipeMare's second technique (T2, discrepancy correction of the backward's
weights) is not built here.
"""

from typing import NamedTuple

import jax
import jax.numpy as jnp
import optax

from jpipe.staleness import _common


class PipeMareState(NamedTuple):
  """Steps taken (int32 scalar)."""

  count: jax.Array


def pipemare_factor(
  delay: int, count: jax.typing.ArrayLike, anneal_steps: int
) -> jax.Array:
  """The learning-rate factor d ** -(1 - min((count + 1) / K, 1)) of the
  step taken after ``count`` earlier steps (1 for d <= 1): the first step
  at d ** -(1 - 1/K), as AsyncPP counts (PipeMare's paper starts at
  1/d). ``delay`` and ``anneal_steps`` are Python ints (one factor per
  stage)."""
  if not _common.is_concrete(delay):
    raise ValueError(
      f"pipemare delay must be a Python int (a stage's static delay), got "
      f"{type(delay).__name__}"
    )
  _common.check_delay(delay)
  if anneal_steps < 2 and delay > 1:
    raise ValueError(
      f"anneal_steps={anneal_steps} reschedules nothing: the first step "
      "is counted as step 1 of K, already the end of the annealing; use "
      "K >= 2"
    )
  if anneal_steps < 1:
    raise ValueError(f"anneal_steps must be >= 1, got {anneal_steps}")
  if delay <= 1:
    return jnp.ones([], jnp.float32)
  progress = jnp.minimum(
    (jnp.asarray(count, jnp.float32) + 1.0) / anneal_steps, 1.0
  )
  return jnp.asarray(float(delay), jnp.float32) ** -(1.0 - progress)


def pipemare_learning_rate(
  delay: int, anneal_steps: int
) -> optax.GradientTransformation:
  """Scales every update by ``pipemare_factor(delay, count, anneal_steps)``.

  Chain it after an optimizer (``optax.chain(optax.adamw(lr), ...)``): the
  whole update of SGD, Adam and AdamW (decay included) is proportional to
  the learning rate, so scaling it is scaling the rate, as PipeMare does.
  """
  pipemare_factor(delay, 0, anneal_steps)  # Checks the arguments.

  def init_fn(params):
    del params
    return PipeMareState(jnp.zeros([], jnp.int32))

  def update_fn(updates, state, params=None):
    del params
    factor = pipemare_factor(delay, state.count, anneal_steps)
    scaled = jax.tree.map(lambda u: (u * factor).astype(u.dtype), updates)
    return scaled, PipeMareState(state.count + 1)

  return optax.GradientTransformation(init_fn, update_fn)
