"""Weight prediction (FTPipe's msnag / aggmsnag) in closed form.

A pipeline stage with delay d computes its forward for a gradient that will
be applied d optimizer steps later. Weight prediction runs that forward at
the weights those d steps are expected to reach, assuming zero future
gradients (msnag) or only the gradient accumulated so far (aggmsnag).
"""

from collections.abc import Callable
from typing import Any, Protocol

import jax
import jax.numpy as jnp
import optax

from jpipe.staleness import _common


class Predictor(Protocol):
  """`predict(params, opt_state, delay, *, grad, learning_rates) -> params`."""

  def __call__(
    self,
    params: optax.Params,
    opt_state: optax.OptState,
    delay: jax.typing.ArrayLike,
    *,
    grad: optax.Updates | None = None,
    learning_rates: jax.typing.ArrayLike | None = None,
  ) -> optax.Params: ...


def schedule_lookahead(
  schedule: Callable[[jax.Array], jax.Array],
  count: jax.typing.ArrayLike,
  horizon: int,
) -> jax.Array:
  """The learning rates of the next `horizon` optimizer steps.

  optax evaluates a schedule at the number of steps already taken, so the
  k-th future step (k = 1..horizon) uses ``schedule(count + k - 1)``. Pass the
  result as ``learning_rates`` to make prediction scheduler-aware (FTPipe's
  ``sched_aware``). `horizon` is static; use the largest delay of the stage.

  Args:
    schedule: an optax schedule, step -> learning rate.
    count: steps taken so far (int scalar, may be traced).
    horizon: how many future learning rates to return.

  Returns:
    float array [horizon].
  """
  if horizon < 0:
    raise ValueError(f"horizon must be >= 0, got {horizon}")
  steps = jnp.asarray(count, jnp.int32) + jnp.arange(horizon, dtype=jnp.int32)
  return jax.vmap(lambda s: jnp.asarray(schedule(s), jnp.float32))(steps)


def weight_predictor(
  optimizer: str,
  *,
  learning_rate: _common.ScalarOrSchedule,
  momentum: float = 0.0,
  b1: float = 0.9,
  b2: float = 0.999,
  eps: float = 1e-8,
  weight_decay: float = 0.0,
  weight_decay_mask: Any = None,
) -> Predictor:
  r"""Closed-form weight prediction for SGD, Adam and AdamW (FTPipe §3).

  With future learning rates :math:`\eta_1..\eta_d` (the current one repeated
  unless ``learning_rates`` is given) and :math:`\phi` the gradient
  accumulated so far (``grad``; zero for msnag):

  - SGD (``optax.sgd(lr, momentum)``, with ``optax.add_decayed_weights(wd)``
    chained before it when ``weight_decay > 0``): the unrolled recursion
    :math:`u_k = [k=1]\phi + \lambda\hat\theta_{k-1}`,
    :math:`\hat v_k = \gamma \hat v_{k-1} + u_k`,
    :math:`\hat\theta_k = \hat\theta_{k-1} - \eta_k \hat v_k`. Without weight
    decay this is :math:`\theta - \sum_k \eta_k\gamma^{k-1}(\gamma v+\phi)`.
    The recursion is linear, so it is evaluated on three scalar coefficients
    and applied to the params in one pass.
  - Adam (``optax.adam``; L2 via ``add_decayed_weights`` before it) and AdamW
    (``optax.adamw``): the second moment is frozen,
    :math:`D_k = \sqrt{\nu}/\sqrt{1-\beta_2^{t+k}} + \epsilon`,
    :math:`\hat m_k = \beta_1\hat m_{k-1} + (1-\beta_1)g_k` with
    :math:`g_k = [k=1]\phi + \lambda_{L2}\hat\theta_{k-1}`, AdamW first decays
    :math:`\hat\theta \leftarrow (1-\eta_k\lambda)\hat\theta`, then
    :math:`\hat\theta \leftarrow \hat\theta - \eta_k\hat m_k /
    ((1-\beta_1^{t+k}) D_k)`. With ``grad`` (aggmsnag) steps with
    :math:`\eta_k = 0` are skipped, as in FTPipe.

  FTPipe's quirk of adding :math:`\lambda\hat\theta` into the real gradient
  (Adam aggmsnag with L2) is not reproduced. Nesterov is ignored, as there.
  With ``grad``, FTPipe's frozen :math:`\nu` also leaves out the
  :math:`(1-\beta_2)\phi^2` a real step adds (so the first step is larger
  than Adam's where :math:`\phi^2` is large against :math:`\nu`); where
  :math:`\nu = 0` (before the first step, or an element no gradient has
  reached yet) that step would be :math:`\eta\phi/\epsilon`, so there
  :math:`\nu = (1-\beta_2)\phi^2` is taken, as Adam's step would.
  ``replay_predictor`` is exact for any optimizer.

  The learning rate is the one ``optax.inject_hyperparams`` holds in the
  state where there is one (it may have been changed since), else
  ``learning_rate``.

  Args:
    optimizer: "sgd", "adam" or "adamw": how ``opt_state`` was built.
    learning_rate: the optimizer's learning rate, a float or an optax schedule
      (then the current rate is ``schedule(count)``).
    momentum: SGD momentum :math:`\gamma`.
    b1: Adam's first-moment decay.
    b2: Adam's second-moment decay.
    eps: Adam's epsilon.
    weight_decay: :math:`\lambda`; L2 for "sgd"/"adam", decoupled for "adamw"
      (note ``optax.adamw``'s own default is 1e-4: pass the same value).
    weight_decay_mask: the optimizer's decay mask (``optax.adamw(mask=)``,
      ``add_decayed_weights(mask=)``): a pytree of bools like the params or
      a callable of them; None decays every leaf.

  Returns:
    ``predict(params, opt_state, delay, *, grad=None, learning_rates=None)``
    returning the params ``delay`` steps ahead, in the params' dtypes.
    ``delay`` may be traced (one compilation serves every delay); a traced
    negative delay predicts nothing. ``learning_rates`` needs at least
    ``delay`` entries (e.g. from :func:`schedule_lookahead`).

  Examples:
    >>> import jax.numpy as jnp, optax
    >>> from jpipe import staleness
    >>> tx = optax.sgd(0.1, momentum=0.9)
    >>> params = jnp.ones(2)
    >>> _, state = tx.update(jnp.ones(2), tx.init(params))  # One step.
    >>> predict = staleness.weight_predictor("sgd", learning_rate=0.1,
    ...                                      momentum=0.9)
    >>> predict(params, state, 2)  # 1 - 0.1 * (0.9 + 0.81)
    Array([0.829, 0.829], dtype=float32)

  References:
    Eliad et al, `Fine-tuning giant neural networks on commodity hardware with
    automatic pipeline model parallelism
    <https://www.usenix.org/conference/atc21/presentation/eliad>`_, 2021
  """
  _common.check_optimizer(optimizer)
  _common.check_unit_interval("momentum", momentum)
  _common.check_open_unit("b1", b1)
  _common.check_open_unit("b2", b2)
  _common.check_non_negative("eps", eps)
  _common.check_non_negative("weight_decay", weight_decay)
  if learning_rate is None:
    raise ValueError("learning_rate is required (a float or a schedule)")
  if not callable(learning_rate):
    _common.check_non_negative("learning_rate", learning_rate)

  def lr_fn(opt_state, learning_rates):
    if learning_rates is not None:
      lrs = jnp.asarray(learning_rates, jnp.float32)
      if lrs.ndim != 1:
        raise ValueError(
          f"learning_rates must be 1-D [delay], got shape {lrs.shape}"
        )
      return lambda k: lrs[k]
    current = _common.injected_learning_rate(opt_state)
    if current is not None:
      pass
    elif callable(learning_rate):
      current = _common.value_at(learning_rate, _common.step_count(opt_state))
    else:
      current = jnp.asarray(learning_rate)
    current = current.astype(jnp.float32)
    return lambda k: current

  def predict(params, opt_state, delay, *, grad=None, learning_rates=None):
    _common.check_delay(delay)
    if learning_rates is not None and _common.is_concrete(delay):
      if len(learning_rates) < int(delay):
        raise ValueError(
          f"learning_rates has {len(learning_rates)} entries, fewer than "
          f"delay={int(delay)}"
        )
    _common.check_state_matches(opt_state, optimizer, "weight prediction")
    _check_one_optimizer(opt_state)
    lr_at = lr_fn(opt_state, learning_rates)
    delay = jnp.maximum(jnp.asarray(delay, jnp.int32), 0)

    def predicted(decay):
      if optimizer == "sgd":
        return _predict_sgd(
          params, opt_state, delay, grad, lr_at, momentum, decay
        )
      return _predict_adam(
        params, opt_state, delay, grad, lr_at, optimizer, b1, b2, eps, decay
      )

    new = predicted(weight_decay)
    if weight_decay_mask is not None:  # Undecayed leaves predicted apart.
      mask = _common.decay_mask_tree(weight_decay_mask, params)
      new = jax.tree.map(
        lambda m, a, b: jnp.where(m, a, b), mask, new, predicted(0.0)
      )
    return optax.tree.cast_like(new, params)

  return predict


def _check_one_optimizer(opt_state) -> None:
  """A ValueError where ``optax.masked`` / ``multi_transform`` left leaves
  out of the optimizer (MaskedNode in its state): the closed forms read
  one optimizer over every leaf."""
  masked = jax.tree.leaves(
    opt_state, is_leaf=lambda x: isinstance(x, optax.MaskedNode)
  )
  if any(isinstance(x, optax.MaskedNode) for x in masked):
    raise ValueError(
      "weight_predictor's closed forms read one optimizer over every leaf, "
      "but optax.masked / multi_transform leaves some out of it: use "
      "staleness.replay_predictor(tx) (any optax optimizer, exact)"
    )


def _predict_sgd(params, opt_state, delay, grad, lr_at, momentum, weight_decay):
  """SGD prediction via scalar coefficients of (theta, v, phi)."""
  trace = _common.momentum_buffer(opt_state, momentum)
  gamma = jnp.asarray(momentum, jnp.float32)
  lam = jnp.asarray(weight_decay, jnp.float32)
  phi_basis = jnp.array([0.0, 0.0, 1.0], jnp.float32)

  def body(k, carry):
    theta_c, v_c = carry
    u = jnp.where(k == 0, phi_basis, 0.0) + lam * theta_c
    v_c = gamma * v_c + u
    theta_c = theta_c - lr_at(k) * v_c
    return theta_c, v_c

  init = (jnp.array([1.0, 0.0, 0.0]), jnp.array([0.0, 1.0, 0.0]))
  coef, _ = jax.lax.fori_loop(0, delay, body, init)

  def combine(theta, v, phi):
    dtype = _common.compute_dtype(theta.dtype)
    out = coef[0].astype(dtype) * theta.astype(dtype)
    if v is not None:
      out = out + coef[1].astype(dtype) * v.astype(dtype)
    if phi is not None:
      out = out + coef[2].astype(dtype) * phi.astype(dtype)
    return out

  return _map_optional(combine, params, trace, grad)


def _map_optional(fn, tree, *others):
  """``jax.tree.map(fn, tree, *others)`` where an entry of ``others`` may
  be None for a tree that is absent (``fn`` gets None at each leaf).
  None subtrees of ``tree`` (a pipeline stage's view of the model: the
  leaves other stages hold) stay None."""
  present = [o for o in others if o is not None]

  def one(x, *ys):
    it = iter(ys)
    return fn(x, *(None if o is None else next(it) for o in others))

  return jax.tree.map(one, tree, *present)


def _predict_adam(
  params, opt_state, delay, grad, lr_at, optimizer, b1, b2, eps, weight_decay
):
  """Adam / AdamW prediction with the second moment frozen."""
  adam = _common.require_adam_state(opt_state)
  skip_zero_lr = grad is not None  # aggmsnag skips eta_k = 0 steps (FTPipe)
  l2 = weight_decay if optimizer == "adam" else 0.0
  decoupled = weight_decay if optimizer == "adamw" else 0.0
  t = adam.count.astype(jnp.float32)

  def up(x, ref):
    return x.astype(_common.compute_dtype(ref.dtype))

  theta0 = jax.tree.map(lambda p: up(p, p), params)
  m0 = jax.tree.map(up, adam.mu, params)
  nu = jax.tree.map(up, adam.nu, params)
  phi = None if grad is None else jax.tree.map(up, grad, params)
  if phi is not None:  # Where no step has reached nu, the one phi takes.
    nu = _map_optional(
      lambda u, g: jnp.where(u == 0, (1.0 - b2) * jnp.square(g), u), nu, phi
    )

  def body(k, carry):
    theta, m = carry
    eta = lr_at(k)
    step = t + (k + 1).astype(jnp.float32)
    bc1 = 1.0 - jnp.asarray(b1, jnp.float32) ** step
    bc2 = 1.0 - jnp.asarray(b2, jnp.float32) ** step
    active = jnp.logical_or(eta != 0.0, not skip_zero_lr)

    def leaf(th, mm, u, g):
      gk = l2 * th
      if g is not None:
        gk = gk + jnp.where(k == 0, g, jnp.zeros_like(g))
      th_new = th * (1.0 - eta * decoupled)
      mm_new = b1 * mm + (1.0 - b1) * gk
      denom = jnp.sqrt(u) / jnp.sqrt(bc2) + eps
      th_new = th_new - (eta / bc1) * mm_new / denom
      return (
        jnp.where(active, th_new, th).astype(th.dtype),
        jnp.where(active, mm_new, mm).astype(mm.dtype),
      )

    pairs = _map_optional(leaf, theta, m, nu, phi)
    treedef = jax.tree.structure(theta)
    leaves = treedef.flatten_up_to(pairs)
    return (
      treedef.unflatten([p[0] for p in leaves]),
      treedef.unflatten([p[1] for p in leaves]),
    )

  theta, _ = jax.lax.fori_loop(0, delay, body, (theta0, m0))
  return theta


def nag_delay(delay: jax.typing.ArrayLike) -> jax.Array:
  """FTPipe's ``nag_with_predictor``: a delay of 0 predicts one step ahead."""
  return jnp.maximum(jnp.asarray(delay, jnp.int32), 1)


__all__: list[Any] = [
  "Predictor",
  "nag_delay",
  "schedule_lookahead",
  "weight_predictor",
]
