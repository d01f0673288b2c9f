"""weight_predictor against NumPy statements of FTPipe's formulas."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from jpipe import staleness
from tests.staleness import numpy_reference as ref

DELAYS = (0, 1, 2, 5)
LR = 0.05


def _params(seed=0):
  rng = np.random.default_rng(seed)
  return {
    "w": jnp.asarray(rng.normal(size=(3, 4)), jnp.float32),
    "b": jnp.asarray(rng.normal(size=(4,)), jnp.float32),
  }


def _run_steps(tx, params, steps=3, seed=1):
  """Real optax steps with random gradients; returns (params, state)."""
  rng = np.random.default_rng(seed)
  state = tx.init(params)
  for _ in range(steps):
    grads = jax.tree.map(
      lambda p: jnp.asarray(rng.normal(size=p.shape), p.dtype), params
    )
    updates, state = tx.update(grads, state, params)
    params = optax.apply_updates(params, updates)
  return params, state


def _grad_like(params, seed=7):
  rng = np.random.default_rng(seed)
  return jax.tree.map(
    lambda p: jnp.asarray(rng.normal(size=p.shape), p.dtype), params
  )


def _build(optimizer, momentum=0.9, wd=0.0, lr=LR):
  if optimizer == "sgd":
    tx = optax.sgd(lr, momentum=momentum)
    return optax.chain(optax.add_decayed_weights(wd), tx) if wd else tx
  if optimizer == "adam":
    tx = optax.adam(lr, b1=0.9, b2=0.99, eps=1e-6)
    return optax.chain(optax.add_decayed_weights(wd), tx) if wd else tx
  return optax.adamw(lr, b1=0.9, b2=0.99, eps=1e-6, weight_decay=wd)


def _reference(optimizer, params, state, d, lrs, momentum, wd, grad):
  out = {}
  for name, theta in params.items():
    phi = None if grad is None else np.asarray(grad[name])
    if optimizer == "sgd":
      trace = staleness._common.find_states(state, optax.TraceState)[0].trace
      out[name] = ref.sgd_predict(theta, trace[name], d, lrs, momentum, wd, phi)
    else:
      adam = staleness._common.find_states(state, optax.ScaleByAdamState)[0]
      fn = ref.adam_predict if optimizer == "adam" else ref.adamw_predict
      out[name] = fn(
        theta,
        adam.mu[name],
        adam.nu[name],
        int(adam.count),
        d,
        lrs,
        0.9,
        0.99,
        1e-6,
        wd,
        phi,
      )
  return out


def _assert_close(actual, expected, rtol=2e-5, atol=1e-6):
  for name in expected:
    np.testing.assert_allclose(
      np.asarray(actual[name], np.float64), expected[name], rtol=rtol, atol=atol
    )


@pytest.mark.parametrize("delay", DELAYS)
@pytest.mark.parametrize(
  "optimizer,wd",
  [
    ("sgd", 0.0),
    ("sgd", 5e-2),
    ("adam", 0.0),
    ("adam", 5e-2),
    ("adamw", 0.0),
    ("adamw", 5e-2),
  ],
)
@pytest.mark.parametrize("aggregated", [False, True])
def test_matches_numpy_reference(delay, optimizer, wd, aggregated):
  tx = _build(optimizer, wd=wd)
  params, state = _run_steps(tx, _params())
  grad = _grad_like(params) if aggregated else None
  predict = staleness.weight_predictor(
    optimizer,
    learning_rate=LR,
    momentum=0.9,
    b1=0.9,
    b2=0.99,
    eps=1e-6,
    weight_decay=wd,
  )
  actual = predict(params, state, delay, grad=grad)
  expected = _reference(
    optimizer, params, state, delay, [LR] * delay, 0.9, wd, grad
  )
  _assert_close(actual, expected)


@pytest.mark.parametrize("delay", DELAYS)
def test_sgd_msnag_equals_ftpipe_closed_form(delay):
  params, state = _run_steps(_build("sgd"), _params())
  trace = state[0].trace
  actual = staleness.weight_predictor("sgd", learning_rate=LR, momentum=0.9)(
    params, state, delay
  )
  for name in params:
    expected = ref.sgd_msnag_closed_form(
      params[name], trace[name], delay, LR, 0.9
    )
    np.testing.assert_allclose(actual[name], expected, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("optimizer", ["sgd", "adam", "adamw"])
@pytest.mark.parametrize("aggregated", [False, True])
def test_scheduler_aware_learning_rates(optimizer, aggregated):
  """Explicit future learning rates, including a zero (warm-up) step."""
  wd = 1e-2
  tx = _build(optimizer, wd=wd)
  params, state = _run_steps(tx, _params())
  grad = _grad_like(params) if aggregated else None
  lrs = [0.0, 0.02, 0.04, 0.03, 0.01]
  predict = staleness.weight_predictor(
    optimizer,
    learning_rate=LR,
    momentum=0.9,
    b1=0.9,
    b2=0.99,
    eps=1e-6,
    weight_decay=wd,
  )
  actual = predict(params, state, 5, grad=grad, learning_rates=jnp.array(lrs))
  expected = _reference(optimizer, params, state, 5, lrs, 0.9, wd, grad)
  _assert_close(actual, expected)


def test_schedule_learning_rate_and_lookahead():
  """A schedule as learning_rate: current rate repeats; lookahead is exact."""
  schedule = optax.linear_schedule(0.1, 0.0, transition_steps=10)
  tx = optax.sgd(schedule, momentum=0.9)
  params, state = _run_steps(tx, _params(), steps=4)
  predict = staleness.weight_predictor(
    "sgd", learning_rate=schedule, momentum=0.9
  )
  trace = state[0].trace
  repeated = predict(params, state, 3)
  expected = {
    k: ref.sgd_predict(params[k], trace[k], 3, [schedule(4)] * 3, 0.9, 0.0)
    for k in params
  }
  _assert_close(repeated, expected)
  lrs = staleness.schedule_lookahead(schedule, 4, 3)
  np.testing.assert_allclose(lrs, [schedule(4), schedule(5), schedule(6)])
  aware = predict(params, state, 3, learning_rates=lrs)
  # Replaying the real optimizer with zero gradients is the ground truth.
  replayed = staleness.replay_predictor(tx)(params, state, 3)
  _assert_close(aware, {k: np.asarray(v) for k, v in replayed.items()})


def test_delay_zero_returns_params():
  params, state = _run_steps(_build("adamw", wd=0.1), _params())
  predict = staleness.weight_predictor(
    "adamw", learning_rate=LR, weight_decay=0.1
  )
  out = predict(params, state, 0, grad=_grad_like(params))
  jax.tree.map(np.testing.assert_array_equal, out, params)


def test_nag_delay_predicts_at_least_one_step_ahead():
  """FTPipe's ``nag_with_predictor``: max(delay, 1), as int32, traced too."""
  delays = np.array([0, 1, 2, 7])
  want = np.maximum(delays, 1)
  np.testing.assert_array_equal(staleness.nag_delay(delays), want)
  assert staleness.nag_delay(0).dtype == jnp.int32
  traced = jax.jit(staleness.nag_delay)
  assert [int(traced(d)) for d in delays] == list(want)


@pytest.mark.parametrize("optimizer", ["sgd", "adam", "adamw"])
def test_traced_delay_compiles_once(optimizer):
  params, state = _run_steps(_build(optimizer, wd=1e-2), _params())
  predict = staleness.weight_predictor(
    optimizer,
    learning_rate=LR,
    momentum=0.9,
    b1=0.9,
    b2=0.99,
    eps=1e-6,
    weight_decay=1e-2,
  )
  traces = []

  @jax.jit
  def jitted(params, state, delay):
    traces.append(1)
    return predict(params, state, delay)

  for delay in DELAYS:
    out = jitted(params, state, jnp.int32(delay))
    eager = predict(params, state, delay)
    jax.tree.map(
      lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-6), out, eager
    )
  assert len(traces) == 1


@pytest.mark.parametrize("optimizer", ["sgd", "adam", "adamw"])
def test_bf16_params_keep_dtype(optimizer):
  params32, state = _run_steps(_build(optimizer, wd=1e-2), _params())
  params = jax.tree.map(lambda p: p.astype(jnp.bfloat16), params32)
  predict = staleness.weight_predictor(
    optimizer,
    learning_rate=LR,
    momentum=0.9,
    b1=0.9,
    b2=0.99,
    eps=1e-6,
    weight_decay=1e-2,
  )
  out = jax.jit(predict)(params, state, 3)
  full = predict(params32, state, 3)
  for name in params:
    assert out[name].dtype == jnp.bfloat16
    np.testing.assert_allclose(
      np.asarray(out[name], np.float32), full[name], rtol=2e-2, atol=2e-2
    )


def test_finds_moments_inside_inject_hyperparams_and_chains():
  tx = optax.chain(
    optax.clip_by_global_norm(10.0),
    optax.inject_hyperparams(optax.adamw)(
      learning_rate=LR, b1=0.9, b2=0.99, eps=1e-6, weight_decay=0.1
    ),
  )
  params, state = _run_steps(tx, _params())
  predict = staleness.weight_predictor(
    "adamw", learning_rate=LR, b1=0.9, b2=0.99, eps=1e-6, weight_decay=0.1
  )
  expected = _reference("adamw", params, state, 2, [LR] * 2, 0.0, 0.1, None)
  _assert_close(predict(params, state, 2), expected)


def test_bad_hyperparameters_raise():
  with pytest.raises(ValueError, match="unknown optimizer 'rmsprop'"):
    staleness.weight_predictor("rmsprop", learning_rate=0.1)
  with pytest.raises(ValueError, match="b2 must be in"):
    staleness.weight_predictor("adam", learning_rate=0.1, b2=1.0)
  with pytest.raises(ValueError, match="momentum must be in"):
    staleness.weight_predictor("sgd", learning_rate=0.1, momentum=-0.5)
  with pytest.raises(ValueError, match="weight_decay must be >= 0"):
    staleness.weight_predictor("sgd", learning_rate=0.1, weight_decay=-1.0)
  params, state = _run_steps(_build("sgd"), _params())
  predict = staleness.weight_predictor("sgd", learning_rate=LR, momentum=0.9)
  with pytest.raises(ValueError, match="delay must be an integer >= 0"):
    predict(params, state, -1)
  with pytest.raises(ValueError, match="fewer than delay=3"):
    predict(params, state, 3, learning_rates=[0.1, 0.1])


def test_state_without_needed_moments_raises():
  params, sgd_state = _run_steps(_build("sgd"), _params())
  adam_predict = staleness.weight_predictor("adam", learning_rate=LR)
  with pytest.raises(ValueError, match="no optax.ScaleByAdamState"):
    adam_predict(params, sgd_state, 2)
  _, plain_state = _run_steps(optax.sgd(LR), _params())
  momentum_predict = staleness.weight_predictor(
    "sgd", learning_rate=LR, momentum=0.9
  )
  with pytest.raises(ValueError, match="no optax.TraceState"):
    momentum_predict(params, plain_state, 2)
  two = optax.chain(optax.adam(LR), optax.adam(LR))
  _, two_state = _run_steps(two, _params())
  with pytest.raises(ValueError, match="ambiguous"):
    adam_predict(params, two_state, 2)


def test_plain_sgd_without_momentum_predicts_only_decay_and_grad():
  params, state = _run_steps(optax.sgd(LR), _params())
  predict = staleness.weight_predictor("sgd", learning_rate=LR)
  jax.tree.map(np.testing.assert_array_equal, predict(params, state, 4), params)
  grad = _grad_like(params)
  out = predict(params, state, 4, grad=grad)
  jax.tree.map(
    lambda o, p, g: np.testing.assert_allclose(o, p - LR * g, rtol=1e-6),
    out,
    params,
    grad,
  )


@pytest.mark.parametrize("optimizer", ["sgd", "adamw"])
@pytest.mark.parametrize("aggregated", [False, True])
def test_none_subtrees_stay_none_and_the_rest_is_predicted_alike(
  optimizer, aggregated
):
  """A pipeline stage predicts its view of the model: the leaves other
  stages hold are None. Those stay None; the others are predicted as in
  the whole tree."""
  tx = _build(optimizer, wd=5e-2)
  params, state = _run_steps(tx, _params())
  grad = _grad_like(params) if aggregated else None
  predict = staleness.weight_predictor(
    optimizer, learning_rate=LR, momentum=0.9, weight_decay=5e-2
  )
  whole = predict(params, state, 3, grad=grad)
  gone = next(iter(params))

  def without(tree):
    return {k: None if k == gone else v for k, v in tree.items()}

  view_state = jax.tree.map(
    lambda x: (
      without(x) if isinstance(x, dict) and set(x) == set(params) else x
    ),
    state,
    is_leaf=lambda x: isinstance(x, dict) and set(x) == set(params),
  )
  part = predict(
    without(params),
    view_state,
    3,
    grad=None if grad is None else without(grad),
  )
  assert part[gone] is None
  for k in params:
    if k != gone:
      np.testing.assert_array_equal(part[k], whole[k])
