"""FlatLayout: leaves <-> one flat buffer per dtype, against NumPy."""

import jax
import jax.numpy as jnp
import numpy as np

from jpipe.runtime._flat import FlatLayout


def _leaves():
  rng = np.random.default_rng(0)
  return (
    rng.normal(size=(3, 4)).astype(np.float32),
    rng.normal(size=()).astype(np.float32),
    rng.normal(size=(5,)).astype(jnp.bfloat16),
    rng.normal(size=(2, 1, 2)).astype(np.float32),
  )


def test_pack_is_numpy_concatenation_per_dtype_and_unpack_inverts_it():
  leaves = _leaves()
  layout = FlatLayout(leaves)
  flat = jax.jit(layout.pack)(leaves)
  assert len(flat) == 2  # float32, bfloat16
  expected_f32 = np.concatenate(
    [leaves[0].ravel(), leaves[1].ravel(), leaves[3].ravel()]
  )
  np.testing.assert_array_equal(flat[0], expected_f32)
  np.testing.assert_array_equal(
    np.asarray(flat[1], np.float32), leaves[2].astype(np.float32)
  )
  back = jax.jit(layout.unpack)(flat)
  for a, b in zip(back, leaves, strict=True):
    assert a.shape == b.shape and a.dtype == b.dtype
    np.testing.assert_array_equal(np.asarray(a), b)


def test_layout_from_avals_matches_layout_from_arrays():
  leaves = _leaves()
  avals = [jax.core.ShapedArray(x.shape, x.dtype) for x in leaves]
  a, b = FlatLayout(leaves), FlatLayout(avals)
  assert (a.entries, a.sizes, a.dtypes) == (b.entries, b.sizes, b.dtypes)


def test_empty_and_integer_tuples_pass_through():
  assert FlatLayout(()).pack(()) == ()
  ints = (np.arange(3), np.ones(2, np.float32))
  layout = FlatLayout(ints)
  assert not layout.packed
  assert layout.unpack(layout.pack(ints)) == ints
