"""Delay-aware Nesterov for asynchronous pipelines (Ajanthan et al.).

Source: T. Ajanthan, S. Ramasinghe, Y. Zuo, G. Avraham, A. Long, "Nesterov
Method for Asynchronous Pipeline Parallel Optimization", ICML 2025
(arXiv:2505.01099): NAG's look-ahead, with a large momentum coefficient,
extrapolates the weights along the update direction, which offsets the
staleness of a delayed gradient; "no loss against synchronous training up
to 1B-parameter decoders". What is built here is what the authors' code
(github.com/PluralisResearch/AsyncPP) runs for "ours" (``run.bash``:
``--momentum 0.99 --optimizer nadamw``; ``optim/nadamw.py``): PyTorch's
NAdam with decoupled weight decay and its momentum-decay schedule, with
beta1 = 0.99, on a PipeDream pipeline with weight stashing and
recomputation; and its ``--adaptive_momentum`` option, which raises beta1
with the stage's delay.

``nadamw`` is torch.optim.NAdam(decoupled_weight_decay=True) as an optax
transform (formulas in its docstring); ``delay_aware_nesterov`` picks each
stage's momentum from its delay.
"""

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from jpipe.staleness import _common

# The authors' momentum for "ours" and their adaptive momentum's ceiling.
NESTEROV_MOMENTUM = 0.99


class ScaleByNadamState(NamedTuple):
  """NAdam's statistics (PyTorch's formulation)."""

  count: jax.Array  # int32 scalar: steps taken.
  mu_product: jax.Array  # float32 scalar: prod_{i <= count} mu_i.
  mu: optax.Updates  # first moment m, shaped like the params.
  nu: optax.Updates  # second moment v, shaped like the params.


def momentum_schedule(
  b1: Any, momentum_decay: float, t: jax.Array
) -> jax.Array:
  """mu_t = b1 (1 - 0.5 * 0.96 ** (t * momentum_decay)) (Dozat's NAdam,
  as PyTorch schedules it); t counts steps from 1."""
  return b1 * (1.0 - 0.5 * 0.96 ** (t * momentum_decay))


def scale_by_nadam(
  b1: float = 0.9,
  b2: float = 0.999,
  eps: float = 1e-8,
  momentum_decay: float = 4e-3,
) -> optax.GradientTransformation:
  """NAdam's direction m_hat / (sqrt(v_hat) + eps), as PyTorch computes it.

  At step t = 1, 2, ... with gradient g:
    mu_t     = b1 (1 - 0.5 * 0.96^(t psi)),   psi = momentum_decay
    m_t      = b1 m_{t-1} + (1 - b1) g
    v_t      = b2 v_{t-1} + (1 - b2) g^2
    m_hat    = mu_{t+1} m_t / (1 - prod_{i<=t+1} mu_i)
               + (1 - mu_t) g / (1 - prod_{i<=t} mu_i)
    v_hat    = v_t / (1 - b2^t)
    update   = m_hat / (sqrt(v_hat) + eps)
  (not yet scaled by -learning_rate). Moments are kept in the gradient's
  dtype promoted to float32.
  """
  _common.check_unit_interval("b1", b1)
  _common.check_open_unit("b2", b2)
  _common.check_non_negative("momentum_decay", momentum_decay)

  def init_fn(params):
    zeros = jax.tree.map(
      lambda p: jnp.zeros(jnp.shape(p), _common.compute_dtype(p.dtype)), params
    )
    return ScaleByNadamState(
      count=jnp.zeros([], jnp.int32),
      mu_product=jnp.ones([], jnp.float32),
      mu=zeros,
      nu=jax.tree.map(jnp.copy, zeros),
    )

  def update_fn(updates, state, params=None):
    del params
    count = state.count + 1
    t = count.astype(jnp.float32)
    mu_t = momentum_schedule(b1, momentum_decay, t)
    mu_next = momentum_schedule(b1, momentum_decay, t + 1.0)
    product = state.mu_product * mu_t
    product_next = product * mu_next
    mu = jax.tree.map(
      lambda m, g: b1 * m + (1.0 - b1) * g.astype(m.dtype), state.mu, updates
    )
    nu = jax.tree.map(
      lambda v, g: b2 * v + (1.0 - b2) * jnp.square(g.astype(v.dtype)),
      state.nu,
      updates,
    )
    v_correction = 1.0 - b2**t

    def direction(g, m, v):
      m_hat = mu_next * m / (1.0 - product_next) + (1.0 - mu_t) * g.astype(
        m.dtype
      ) / (1.0 - product)
      out = m_hat / (jnp.sqrt(v / v_correction) + eps)
      return out.astype(g.dtype)

    out = jax.tree.map(direction, updates, mu, nu)
    return out, ScaleByNadamState(count, product, mu, nu)

  return optax.GradientTransformation(init_fn, update_fn)


def nadamw(
  learning_rate: _common.ScalarOrSchedule,
  b1: float = 0.9,
  b2: float = 0.999,
  eps: float = 1e-8,
  weight_decay: float = 0.0,
  momentum_decay: float = 4e-3,
) -> optax.GradientTransformation:
  """torch.optim.NAdam(decoupled_weight_decay=True) as an optax optimizer.

  theta <- theta (1 - lr * weight_decay) - lr * scale_by_nadam(...)(g):
  the decay is decoupled (AdamW's), applied to the params before the
  step. ``learning_rate`` may be an optax schedule.
  """
  _common.check_non_negative("weight_decay", weight_decay)
  parts = [scale_by_nadam(b1, b2, eps, momentum_decay)]
  if weight_decay:
    parts.append(optax.add_decayed_weights(weight_decay))
  parts.append(optax.scale_by_learning_rate(learning_rate))
  return optax.chain(*parts)


def adaptive_momentum(
  momentum: float,
  delay: int,
  num_stages: int,
  ceiling: float = NESTEROV_MOMENTUM,
) -> float:
  """The authors' ``--adaptive_momentum``: a stage of delay d of n stages
  runs beta1 = momentum + d (ceiling - momentum) / n, moved toward the
  ceiling with the delay, so deeper-delayed stages look further ahead (d
  = 0 keeps ``momentum``; a momentum above the ceiling is lowered)."""
  _common.check_delay(delay)
  if num_stages < 1 or delay >= num_stages:
    raise ValueError(
      f"need 0 <= delay < num_stages, got delay={delay}, "
      f"num_stages={num_stages}"
    )
  return momentum + delay * (ceiling - momentum) / num_stages


def delay_aware_nesterov(
  learning_rate: _common.ScalarOrSchedule,
  *,
  delay: int,
  num_stages: int,
  optimizer: str = "adamw",
  momentum: float = NESTEROV_MOMENTUM,
  adaptive: bool = False,
  b2: float = 0.999,
  eps: float = 1e-8,
  weight_decay: float = 0.0,
  momentum_decay: float = 4e-3,
) -> optax.GradientTransformation:
  """The stage optimizer of the delay-aware Nesterov method, for a stage of
  steady-state delay ``delay`` in a pipeline of ``num_stages``.

  optimizer "adam" / "adamw": ``nadamw`` (PyTorch's NAdam; "adam" with no
  weight decay) with beta1 = ``momentum`` (the authors' 0.99); "sgd":
  ``optax.sgd(lr, momentum, nesterov=True)`` (weight decay added to the
  gradient), the plain NAG the method starts from. ``adaptive`` raises the
  momentum with the delay (``adaptive_momentum``, toward 0.99). Run it
  with weight stashing, as the authors do.
  """
  _common.check_optimizer(optimizer)
  _common.check_delay(delay)
  if num_stages < 1 or delay >= num_stages:
    raise ValueError(
      f"need 0 <= delay < num_stages, got delay={delay}, "
      f"num_stages={num_stages}"
    )
  b1 = (
    adaptive_momentum(momentum, delay, num_stages)
    if adaptive
    else float(momentum)
  )
  _common.check_unit_interval("momentum", b1)
  if optimizer == "sgd":
    sgd = optax.sgd(learning_rate, momentum=b1, nesterov=True)
    if weight_decay:
      return optax.chain(optax.add_decayed_weights(weight_decay), sgd)
    return sgd
  if optimizer == "adam" and weight_decay:
    raise ValueError(
      "optimizer='adam' has no weight decay: use optimizer='adamw' for "
      f"decoupled decay (got weight_decay={weight_decay})"
    )
  return nadamw(learning_rate, b1, b2, eps, weight_decay, momentum_decay)
