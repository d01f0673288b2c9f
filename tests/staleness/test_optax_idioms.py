"""The staleness transforms under the optax idioms an outside user brings
(an outside check found each of these wrong): low-precision params, a
weight-decay mask, a NaN guard, masked (frozen) leaves, injected
hyperparameters, and Adam elements no gradient has reached."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from jpipe import staleness


def _ga_sgd(**kwargs):
  return staleness.gap_aware(
    optax.sgd(0.1, momentum=0.9), optimizer="sgd", learning_rate=0.1, **kwargs
  )


def _statistic(buffers, beta=0.999):
  """NumPy: A <- beta A + (1 - beta) v^2 in float64 over the momentum
  buffers v before each step."""
  a = 0.0
  for v in buffers:
    a = beta * a + (1 - beta) * np.float64(v) ** 2
  return a


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
def test_gap_aware_statistic_is_float32_for_low_precision_params(dtype):
  """In bfloat16 beta = 0.999 rounded to 1: the average never forgot (10.06
  against 0.074); in float16 Adam's squared steps underflowed to 0."""
  tx = _ga_sgd()
  params = jnp.zeros(3, dtype)
  state = tx.init(params)
  update = jax.jit(lambda g, st: tx.update(g, st, params, stale_params=params))
  buffers = []
  for g in [4.0] * 10 + [0.0] * 2000:  # (Both exact in either dtype.)
    buffers.append(float(state.inner_state[0].trace[0]))
    _, state = update(jnp.full(3, g, dtype), state)
  assert state.sq_avg.dtype == jnp.float32
  want = _statistic(buffers)
  assert want < 0.2 * _statistic(buffers[:20])  # It forgot.
  np.testing.assert_allclose(state.sq_avg, want, rtol=2e-3)  # (f32 sums.)


def test_gap_aware_decay_mask_leaves_undecayed_leaves_alone():
  """optax.adamw(mask=...) (no decay on biases): Gap-Aware rescaled every
  leaf as if decayed, adding an anti-decay where none applies. Masked out,
  a leaf steps as without weight decay; masked in, as with it."""
  params = {"w": jnp.ones(3), "b": jnp.ones(3)}
  mask = {"w": True, "b": False}
  stale = jax.tree.map(lambda p: p + 0.3, params)
  grads = jax.tree.map(jnp.zeros_like, params)

  def step(weight_decay, mask_arg):
    base = optax.adamw(0.1, weight_decay=weight_decay, mask=mask_arg)
    tx = staleness.gap_aware(
      base,
      optimizer="adamw",
      learning_rate=0.1,
      weight_decay=weight_decay,
      weight_decay_mask=mask_arg,
    )
    state = tx.init(params)
    return tx.update(grads, state, params, stale_params=stale)[0]

  masked = step(0.5, mask)
  np.testing.assert_allclose(masked["b"], step(0.0, None)["b"], atol=1e-7)
  np.testing.assert_allclose(masked["w"], step(0.5, None)["w"], atol=1e-7)
  assert float(masked["w"][0]) < 0  # The decay acts, penalised.
  # A callable mask, as optax takes: the same.
  called = step(0.5, lambda p: {"w": True, "b": False})
  np.testing.assert_allclose(called["b"], masked["b"], atol=0)


def test_a_non_finite_gradient_leaves_gap_aware_statistics_unchanged():
  """gap_aware(apply_if_finite(sgd)): the NaN reached the statistic before
  the guard rejected the step, and every later step was rejected too."""
  tx = staleness.gap_aware(
    optax.apply_if_finite(optax.sgd(0.1), max_consecutive_errors=3),
    optimizer="sgd",
    learning_rate=0.1,
  )
  params = jnp.ones(2)
  state = tx.init(params)
  _, state = tx.update(jnp.ones(2), state, params, stale_params=params)
  before = state.sq_avg
  bad, state = tx.update(
    jnp.array([jnp.nan, 1.0]), state, params, stale_params=params
  )
  np.testing.assert_array_equal(state.sq_avg, before)
  assert float(jnp.abs(bad).sum()) == 0  # Rejected by the guard.
  good, state = tx.update(jnp.ones(2), state, params, stale_params=params)
  assert np.all(np.isfinite(state.sq_avg)) and float(good[0]) < 0


def test_gap_aware_sgd_with_a_frozen_leaf_uses_its_gradient():
  """optax.masked(sgd(momentum)): the frozen leaf has no momentum buffer
  (MaskedNode) -- it crashed; its statistic now reads its gradient."""
  params = {"a": jnp.ones(2), "frozen": jnp.ones(2)}
  base = optax.masked(
    optax.sgd(0.1, momentum=0.9), {"a": True, "frozen": False}
  )
  tx = staleness.gap_aware(base, optimizer="sgd", learning_rate=0.1)
  state = tx.init(params)
  grads = {"a": jnp.ones(2), "frozen": jnp.full(2, 2.0)}
  for _ in range(2):
    updates, state = tx.update(grads, state, params, stale_params=params)
  np.testing.assert_allclose(
    state.sq_avg["frozen"], (1 - 0.999**2) * 4.0 / 1, rtol=1e-5
  )


def test_closed_form_prediction_follows_an_injected_learning_rate():
  """inject_hyperparams' rate lowered from 0.1 to 0.001: the prediction
  kept the constructor's 0.1 (-1.400 where the truth was -0.569)."""
  tx = optax.inject_hyperparams(optax.sgd)(learning_rate=0.1, momentum=0.9)
  params = jnp.zeros(2)
  state = tx.init(params)
  for _ in range(3):
    updates, state = tx.update(jnp.ones(2), state, params)
    params = optax.apply_updates(params, updates)
  state.hyperparams["learning_rate"] = jnp.asarray(0.001)
  predict = staleness.weight_predictor("sgd", learning_rate=0.1, momentum=0.9)
  replay = staleness.replay_predictor(tx)
  np.testing.assert_allclose(
    predict(params, state, 3), replay(params, state, 3), rtol=1e-6
  )
  # A schedule beside inject_hyperparams: the count is read from it.
  scheduled = staleness.weight_predictor(
    "sgd", learning_rate=optax.constant_schedule(0.1), momentum=0.9
  )
  np.testing.assert_allclose(
    scheduled(params, state, 3), replay(params, state, 3), rtol=1e-6
  )


def test_adam_aggmsnag_where_no_gradient_reached_takes_adams_step():
  """nu = 0 (before the first step; an embedding row never looked up):
  the frozen-nu closed form stepped eta * phi / eps (-5.0e4 where Adam's
  step is about -eta). Elements with nu > 0 keep FTPipe's form."""
  tx = optax.adam(0.1, b1=0.9, b2=0.999, eps=1e-8)
  params = {"seen": jnp.ones(2), "unseen": jnp.ones(2)}
  state = tx.init(params)
  grads = {"seen": jnp.ones(2), "unseen": jnp.zeros(2)}
  updates, state = tx.update(grads, state, params)
  params = optax.apply_updates(params, updates)
  predict = staleness.weight_predictor(
    "adam", learning_rate=0.1, b1=0.9, b2=0.999, eps=1e-8
  )
  phi = {"seen": jnp.full(2, 0.5), "unseen": jnp.full(2, 0.5)}
  got = predict(params, state, 1, grad=phi)
  # Adam's own step on phi, for the element no gradient reached.
  _, fresh = optax.adam(0.1).update(
    {"unseen": phi["unseen"]}, optax.adam(0.1).init({"unseen": jnp.ones(2)})
  )
  want_unseen = 1.0 - 0.1 * (0.1 * 0.5 / 0.19) / (
    np.sqrt(0.001 * 0.25 / (1 - 0.999**2)) + 1e-8
  )
  np.testing.assert_allclose(got["unseen"], want_unseen, rtol=1e-5)
  assert abs(float(got["unseen"][0]) - 1.0) < 0.2
  # Where nu > 0: FTPipe's frozen nu.
  nu = 0.001 * 1.0
  m = 0.9 * 0.1 + 0.1 * 0.5
  want_seen = float(params["seen"][0]) - 0.1 * (m / (1 - 0.9**2)) / (
    np.sqrt(nu / (1 - 0.999**2)) + 1e-8
  )
  np.testing.assert_allclose(got["seen"], want_seen, rtol=1e-5)


def test_closed_form_prediction_with_a_decay_mask_matches_the_replay():
  """optax.adamw(mask=...): the closed form decayed every leaf (3.0e-2 off
  the replay on the excluded one)."""
  mask = {"w": True, "b": False}
  tx = optax.adamw(0.05, b1=0.9, b2=0.999, weight_decay=0.5, mask=mask)
  params = {"w": jnp.ones(3), "b": jnp.ones(3)}
  state = tx.init(params)
  for scale in (0.1, 0.2, 0.3):
    g = jax.tree.map(lambda p, c=scale: jnp.full_like(p, c), params)
    updates, state = tx.update(g, state, params)
    params = optax.apply_updates(params, updates)
  predict = staleness.weight_predictor(
    "adamw", learning_rate=0.05, weight_decay=0.5, weight_decay_mask=mask
  )
  unmasked = staleness.weight_predictor(
    "adamw", learning_rate=0.05, weight_decay=0.5
  )
  got, everywhere = predict(params, state, 1), unmasked(params, state, 1)
  np.testing.assert_allclose(got["w"], everywhere["w"], atol=0)
  # One step with frozen nu: the undecayed leaf takes no decay.
  undecayed = staleness.weight_predictor("adamw", learning_rate=0.05)
  np.testing.assert_allclose(got["b"], undecayed(params, state, 1)["b"], atol=0)
  assert not np.allclose(got["b"], everywhere["b"])


@pytest.mark.parametrize(
  "delay, message",
  [
    (jnp.asarray(2.7), "of dtype float32: pass an integer one"),
    ("3", "delay must be an integer >= 0, got '3'"),
    (2**31, "past int32"),
    (jnp.asarray(-2), "delay must be an integer >= 0"),
  ],
)
def test_bad_delays_are_refused_as_python_ones_are(delay, message):
  """A float array was truncated (2.7 -> 2), a string accepted, a
  negative array predicted nothing, 2**31 overflowed."""
  predict = staleness.weight_predictor("sgd", learning_rate=0.1)
  tx = optax.sgd(0.1)
  with pytest.raises(ValueError, match=message):
    predict(jnp.zeros(2), tx.init(jnp.zeros(2)), delay)


def test_a_fresh_stash_holds_no_microbatch():
  stash = staleness.stash_init(jnp.zeros(2), 2)
  assert not bool(staleness.stash_holds(stash, -1))
  stash = staleness.stash_put(stash, 3, jnp.ones(2))
  assert bool(staleness.stash_holds(stash, 3))


def test_stale_params_of_another_shape_are_refused():
  """A (1,) stale leaf for (3,) params broadcast silently."""
  tx = _ga_sgd()
  params = jnp.zeros(3)
  with pytest.raises(ValueError, match=r"shape \(1,\) where the params' is"):
    tx.update(jnp.ones(3), tx.init(params), params, stale_params=jnp.zeros(1))


def test_pipemare_refuses_what_it_would_ignore():
  """K = 1 rescheduled nothing (the first step counts as step 1 of 1); a
  traced delay failed with TracerBoolConversionError."""
  with pytest.raises(ValueError, match="anneal_steps=1 reschedules nothing"):
    staleness.pipemare_learning_rate(4, 1)
  np.testing.assert_allclose(staleness.pipemare_factor(4, 0, 2), 4**-0.5)
  with pytest.raises(ValueError, match="a Python int"):
    jax.jit(lambda d: staleness.pipemare_factor(d, 0, 10))(3)


def test_delay_aware_nesterov_checks_the_delay_without_adaptive():
  with pytest.raises(ValueError, match="0 <= delay < num_stages"):
    staleness.delay_aware_nesterov(1e-3, delay=7, num_stages=4)


def test_closed_form_prediction_with_masked_leaves_names_the_replay():
  """optax.masked: "'MaskedNode' object has no attribute 'astype'"."""
  params = {"a": jnp.ones(2), "frozen": jnp.ones(2)}
  tx = optax.masked(optax.sgd(0.1, momentum=0.9), {"a": True, "frozen": False})
  state = tx.init(params)
  predict = staleness.weight_predictor("sgd", learning_rate=0.1, momentum=0.9)
  with pytest.raises(ValueError, match=r"use staleness.replay_predictor\(tx\)"):
    predict(params, state, 2)
  replayed = staleness.replay_predictor(tx)(params, state, 2)
  assert set(replayed) == {"a", "frozen"}
