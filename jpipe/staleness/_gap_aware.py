"""Gap-Aware: penalise stale gradients by how far the params have moved."""

from typing import Any, NamedTuple

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
  weight_decay_mask: Any = None,
  gap_from_grad: bool = False,
  adam_betas: tuple[float, float] | None = None,
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

  ``gap_from_grad`` (FTPipe's ``apply_from_grad``, for a stage one step
  late without a stash): ``update(..., delay=d)`` instead of
  ``stale_params`` (0: not late, the gradient unchanged; 1: one step late;
  FTPipe refuses other delays, the estimate being one step's gap); the gap
  is estimated as the step this gradient would take. SGD: :math:`\eta_t |g|` (the current
  learning rate). Adam: :math:`|e_1 - e_2|` with :math:`e_1 = \eta\beta_1
  m / ((1-\beta_1)\epsilon + \sqrt{v}\sqrt{1-\beta_1})` and :math:`e_2 =
  \eta(\beta_1 m + (1-\beta_1) g) / ((1-\beta_1)\sqrt{(\beta_2 v +
  (1-\beta_2) g^2) / (1-\beta_2)} + (1-\beta_1)\epsilon)`, m and v the
  state before the step (FTPipe's ``adam_gap1``). Not for AdamW (FTPipe has
  none).

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
    weight_decay_mask: ``base_tx``'s decay mask (``optax.adamw(mask=)``,
      ``add_decayed_weights(mask=)``): a pytree of bools like the params or
      a callable of them; None: every leaf decays.
    gap_from_grad: estimate the gap from the gradient (above) instead of
      taking ``stale_params``; needs ``learning_rate``.
    adam_betas: ``(b1, b2)`` of ``base_tx``'s Adam: the estimate's
      :math:`\beta_1, \beta_2` (needed with ``gap_from_grad``, Adam).

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
  if gap_from_grad and optimizer == "adamw":
    raise ValueError(
      "gap_aware(gap_from_grad=True) estimates SGD's and Adam's gap; "
      "AdamW's has no estimate (nor in FTPipe): pass stale_params instead"
    )
  if gap_from_grad and optimizer == "adam" and adam_betas is None:
    raise ValueError(
      "gap_aware(gap_from_grad=True) with Adam needs adam_betas=(b1, b2), "
      "its optimizer's: the gap is estimated as the step Adam takes"
    )
  if gap_from_grad and learning_rate is None:
    raise ValueError(
      "gap_aware(gap_from_grad=True) needs learning_rate: the gap is "
      "estimated as the step the gradient takes"
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
      # float32 whatever the params' dtype: in bfloat16 beta = 0.999
      # rounds to 1, in float16 the squared steps underflow.
      sq_avg=optax.tree.zeros_like(params, dtype=jnp.float32),
      inner_state=inner_state,
    )

  def update_fn(
    updates,
    state,
    params=None,
    *,
    stale_params=None,
    delay=None,
    **extra_args,
  ):
    """The gradient penalised by the gap |params - stale_params| / C per
    element, then ``base_tx``'s update; C from S (adam, adamw) or from
    SGD's running statistic."""
    if params is None:
      raise ValueError(_common.NO_PARAMS_MSG)
    if gap_from_grad and (delay is None or stale_params is not None):
      raise ValueError(
        "gap_aware(gap_from_grad=True) takes delay= (how many steps late "
        "the gradient is: 0 or 1), not stale_params (it estimates the gap)"
      )
    if not gap_from_grad and stale_params is None:
      raise ValueError(
        "gap_aware needs stale_params=: the params the gradient's forward "
        "ran with (pass params itself when there is no delay)"
      )
    count = optax.safe_increment(state.count)
    decays = _common.decay_mask_tree(weight_decay_mask, params)
    lam = jax.tree.map(
      lambda m: jnp.where(m, jnp.asarray(weight_decay, jnp.float32), 0.0),
      decays,
    )
    if optimizer == "sgd":
      eta_max = _common.value_at(max_learning_rate, state.count)
      sq_avg, scale, max_lr = _sgd_scale(
        updates, state, count, eta_max, beta, eps
      )
    else:
      sq_avg, max_lr = state.sq_avg, state.max_learning_rate
      scale = jax.tree.map(lambda a: jnp.sqrt(_f32(a)) + eps, sq_avg)
    if gap_from_grad:
      eta_t = _f32(_common.value_at(learning_rate, state.count))
      late = jnp.asarray(delay) > 0
      gap = jax.tree.map(
        lambda a: jnp.where(late, a, 0.0),
        _gap_from_grad(
          optimizer, updates, state.inner_state, eta_t, eps, adam_betas
        ),
      )
    else:
      gap = jax.tree.map(_gap, params, stale_params)
    penalty = jax.tree.map(lambda g, c: 1.0 + g / c, gap, scale)
    if optimizer == "adamw":
      new_grads = jax.tree.map(
        lambda g, pen: _penalised(g, None, pen, None), updates, penalty
      )
    else:
      new_grads = jax.tree.map(_penalised, updates, params, penalty, lam)
    decoupled = optimizer == "adamw" and learning_rate is not None
    step_params, eta = params, None
    if decoupled:  # The decoupled decay penalised through the params.
      eta = _f32(_common.value_at(learning_rate, state.count))
      step_params = _decay_penalised_params(params, penalty, lam, eta)
    new_updates, inner_state = base_tx.update(
      new_grads, state.inner_state, step_params, **extra_args
    )
    if optimizer != "sgd":
      sq_avg, new_updates = _adam_statistic(
        sq_avg, new_updates, step_params, params, beta, lam, eta
      )
    # A step with a non-finite gradient (one that optax.apply_if_finite
    # around this rejects) leaves the statistics as they were: else they
    # would hold NaN, and every later step would be rejected too.
    finite = jnp.all(
      jnp.asarray([jnp.all(jnp.isfinite(g)) for g in jax.tree.leaves(updates)])
    )
    sq_avg, max_lr = jax.tree.map(
      lambda new, old: jnp.where(finite, new, old),
      (sq_avg, max_lr),
      (state.sq_avg, state.max_learning_rate),
    )
    return new_updates, GapAwareState(
      count=count,
      max_learning_rate=max_lr,
      sq_avg=sq_avg,
      inner_state=inner_state,
    )

  return optax.GradientTransformationExtraArgs(init_fn, update_fn)


def _gap(p, stale):
  """|p - stale| per element; stale params shaped otherwise (which would
  broadcast) are refused."""
  if jnp.shape(p) != jnp.shape(stale):
    raise ValueError(
      f"gap_aware: stale_params has a leaf of shape {jnp.shape(stale)} "
      f"where the params' is {jnp.shape(p)}: pass the params the "
      "gradient's forward ran with, shaped as params"
    )
  return jnp.abs(_f32(p) - _f32(stale))


def _gap_from_grad(optimizer, grads, inner_state, eta, eps, betas):
  """FTPipe's estimate of a one-step-late gradient's gap, per element:
  SGD's step ``eta |g|``; Adam's ``|e1 - e2|`` (``adam_gap1``: the
  momentum's next step without and with ``g``, from the moments before
  this step, without bias correction as FTPipe has it)."""
  if optimizer == "sgd":
    return jax.tree.map(lambda g: eta * jnp.abs(_f32(g)), grads)
  adam = _common.require_adam_state(inner_state)
  b1, b2 = betas

  def one(g, m, v):
    g, m, v = _f32(g), _f32(m), _f32(v)
    e1 = eta * b1 * m / ((1 - b1) * eps + jnp.sqrt(v) * jnp.sqrt(1 - b1))
    moved = jnp.sqrt(b2 * v + (1 - b2) * jnp.square(g))
    e2 = (eta * b1 * m + eta * (1 - b1) * g) / (
      moved * (1 - b1) / jnp.sqrt(1 - b2) + (1 - b1) * eps
    )
    return jnp.abs(e1 - e2)

  return jax.tree.map(one, grads, adam.mu, adam.nu)


def _decay_penalised_params(params, penalty, lam, eta):
  """AdamW's decoupled decay penalised alike: the params AdamW steps
  from, p (1 - lam eta (1 - G) / G) with G the penalty, so that its
  decay term lam eta p becomes lam eta p / G."""
  return jax.tree.map(
    lambda p, pen, lm: (_f32(p) * (1.0 - lm * eta * (1.0 - pen) / pen)).astype(
      p.dtype
    ),
    params,
    penalty,
    lam,
  )


def _adam_statistic(sq_avg, updates, step_params, params, beta, lam, eta):
  """(S, updates) after an adam/adamw step: S's EMA of the squared
  updates applied (without the decoupled decay part, ``eta`` not None),
  and the updates with the params' scaling
  (``_decay_penalised_params``) returned inside them."""
  decoupled = eta is not None
  applied = updates
  if decoupled:  # S records the update without its decay part.
    applied = jax.tree.map(
      lambda u, p, lm: _f32(u) + eta * lm * _f32(p), updates, step_params, lam
    )
  sq_avg = jax.tree.map(
    lambda a, u: (beta * a + (1 - beta) * jnp.square(_f32(u))).astype(a.dtype),
    sq_avg,
    applied,
  )
  if decoupled:  # The params' scaling returned inside the updates.
    updates = jax.tree.map(
      lambda u, sp, p: (_f32(u) + _f32(sp) - _f32(p)).astype(u.dtype),
      updates,
      step_params,
      params,
    )
  return sq_avg, updates


def _f32(x: jax.Array) -> jax.Array:
  return x.astype(jnp.float32)


def _sgd_scale(grads, state: GapAwareState, count, eta_max, beta, eps):
  """SGD's C per leaf: (new sq_avg, C, new running max learning rate).

  ``A <- beta A + (1 - beta) v^2`` with v the momentum buffer before this
  step (the gradient without one); ``C = eta_max (sqrt(A / (1 - beta^n))
  + eps)``.
  """
  trace = _common.find_one_state(
    state.inner_state, optax.TraceState, "momentum buffer"
  )
  before = grads
  if trace is not None:  # (A leaf optax.masked leaves out has no buffer.)
    before = jax.tree.map(
      lambda g, v: g if isinstance(v, optax.MaskedNode) else v,
      grads,
      trace.trace,
      is_leaf=lambda v: isinstance(v, optax.MaskedNode),
    )
  sq_avg = jax.tree.map(
    lambda a, v: (beta * a + (1 - beta) * jnp.square(v)).astype(a.dtype),
    state.sq_avg,
    before,
  )
  max_lr = jnp.maximum(state.max_learning_rate, _f32(eta_max))
  bias = 1.0 - jnp.asarray(beta, jnp.float32) ** _f32(count)
  scale = jax.tree.map(
    lambda a: max_lr * (jnp.sqrt(_f32(a) / bias) + eps), sq_avg
  )
  return sq_avg, scale, max_lr


def _penalised(g, p, penalty, l2):
  """``g / P``, plus ``l2 * p * (1 - P) / P`` with L2 decay (``l2`` not
  None), so that the decayed gradient ``g + l2 p`` is divided by P as a
  whole."""
  out = _f32(g) / penalty
  if l2 is not None:
    out = out + l2 * _f32(p) * (1.0 - penalty) / penalty
  return out.astype(g.dtype)
