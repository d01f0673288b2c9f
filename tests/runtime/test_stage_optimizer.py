"""StageOptimizer's packed-gradient entry points equal its leaf ones, and
its update is optax's on the {path: leaf} dict."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from jpipe import staleness
from jpipe.runtime.build.flat import FlatLayout, PackedTree
from jpipe.runtime.build.stage_optimizer import StageOptimizer
from tests import quick_compiles

NAMES = ("a/kernel", "a/bias", "b/kernel")
# XLA's floating-point contraction between a packed buffer and separate
# leaves: up to 4 ulp with its MLIR fusion emitters (its default), up to 8
# with the elemental ones the suite compiles with (tests/quick_compiles.py).
CONTRACTION_ULP = 8 if quick_compiles.elemental_emitters() else 4


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


def _optimizers():
  return {
    "adam": optax.adam(0.1),
    "sgd_momentum": optax.sgd(0.1, momentum=0.9, nesterov=True),
    "adamw_clipped": optax.chain(
      optax.clip(0.5), optax.adamw(0.05, weight_decay=0.1)
    ),
    "lamb": optax.lamb(0.01),
    # A weakly typed leaf in the state (the injected rate) stays apart.
    "injected": optax.inject_hyperparams(optax.adam)(learning_rate=0.1),
  }


@pytest.mark.parametrize("name", sorted(_optimizers()))
@pytest.mark.parametrize("gap_aware", [False, True])
def test_packed_state_steps_as_the_optax_tree(name, gap_aware):
  """The state stored packed steps as stored as optax's tree over several
  steps -- to the bit where no leaves share a buffer (size 0), within
  XLA's floating-point contraction (a few ulp) where they do (every leaf
  packed; the (3, 4) f32 kernels apart) -- and reads back as that tree,
  on the device and from a host copy alike."""
  tx = _optimizers()[name]
  kind = "sgd" if name.startswith("sgd") else "adam"
  ga = {"optimizer": kind, "learning_rate": 0.1} if gap_aware else None

  def run(state_own_bytes):
    opt = StageOptimizer(
      NAMES, tx, gap_aware=ga, state_own_bytes=state_own_bytes
    )
    params, state = _leaves(0), opt.init(_leaves(0))
    for i in range(4):
      stale = _leaves(10 + i) if gap_aware else None
      params, state = opt.update(_leaves(1 + i), state, params, stale)
    return opt, params, state

  _, want_params, want_state = run(None)
  for own in (0.0, float("inf"), 40.0):
    opt, params, state = run(own)
    assert isinstance(state, PackedTree)
    if own:
      assert len(jax.tree.leaves(state)) < len(jax.tree.leaves(want_state))
    tree = opt.state_tree(state)
    assert jax.tree.structure(tree) == jax.tree.structure(want_state)
    host = opt.state_tree(jax.device_get(state))
    got = (*params, *jax.tree.leaves(tree))
    want = (*want_params, *jax.tree.leaves(want_state))
    for a, b, c in zip(
      got, (*params, *jax.tree.leaves(host)), want, strict=True
    ):
      assert a.dtype == c.dtype
      np.testing.assert_array_equal(a, b)  # The host reads the same.
      if own == 0 or not jnp.issubdtype(c.dtype, jnp.floating):
        np.testing.assert_array_equal(a, c)
      else:
        np.testing.assert_array_max_ulp(
          np.asarray(a), np.asarray(c), CONTRACTION_ULP
        )


def test_packed_state_keeps_weak_types_and_layout_equality():
  """A weakly typed leaf is stored apart (unpacked from a flat buffer it
  would promote as a strong type); layouts of the same leaves compare
  equal, so a step's output state hits the same compiled program."""
  tree = {
    "m": jnp.ones((3,)),
    "n": jnp.zeros((2, 2), jnp.bfloat16),
    "count": jnp.zeros((), jnp.int32),
    "rate": jnp.asarray(0.1),  # Weakly typed.
  }
  packed = PackedTree.pack(tree, float("inf"))
  # The weak leaf apart; a 32-bit buffer (f32 and int32 bitcast to
  # uint32), a bf16 one.
  assert len(packed.buffers) == 3
  assert [b.dtype for b in packed.buffers[1:]] == [jnp.uint32, jnp.bfloat16]
  back = packed.unpack()
  assert back["rate"].weak_type and not back["m"].weak_type
  assert back["n"].dtype == jnp.bfloat16 and back["count"].dtype == jnp.int32
  again = PackedTree.pack(jax.tree.map(jnp.copy, tree), float("inf"))
  assert again.layout == packed.layout
  assert hash(again.layout) == hash(packed.layout)
  assert jax.tree.structure(again) == jax.tree.structure(packed)
  double = jax.jit(
    lambda p: p.repack(jax.tree.map(lambda x: x * 2, p.unpack()))
  )
  out = double(packed)
  assert double._cache_size() == 1
  double(out)
  assert double._cache_size() == 1  # The same program for its own output.
  for k, x in out.unpack().items():
    np.testing.assert_array_equal(x, tree[k] * 2)


def test_leaves_of_one_width_share_a_buffer_bit_for_bit():
  """Stored leaves of one width and different dtypes share a buffer
  (bitcast to an unsigned integer); every bit comes back, in a program
  and on the host, even those a float op would change (NaN payloads,
  denormals, an int whose bits are a float NaN)."""
  bits = np.array([0x7FC00001, 0x00000001, 0xFFFFFFFF, 0x80000000], np.uint32)
  tree = {
    "f": bits.view(np.float32),  # A NaN with a payload, a denormal...
    "i": np.array([-1, 2**31 - 1, 7], np.int32),
    "u": np.array([3], np.uint32),
    "h": np.array([1.5, -0.0], jnp.bfloat16),
    "s": np.array([-2], np.int16),
    "b": np.array([True, False]),
  }
  tree = jax.tree.map(jnp.asarray, tree)
  packed = PackedTree.pack(tree, float("inf"))
  # Bool, 32-bit (f32, int32, uint32) and 16-bit (bf16, int16) buffers,
  # in the order of the sorted keys' first leaves.
  assert [(b.dtype, b.shape) for b in packed.buffers] == [
    (jnp.bool_, (2,)),
    (jnp.uint32, (8,)),
    (jnp.uint16, (3,)),
  ]
  roundtrip = jax.jit(lambda p: p.repack(p.unpack()))(packed)
  for back in (
    packed.unpack(),
    roundtrip.unpack(),
    jax.device_get(roundtrip).unpack(),  # Sliced and viewed on the host.
  ):
    for k, x in tree.items():
      y = back[k]
      assert y.dtype == x.dtype and y.shape == x.shape, k
      width = {1: np.uint8, 2: np.uint16, 4: np.uint32}[x.dtype.itemsize]
      np.testing.assert_array_equal(
        np.asarray(y).view(width), np.asarray(x).view(width), err_msg=k
      )
