"""One matrix of optax-contract checks for every staleness transform."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from jpipe import staleness

LR = 0.05


def _gap_aware(optimizer, **overrides):
  base = {
    "sgd": optax.sgd(LR, momentum=0.9),
    "adam": optax.adam(LR),
    "adamw": optax.adamw(LR, weight_decay=1e-2),
  }[optimizer]
  kwargs = dict(
    optimizer=optimizer,
    learning_rate=LR,
    weight_decay=1e-2 if optimizer == "adamw" else 0.0,
  )
  kwargs.update(overrides)
  return staleness.gap_aware(base, **kwargs)


TRANSFORMS = {
  "ga_sgd": lambda: _gap_aware("sgd"),
  "ga_adam": lambda: _gap_aware("adam", beta=0.999),
  "ga_adamw": lambda: _gap_aware("adamw", beta=0.999),
  "ga_sgd_in_chain": lambda: optax.chain(optax.clip(1.0), _gap_aware("sgd")),
  "ga_adam_in_chain": lambda: optax.chain(optax.clip(1.0), _gap_aware("adam")),
}


def _params(dtype=jnp.float32):
  return {
    "w": jnp.linspace(-1.0, 1.0, 6, dtype=dtype).reshape(2, 3),
    "b": jnp.ones((3,), dtype),
  }


def _grads(params, scale=1.0):
  return jax.tree.map(lambda p: jnp.full_like(p, 0.5 * scale), params)


def _stale(params):
  return jax.tree.map(lambda p: p + jnp.asarray(0.01, p.dtype), params)


@pytest.mark.parametrize("name", sorted(TRANSFORMS))
def test_accepts_unknown_extra_args(name):
  tx = TRANSFORMS[name]()
  params = _params()
  state = tx.init(params)
  updates, _ = tx.update(
    _grads(params), state, params, stale_params=_stale(params), unknown_arg=3
  )
  assert jax.tree.structure(updates) == jax.tree.structure(params)


@pytest.mark.parametrize("name", sorted(TRANSFORMS))
def test_no_recompilation_across_steps(name):
  tx = TRANSFORMS[name]()
  params = _params()
  state = tx.init(params)
  update = jax.jit(tx.update)
  for i in range(3):
    updates, state = update(
      _grads(params, i + 1.0), state, params, stale_params=_stale(params)
    )
    params = optax.apply_updates(params, updates)
  assert update._cache_size() == 1


@pytest.mark.parametrize("name", sorted(TRANSFORMS))
def test_preserves_bf16(name):
  tx = TRANSFORMS[name]()
  params = _params(jnp.bfloat16)
  state = tx.init(params)
  updates, state = jax.jit(tx.update)(
    _grads(params), state, params, stale_params=_stale(params)
  )
  for u in jax.tree.leaves(updates):
    assert u.dtype == jnp.bfloat16
  ga = [
    s
    for s in jax.tree.leaves(
      state, is_leaf=lambda x: isinstance(x, staleness.GapAwareState)
    )
    if isinstance(s, staleness.GapAwareState)
  ]
  # Gap-Aware's statistic is float32 whatever the params: in bfloat16
  # beta = 0.999 is 1 (test_optax_idioms.py).
  assert ga and all(
    a.dtype == jnp.float32 for a in jax.tree.leaves(ga[0].sq_avg)
  )


@pytest.mark.parametrize("optimizer", ["sgd", "adam", "adamw"])
def test_inject_hyperparams(optimizer):
  base = {
    "sgd": optax.sgd(LR, momentum=0.9),
    "adam": optax.adam(LR),
    "adamw": optax.adamw(LR, weight_decay=1e-2),
  }[optimizer]
  schedule = optax.linear_schedule(LR, LR / 2, 10)
  tx = optax.inject_hyperparams(staleness.gap_aware)(
    base,
    optimizer=optimizer,
    beta=0.99,
    learning_rate=schedule,
    weight_decay=1e-2 if optimizer == "adamw" else 0.0,
  )
  params = _params()
  state = tx.init(params)
  for _ in range(3):
    updates, state = jax.jit(tx.update)(
      _grads(params), state, params, stale_params=_stale(params)
    )
    params = optax.apply_updates(params, updates)
  np.testing.assert_allclose(state.hyperparams["beta"], 0.99, rtol=1e-6)
  np.testing.assert_allclose(
    state.hyperparams["learning_rate"], schedule(2), rtol=1e-6
  )
  assert all(np.all(np.isfinite(p)) for p in jax.tree.leaves(params))


@pytest.mark.parametrize("name", sorted(TRANSFORMS))
def test_map_params(name):
  tx = TRANSFORMS[name]()
  params = _params()
  state = tx.init(params)
  mapped = optax.tree.map_params(tx, lambda p: p.astype(jnp.bfloat16), state)
  ga = [
    s
    for s in jax.tree.leaves(
      mapped, is_leaf=lambda x: isinstance(x, staleness.GapAwareState)
    )
    if isinstance(s, staleness.GapAwareState)
  ][0]
  assert all(a.dtype == jnp.bfloat16 for a in jax.tree.leaves(ga.sq_avg))
  assert ga.count.dtype == jnp.int32


@pytest.mark.parametrize("said, runs", [("sgd", "adam"), ("adam", "sgd")])
def test_transforms_refuse_an_optimizer_other_than_named(said, runs):
  """gap_aware / weight_predictor told one optimizer while running with
  another would read statistics from the wrong place: an error, not a
  silent run."""
  params = {"w": jnp.ones(3)}
  inner = optax.adam(0.1) if runs == "adam" else optax.sgd(0.1, momentum=0.9)
  with pytest.raises(ValueError, match=f"optimizer='{said}'"):
    staleness.gap_aware(
      inner, optimizer=said, learning_rate=0.1, max_learning_rate=0.1
    ).init(params)
  predict = staleness.weight_predictor(said, learning_rate=0.1, momentum=0.9)
  with pytest.raises(ValueError, match=f"optimizer='{said}'"):
    predict(params, inner.init(params), 1)
  # The matching pair still works.
  right = "adam" if runs == "adam" else "sgd"
  staleness.gap_aware(
    inner, optimizer=right, learning_rate=0.1, max_learning_rate=0.1
  ).init(params)
  staleness.weight_predictor(right, learning_rate=0.1, momentum=0.9)(
    params, inner.init(params), 1
  )
