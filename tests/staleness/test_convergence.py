"""Convergence under a simulated delay: staleness hurts, mitigation helps.

A stage with weight stashing computes the gradient applied at step t at the
params its forward saw, tau steps earlier: g_t = grad f(theta_{t-tau}) (or at
the prediction of theta_t made then). The ring of forward-time params is the
jpipe.staleness weight stash, inside lax.scan.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from jpipe import staleness


def parabola(x):
  return 0.5 * jnp.sum(jnp.linspace(0.1, 1.0, x.shape[0]) * x**2)


def rosenbrock(x):
  return jnp.sum(100.0 * (x[1:] - x[:-1] ** 2) ** 2 + (1.0 - x[:-1]) ** 2)


@functools.partial(
  jax.jit, static_argnames=("f", "optimizer", "lr", "tau", "method", "steps")
)
def delayed_losses(f, x0, optimizer, lr, tau, method, steps):
  """Losses of `steps` delayed updates; method in none / wp / ga."""
  if optimizer == "sgd":
    tx = optax.sgd(lr, momentum=0.9)
  else:
    tx = optax.adam(lr)
  if method == "ga":
    tx = staleness.gap_aware(tx, optimizer=optimizer, learning_rate=lr)
  predict = staleness.weight_predictor(
    optimizer, learning_rate=lr, momentum=0.9
  )

  def step(carry, t):
    x, state, stash = carry
    forward_x = staleness.stash_get(stash, t)
    grads = jax.grad(f)(forward_x)
    extra = {"stale_params": forward_x} if method == "ga" else {}
    updates, state = tx.update(grads, state, x, **extra)
    x = optax.apply_updates(x, updates)
    # The forward of microbatch t+1+tau runs now, at x (or its prediction).
    upcoming = predict(x, state, tau) if method == "wp" else x
    stash = staleness.stash_put(stash, t + 1 + tau, upcoming)
    return (x, state, stash), f(x)

  init = (x0, tx.init(x0), staleness.stash_init(x0, tau + 1))
  _, losses = jax.lax.scan(step, init, jnp.arange(steps))
  return losses


def _final_log_loss(losses):
  tail = np.asarray(losses[-20:], np.float64)
  if not np.all(np.isfinite(tail)):
    return np.inf
  return float(np.log10(np.mean(tail) + 1e-30))


@pytest.mark.parametrize("optimizer,lr", [("sgd", 0.02), ("adam", 0.1)])
def test_prediction_recovers_most_of_the_delay_penalty(optimizer, lr):
  x0 = jnp.full((10,), 3.0)
  run = functools.partial(
    delayed_losses, parabola, x0, optimizer, lr, steps=300
  )
  fresh = _final_log_loss(run(tau=0, method="none"))
  stale = _final_log_loss(run(tau=4, method="none"))
  predicted = _final_log_loss(run(tau=4, method="wp"))
  assert stale > fresh + 2.0, (fresh, stale)  # 100x higher loss
  recovered = (stale - predicted) / (stale - fresh)
  assert recovered > 0.75, (fresh, stale, predicted)


def test_gap_aware_keeps_delayed_sgd_from_diverging():
  x0 = jnp.full((10,), 3.0)
  run = functools.partial(delayed_losses, parabola, x0, "sgd", 0.05, steps=300)
  start = float(np.log10(parabola(x0)))
  fresh = _final_log_loss(run(tau=0, method="none"))
  stale = _final_log_loss(run(tau=4, method="none"))
  gap_aware = _final_log_loss(run(tau=4, method="ga"))
  assert fresh < start - 8
  assert stale > start  # plain delayed momentum SGD diverges
  assert gap_aware < start - 2, (start, gap_aware)  # GA converges
  assert (stale - gap_aware) / (stale - fresh) > 0.45


def test_rosenbrock_stale_sgd_diverges_mitigations_do_not():
  x0 = jnp.array([-1.2, 1.0, -1.2, 1.0])
  run = functools.partial(
    delayed_losses, rosenbrock, x0, "sgd", 1e-4, steps=3000
  )
  start = float(np.log10(rosenbrock(x0)))
  fresh = _final_log_loss(run(tau=0, method="none"))
  assert fresh < start - 3
  assert _final_log_loss(run(tau=2, method="none")) == np.inf
  assert _final_log_loss(run(tau=2, method="wp")) < start - 2
  assert _final_log_loss(run(tau=4, method="ga")) < start - 1.5
