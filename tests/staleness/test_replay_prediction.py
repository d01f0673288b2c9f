"""replay_predictor: exact where the closed forms are exact, documented
elsewhere."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from jpipe import staleness

LR = 0.05


def _state_after_steps(tx, params, steps=4, seed=2):
  rng = np.random.default_rng(seed)
  state = tx.init(params)
  for _ in range(steps):
    g = jnp.asarray(rng.normal(size=params.shape), jnp.float32)
    updates, state = tx.update(g, state, params)
    params = optax.apply_updates(params, updates)
  return params, state


@pytest.mark.parametrize("delay", [0, 1, 2, 5])
@pytest.mark.parametrize("wd", [0.0, 1e-2])
@pytest.mark.parametrize("aggregated", [False, True])
def test_sgd_equals_closed_form(delay, wd, aggregated):
  sgd = optax.sgd(LR, momentum=0.9)
  tx = optax.chain(optax.add_decayed_weights(wd), sgd) if wd else sgd
  params, state = _state_after_steps(tx, jnp.linspace(-1.0, 1.0, 6))
  grad = jnp.linspace(0.5, -0.5, 6) if aggregated else None
  closed = staleness.weight_predictor(
    "sgd", learning_rate=LR, momentum=0.9, weight_decay=wd
  )
  np.testing.assert_allclose(
    staleness.replay_predictor(tx)(params, state, delay, grad=grad),
    closed(params, state, delay, grad=grad),
    rtol=1e-5,
    atol=1e-7,
  )


def _numpy_adam_replay(theta, m, u, t, d, lr, b1, b2, eps, wd, decoupled):
  """Replaying Adam(W) with zero gradients: the second moment decays."""
  theta, m, u = (np.array(x, np.float64) for x in (theta, m, u))
  for k in range(1, d + 1):
    g = 0.0 if decoupled else wd * theta
    m = b1 * m + (1 - b1) * g
    u = b2 * u + (1 - b2) * g**2
    step = (
      lr
      / (1 - b1 ** (t + k))
      * m
      / (np.sqrt(u) / np.sqrt(1 - b2 ** (t + k)) + eps)
    )
    theta = theta * (1 - lr * wd) if decoupled else theta
    theta = theta - step
  return theta


@pytest.mark.parametrize("optimizer", ["adam", "adamw"])
@pytest.mark.parametrize("delay", [1, 2, 5])
def test_adam_replay_decays_second_moment(optimizer, delay):
  """Replay = optimizer semantics; closed form = frozen nu: close, unequal."""
  b1, b2, eps, wd = 0.9, 0.9, 1e-8, 0.1
  if optimizer == "adamw":
    tx = optax.adamw(LR, b1=b1, b2=b2, eps=eps, weight_decay=wd)
  else:
    tx = optax.adam(LR, b1=b1, b2=b2, eps=eps)
    wd = 0.0
  params, state = _state_after_steps(tx, jnp.linspace(-1.0, 1.0, 6))
  adam = state[0]
  replayed = staleness.replay_predictor(tx)(params, state, delay)
  expected = _numpy_adam_replay(
    params,
    adam.mu,
    adam.nu,
    int(adam.count),
    delay,
    LR,
    b1,
    b2,
    eps,
    wd,
    optimizer == "adamw",
  )
  np.testing.assert_allclose(replayed, expected, rtol=1e-5, atol=1e-7)
  closed = staleness.weight_predictor(
    optimizer, learning_rate=LR, b1=b1, b2=b2, eps=eps, weight_decay=wd
  )(params, state, delay)
  # Both decay the params alike; compare the Adam steps beside that decay.
  decayed = np.asarray(params) * (1 - LR * wd) ** delay
  moved_replay = np.abs(np.asarray(replayed) - decayed)
  moved_closed = np.abs(np.asarray(closed) - decayed)
  # Each replayed step is larger by about b2**(-k/2), as documented.
  bound = b2 ** (-delay / 2) * (1 + 1e-4)
  assert np.all(moved_replay >= moved_closed * (1 - 1e-5))
  assert np.all(moved_replay <= moved_closed * bound)
  assert not np.allclose(replayed, closed, rtol=1e-6, atol=0)


def test_scheduler_aware_by_itself():
  schedule = optax.cosine_decay_schedule(0.2, decay_steps=8)
  tx = optax.sgd(schedule, momentum=0.9)
  params, state = _state_after_steps(tx, jnp.ones(3), steps=3)
  lrs = staleness.schedule_lookahead(schedule, 3, 4)
  closed = staleness.weight_predictor(
    "sgd", learning_rate=schedule, momentum=0.9
  )(params, state, 4, learning_rates=lrs)
  np.testing.assert_allclose(
    # float32 rounding differs by op order (seen 1.2e-6 on an H100).
    staleness.replay_predictor(tx)(params, state, 4),
    closed,
    rtol=1e-5,
  )


def test_traced_delay_and_errors():
  tx = optax.adam(LR)
  params, state = _state_after_steps(tx, jnp.ones(3))
  predict = staleness.replay_predictor(tx)
  jitted = jax.jit(predict)
  for d in (0, 3):
    np.testing.assert_allclose(
      jitted(params, state, jnp.int32(d)), predict(params, state, d), rtol=1e-6
    )
  assert jitted._cache_size() == 1
  with pytest.raises(ValueError, match="delay must be an integer >= 0"):
    predict(params, state, -2)
  with pytest.raises(ValueError, match="pass learning_rates=None"):
    predict(params, state, 2, learning_rates=[0.1, 0.1])
