"""Gap-Aware: penalise stale gradients by how far the params have moved."""

from typing import NamedTuple

import jax
import jax.numpy as jnp
import optax

from jpipe.staleness import _common


class GapAwareState(NamedTuple):
  """State of :func:`gap_aware`."""

  count: jax.Array  # shape=(), int32: updates taken (n).
  max_learning_rate: jax.Array  # shape=(), float32: running max lr (SGD).
  sq_avg: optax.Updates  # like params: EMA of the squared step statistic.
  inner_state: optax.OptState  # base_tx's state.


def gap_aware(
  base_tx: optax.GradientTransformation,
  *,
  optimizer: str,
  beta: float = 0.999,
  eps: float = 1e-8,
  max_learning_rate: _common.ScalarOrSchedule | None = None,
  learning_rate: _common.ScalarOrSchedule | None = None,
  weight_decay: float = 0.0,
) -> optax.GradientTransformationExtraArgs:
  r"""Gap-Aware (Barkai et al.) in front of ``base_tx``, as FTPipe keeps it.

  The gap is how far the params have moved since the gradient's forward:
  :math:`P = 1 + |\theta - \theta_{stale}| / C` elementwise, and the gradient
  is divided by :math:`P` before ``base_tx`` sees it.

  - SGD: :math:`A \leftarrow \beta A + (1-\beta) v^2` with :math:`v` the
    momentum buffer *before* this step (the gradient if ``base_tx`` keeps no
    ``optax.TraceState``), :math:`C = \eta_{max}(\sqrt{A/(1-\beta^n)} +
    \epsilon)`, :math:`\eta_{max}` the running max of the learning rate.
    With L2 weight decay :math:`\lambda` (``add_decayed_weights`` inside
    ``base_tx``) the gradient becomes :math:`g/P + \lambda\theta(1-P)/P`, so
    the decayed gradient is :math:`(g + \lambda\theta)/P` as a whole.
  - Adam / AdamW: :math:`C = \sqrt{S} + \epsilon` with :math:`S` the EMA
    (``beta``; FTPipe sets it to :math:`\beta_2`) of the squared applied
    update without its decay part, recorded after each step, no bias
    correction. Adam with L2: the same correction as SGD. AdamW: the params
    are first scaled by :math:`1 - \lambda\eta(1-P)/P` (returned inside the
    updates), so the decoupled decay is penalised too.

  Which ``stale_params`` to pass: the params the gradient's forward ran
  with. For ``ga`` with weight stashing that is the stash (the forward and
  the backward both ran there); with weight prediction, the predicted
  params. For ``ga_jfl`` ("just for loss": the backward recomputes at the
  current params, only the received activations and gradients are stale)
  it is the same stash, while the gradient itself was computed at
  ``params``. With a delay of 0 pass ``params``: the statistics update and
  the gradient is unchanged.

  Args:
    base_tx: the optimizer to apply after the penalty.
    optimizer: "sgd", "adam" or "adamw": what ``base_tx`` is.
    beta: EMA decay of the statistic, in (0, 1).
    eps: added to the RMS (FTPipe: 1e-8).
    max_learning_rate: SGD's :math:`\eta_{max}` source, a float or schedule;
      a running max of it is kept. Defaults to ``learning_rate``.
    learning_rate: ``base_tx``'s learning rate (float or schedule); needed by
      AdamW with weight decay, and by SGD if ``max_learning_rate`` is None.
    weight_decay: :math:`\lambda` of ``base_tx`` (L2 for sgd/adam, decoupled
      for adamw); 0 if it has none.

  Returns:
    An ``optax.GradientTransformationExtraArgs`` whose
    ``update(grads, state, params, *, stale_params)`` returns the final
    parameter updates.

  Examples:
    >>> import jax.numpy as jnp, optax
    >>> from jpipe import staleness
    >>> tx = staleness.gap_aware(optax.sgd(0.1, momentum=0.9),
    ...                          optimizer="sgd", learning_rate=0.1)
    >>> params = jnp.zeros(2)
    >>> state = tx.init(params)
    >>> updates, state = tx.update(jnp.ones(2), state, params,
    ...                            stale_params=params)
    >>> updates
    Array([-0.1, -0.1], dtype=float32)

  References:
    Barkai et al, `Gap Aware Mitigation of Gradient Staleness
    <https://arxiv.org/abs/1909.10802>`_, 2020
  """
  _common.check_optimizer(optimizer)
  _common.check_open_unit("beta", beta)
  _common.check_non_negative("eps", eps)
  _common.check_non_negative("weight_decay", weight_decay)
  if max_learning_rate is None:
    max_learning_rate = learning_rate
  if optimizer == "sgd" and max_learning_rate is None:
    raise ValueError(
      "gap_aware with optimizer='sgd' needs max_learning_rate (or "
      "learning_rate): C is scaled by the largest learning rate"
    )
  decays = not _common.is_concrete(weight_decay) or float(weight_decay) > 0
  if optimizer == "adamw" and decays and learning_rate is None:
    raise ValueError(
      "gap_aware with optimizer='adamw' and weight decay needs "
      "learning_rate to penalise the decoupled decay"
    )
  base_tx = optax.with_extra_args_support(base_tx)

  def init_fn(params):
    eta0 = 0.0
    if max_learning_rate is not None:
      eta0 = _common.value_at(max_learning_rate, jnp.zeros([], jnp.int32))
    inner_state = base_tx.init(params)
    _common.check_state_matches(inner_state, optimizer, "gap_aware")
    return GapAwareState(
      count=jnp.zeros([], jnp.int32),
      max_learning_rate=jnp.asarray(eta0, jnp.float32),
      sq_avg=optax.tree.zeros_like(params),
      inner_state=inner_state,
    )

  def update_fn(
    updates, state, params=None, *, stale_params=None, **extra_args
  ):
    if params is None:
      raise ValueError(_common.NO_PARAMS_MSG)
    if stale_params is None:
      raise ValueError(
        "gap_aware needs stale_params=: the params the gradient's forward "
        "ran with (pass params itself when there is no delay)"
      )
    grads = updates
    count = optax.safe_increment(state.count)
    lam = jnp.asarray(weight_decay, jnp.float32)
    max_lr = state.max_learning_rate

    if optimizer == "sgd":
      trace = _common.find_one_state(
        state.inner_state, optax.TraceState, "momentum buffer"
      )
      before = grads if trace is None else trace.trace
      sq_avg = jax.tree.map(
        lambda a, v: (beta * a + (1 - beta) * jnp.square(v)).astype(a.dtype),
        state.sq_avg,
        before,
      )
      eta = _common.value_at(max_learning_rate, state.count)
      max_lr = jnp.maximum(max_lr, eta.astype(jnp.float32))
      bias = 1.0 - jnp.asarray(beta, jnp.float32) ** count.astype(jnp.float32)
      scale = jax.tree.map(
        lambda a: max_lr * (jnp.sqrt(a.astype(jnp.float32) / bias) + eps),
        sq_avg,
      )
    else:
      sq_avg = state.sq_avg
      scale = jax.tree.map(
        lambda a: jnp.sqrt(a.astype(jnp.float32)) + eps, sq_avg
      )

    penalty = jax.tree.map(
      lambda p, s, c: (
        1.0 + jnp.abs(p.astype(jnp.float32) - s.astype(jnp.float32)) / c
      ),
      params,
      stale_params,
      scale,
    )

    def penalise(g, p, pen):
      out = g.astype(jnp.float32) / pen
      if optimizer != "adamw":
        out = out + lam * p.astype(jnp.float32) * (1.0 - pen) / pen
      return out.astype(g.dtype)

    new_grads = jax.tree.map(penalise, grads, params, penalty)

    step_params = params
    if optimizer == "adamw" and learning_rate is not None:
      eta = _common.value_at(learning_rate, state.count).astype(jnp.float32)
      step_params = jax.tree.map(
        lambda p, pen: (
          p.astype(jnp.float32) * (1.0 - lam * eta * (1.0 - pen) / pen)
        ).astype(p.dtype),
        params,
        penalty,
      )

    new_updates, inner_state = base_tx.update(
      new_grads, state.inner_state, step_params, **extra_args
    )

    if optimizer != "sgd":
      applied = new_updates
      if optimizer == "adamw" and learning_rate is not None:
        applied = jax.tree.map(
          lambda u, p: (
            u.astype(jnp.float32) + eta * lam * p.astype(jnp.float32)
          ),
          new_updates,
          step_params,
        )
      sq_avg = jax.tree.map(
        lambda a, u: (
          beta * a + (1 - beta) * jnp.square(u.astype(jnp.float32))
        ).astype(a.dtype),
        sq_avg,
        applied,
      )
      if optimizer == "adamw" and learning_rate is not None:
        new_updates = jax.tree.map(
          lambda u, sp, p: (
            u.astype(jnp.float32)
            + sp.astype(jnp.float32)
            - p.astype(jnp.float32)
          ).astype(u.dtype),
          new_updates,
          step_params,
          params,
        )

    return new_updates, GapAwareState(
      count=count,
      max_learning_rate=max_lr,
      sq_avg=sq_avg,
      inner_state=inner_state,
    )

  return optax.GradientTransformationExtraArgs(init_fn, update_fn)
