"""Weight prediction for any optax optimizer, by replaying future steps."""

import jax
import jax.numpy as jnp
import optax

from jpipe.staleness import _common
from jpipe.staleness._weight_prediction import Predictor


def replay_predictor(tx: optax.GradientTransformation) -> Predictor:
  r"""Predicts params ``delay`` steps ahead by replaying ``tx`` on a copy.

  The future gradients are taken as zero, except the first one, which is
  ``grad`` when given (aggmsnag). Every other part of the optimizer runs as
  it would: schedules advance with the state's step count (so prediction is
  scheduler-aware by itself), weight decay and momentum act, and so do the
  second-moment decay and bias corrections of adaptive methods.

  Where it equals :func:`weight_predictor`: SGD with or without momentum and
  L2 weight decay (the closed form is this recursion), up to rounding.

  Where it differs: for Adam and AdamW the closed form freezes the second
  moment :math:`\nu` (FTPipe), while the replay decays it,
  :math:`\nu_k = \beta_2^k \nu` (plus :math:`(1-\beta_2)\phi^2` in the first
  step with ``grad``). Each predicted step is then larger by about
  :math:`\beta_2^{-k/2}`: 0.05% per step for :math:`\beta_2 = 0.999`, 5% for
  0.9. The replay also cannot skip :math:`\eta_k = 0` steps.

  Args:
    tx: the optimizer whose state ``opt_state`` is; any optax transformation
      (extra args are not passed to it during the replay).

  Returns:
    ``predict(params, opt_state, delay, *, grad=None, learning_rates=None)``
    as for :func:`weight_predictor`; ``learning_rates`` must be None (the
    replay reads the schedule from the state). ``delay`` may be traced.

  Examples:
    >>> import jax.numpy as jnp, optax
    >>> from jpipe import staleness
    >>> tx = optax.sgd(0.1, momentum=0.9)
    >>> params = jnp.ones(2)
    >>> state = tx.init(params)
    >>> _, state = tx.update(jnp.ones(2), state)
    >>> predicted = staleness.replay_predictor(tx)(params, state, 2)
    >>> bool(jnp.allclose(predicted, 1 - 0.1 * (0.9 + 0.81)))
    True
  """
  tx = optax.with_extra_args_support(tx)

  def predict(params, opt_state, delay, *, grad=None, learning_rates=None):
    _common.check_delay(delay)
    if learning_rates is not None:
      raise ValueError(
        "replay_predictor reads future learning rates from the optimizer's "
        "own schedule; pass learning_rates=None (use weight_predictor to "
        "give them explicitly)"
      )
    delay = jnp.maximum(jnp.asarray(delay, jnp.int32), 0)
    zeros = optax.tree.zeros_like(params)
    first = zeros if grad is None else optax.tree.cast_like(grad, params)

    def body(k, carry):
      theta, state = carry
      g = jax.tree.map(lambda f, z: jnp.where(k == 0, f, z), first, zeros)
      updates, state = tx.update(g, state, theta)
      return optax.apply_updates(theta, updates), state

    theta, _ = jax.lax.fori_loop(0, delay, body, (params, opt_state))
    return theta

  return predict
