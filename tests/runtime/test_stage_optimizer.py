"""StageOptimizer's packed-gradient entry points equal its leaf ones, and
its update is optax's on the {path: leaf} dict."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from jpipe import staleness
from jpipe.runtime._flat import FlatLayout
from jpipe.runtime._stage_optimizer import StageOptimizer

NAMES = ("a/kernel", "a/bias", "b/kernel")


def _leaves(seed):
  keys = jax.random.split(jax.random.key(seed), 3)
  shapes = ((3, 4), (4,), (4, 2))
  return tuple(
    jax.random.normal(k, s) for k, s in zip(keys, shapes, strict=True)
  )


@pytest.mark.parametrize("gap_aware", [False, True])
def test_packed_update_and_prediction_equal_the_leaf_ones(gap_aware):
  tx = optax.adam(0.1)
  params, grads, stale = _leaves(0), _leaves(1), _leaves(2)
  layout = FlatLayout(params)
  opt = StageOptimizer(
    NAMES,
    tx,
    gap_aware={"optimizer": "adam", "learning_rate": 0.1}
    if gap_aware
    else None,
    predictor=staleness.replay_predictor(tx),
    horizon=3,
    grad_layout=layout,
  )
  state = opt.init(params)
  stale = stale if gap_aware else None
  flat = layout.pack(grads)
  by_leaves = opt.update(grads, state, params, stale)
  packed = opt.update_packed(layout.pack(grads), state, params, stale)
  for a, b in zip(
    jax.tree.leaves(by_leaves), jax.tree.leaves(packed), strict=True
  ):
    np.testing.assert_array_equal(a, b)
  new_params, state = by_leaves
  predicted = opt.predict(new_params, state, 2, grads)
  for a, b in zip(
    opt.predict_packed(new_params, state, 2, flat), predicted, strict=True
  ):
    np.testing.assert_array_equal(a, b)
  if not gap_aware:  # Against optax on the {path: leaf} dict.
    p = dict(zip(NAMES, params, strict=True))
    g = dict(zip(NAMES, grads, strict=True))
    updates, _ = tx.update(g, tx.init(p), p)
    expected = optax.apply_updates(p, updates)
    for name, leaf in zip(NAMES, new_params, strict=True):
      np.testing.assert_allclose(leaf, expected[name], rtol=1e-6)


def test_without_a_layout_there_are_no_packed_entry_points():
  opt = StageOptimizer(NAMES, optax.sgd(0.1))
  assert opt.predict_packed is None
  with pytest.raises(ValueError, match="grad_layout"):
    opt.update_packed((), (), _leaves(0))


@pytest.mark.parametrize("donate_state", [False, True])
def test_packed_update_consumes_the_big_gradients_and_asked_state(
  donate_state,
):
  """The gradient's own buffers (and, asked, the optimizer state) are
  donated to the step -- consumed -- and the step's values are the leaf
  update's; the small leaves' flat buffer and the params are kept."""
  tx = optax.adam(0.1)
  params, grads = _leaves(0), _leaves(1)
  layout = FlatLayout(params, own_buffer_bytes=32)  # (3, 4) and (4, 2)
  assert layout.num_own == 2
  opt = StageOptimizer(NAMES, tx, grad_layout=layout)
  state = opt.init(params)
  expected = opt.update(grads, state, params, None)
  state_copy = jax.tree.map(jnp.copy, state)
  flat = layout.pack(grads)
  got = opt.update_packed(flat, state_copy, params, donate_state=donate_state)
  for a, b in zip(jax.tree.leaves(expected), jax.tree.leaves(got), strict=True):
    np.testing.assert_array_equal(a, b)
  assert [x.is_deleted() for x in flat] == [True, True, False]
  assert not any(x.is_deleted() for x in params)
  consumed = [x.is_deleted() for x in jax.tree.leaves(state_copy)]
  assert all(consumed) if donate_state else not any(consumed)
