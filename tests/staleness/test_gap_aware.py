"""gap_aware against NumPy statements of FTPipe's Gap-Aware optimizers."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from jpipe import staleness
from tests.staleness import numpy_reference as ref

STEPS = 6


def _stream(seed=0, n=5):
  """Random (grad, stale offset) pairs for a vector parameter."""
  rng = np.random.default_rng(seed)
  return [(rng.normal(size=n), rng.normal(size=n) * 0.05) for _ in range(STEPS)]


def _run(tx, theta0, stream):
  params = jnp.asarray(theta0, jnp.float32)
  state = tx.init(params)
  trajectory = []
  for i, (g, offset) in enumerate(stream):
    stale = params + offset if i else params  # first step: no delay yet
    updates, state = tx.update(
      jnp.asarray(g, jnp.float32), state, params, stale_params=stale
    )
    params = optax.apply_updates(params, updates)
    trajectory.append(np.asarray(params))
  return trajectory


def _run_reference(opt, theta0, stream):
  trajectory = []
  for i, (g, offset) in enumerate(stream):
    stale = opt.theta + offset if i else opt.theta
    trajectory.append(opt.step(g, stale).copy())
  return trajectory


@pytest.mark.parametrize("momentum", [0.0, 0.9])
@pytest.mark.parametrize("wd", [0.0, 5e-2])
def test_sgd_matches_reference(momentum, wd):
  lr = 0.1
  sgd = optax.sgd(lr, momentum=momentum if momentum else None)
  base = optax.chain(optax.add_decayed_weights(wd), sgd) if wd else sgd
  tx = staleness.gap_aware(
    base, optimizer="sgd", learning_rate=lr, weight_decay=wd
  )
  theta0 = np.linspace(-1, 1, 5)
  stream = _stream()
  actual = _run(tx, theta0, stream)
  expected = _run_reference(
    ref.SgdGapAware(theta0, lr, momentum, wd), theta0, stream
  )
  np.testing.assert_allclose(actual, expected, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize(
  "optimizer,wd",
  [("adam", 0.0), ("adam", 5e-2), ("adamw", 0.0), ("adamw", 5e-2)],
)
def test_adam_matches_reference(optimizer, wd):
  lr, b1, b2, eps = 0.01, 0.9, 0.99, 1e-8
  if optimizer == "adamw":
    base = optax.adamw(lr, b1=b1, b2=b2, eps=eps, weight_decay=wd)
  else:
    adam = optax.adam(lr, b1=b1, b2=b2, eps=eps)
    base = optax.chain(optax.add_decayed_weights(wd), adam) if wd else adam
  tx = staleness.gap_aware(
    base, optimizer=optimizer, beta=b2, learning_rate=lr, weight_decay=wd
  )
  theta0 = np.linspace(-1, 1, 5)
  stream = _stream(seed=3)
  actual = _run(tx, theta0, stream)
  expected = _run_reference(
    ref.AdamGapAware(
      theta0, lr, b1, b2, eps, wd, decoupled=optimizer == "adamw"
    ),
    theta0,
    stream,
  )
  np.testing.assert_allclose(actual, expected, rtol=2e-5, atol=1e-6)


def test_sgd_running_max_learning_rate_follows_schedule():
  schedule = optax.piecewise_constant_schedule(0.1, {2: 3.0, 4: 0.1})
  tx = staleness.gap_aware(
    optax.sgd(schedule, momentum=0.9), optimizer="sgd", learning_rate=schedule
  )
  params = jnp.zeros(3)
  state = tx.init(params)
  seen = []
  for _ in range(6):
    _, state = tx.update(jnp.ones(3), state, params, stale_params=params)
    seen.append(float(state.max_learning_rate))
  np.testing.assert_allclose(seen, [0.1, 0.1, 0.3, 0.3, 0.3, 0.3], rtol=1e-6)


@pytest.mark.parametrize("optimizer", ["sgd", "adam", "adamw"])
def test_no_gap_is_base_optimizer(optimizer):
  """stale_params == params: exactly the base optimizer's updates."""
  lr = 0.05
  base = {
    "sgd": optax.sgd(lr, momentum=0.9),
    "adam": optax.adam(lr),
    "adamw": optax.adamw(lr, weight_decay=0.1),
  }[optimizer]
  tx = staleness.gap_aware(
    base,
    optimizer=optimizer,
    learning_rate=lr,
    weight_decay=0.1 if optimizer == "adamw" else 0.0,
  )
  rng = np.random.default_rng(0)
  params = jnp.asarray(rng.normal(size=4), jnp.float32)
  plain_params, state, base_state = params, tx.init(params), base.init(params)
  for _ in range(4):
    g = jnp.asarray(rng.normal(size=4), jnp.float32)
    updates, state = tx.update(g, state, params, stale_params=params)
    base_updates, base_state = base.update(g, base_state, plain_params)
    params = optax.apply_updates(params, updates)
    plain_params = optax.apply_updates(plain_params, base_updates)
  np.testing.assert_allclose(params, plain_params, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("optimizer", ["sgd", "adam"])
def test_larger_gap_means_smaller_step(optimizer):
  lr = 0.05
  base = optax.sgd(lr, momentum=0.9) if optimizer == "sgd" else optax.adam(lr)
  tx = staleness.gap_aware(base, optimizer=optimizer, learning_rate=lr)
  params = jnp.zeros(3)
  state = tx.init(params)
  _, state = tx.update(jnp.ones(3), state, params, stale_params=params)
  gaps = jnp.array([0.0, 0.01, 0.1])
  updates, _ = tx.update(jnp.ones(3), state, params, stale_params=params + gaps)
  magnitude = np.abs(np.asarray(updates))
  assert magnitude[0] > magnitude[1] > magnitude[2] > 0


def test_bad_input_raises():
  sgd = optax.sgd(0.1)
  with pytest.raises(ValueError, match="unknown optimizer 'lamb'"):
    staleness.gap_aware(sgd, optimizer="lamb", learning_rate=0.1)
  with pytest.raises(ValueError, match=r"beta must be in \(0, 1\)"):
    staleness.gap_aware(sgd, optimizer="sgd", learning_rate=0.1, beta=1.5)
  with pytest.raises(ValueError, match="needs max_learning_rate"):
    staleness.gap_aware(sgd, optimizer="sgd")
  with pytest.raises(ValueError, match="needs learning_rate"):
    staleness.gap_aware(optax.adamw(0.1), optimizer="adamw", weight_decay=1e-4)
  tx = staleness.gap_aware(sgd, optimizer="sgd", learning_rate=0.1)
  state = tx.init(jnp.zeros(2))
  with pytest.raises(ValueError, match="needs stale_params"):
    tx.update(jnp.ones(2), state, jnp.zeros(2))
  with pytest.raises(ValueError, match="needs the current params"):
    tx.update(jnp.ones(2), state, stale_params=jnp.zeros(2))


def test_inside_chain_only_member_declaring_stale_params_gets_it():
  tx = optax.chain(
    optax.clip_by_global_norm(1.0),
    staleness.gap_aware(
      optax.sgd(0.1, momentum=0.9), optimizer="sgd", learning_rate=0.1
    ),
  )
  params = jnp.zeros(4)
  state = tx.init(params)
  updates, state = tx.update(
    jnp.full(4, 10.0), state, params, stale_params=params + 0.01
  )
  assert np.all(np.isfinite(np.asarray(updates)))
  jitted = jax.jit(tx.update)
  updates2, _ = jitted(
    jnp.full(4, 10.0), state, params, stale_params=params + 0.01
  )
  assert updates2.shape == (4,)
