"""A stage's params stored packed while the driver runs
(jpipe/runtime/build/stored_params.py): the round trip, what stays apart, the
conversions kept by identity, and tied leaves swapped in place."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jpipe.runtime.build.flat import PackedTree
from jpipe.runtime.build.stored_params import (
  StoredParams,
  leaves_of,
  param_leaf,
  stored_params_like,
  with_param_leaves,
)

# A stage's leaves: a big kernel, small f32 ones, a small bf16 one.
SHAPES = [
  ((64, 128), jnp.float32),
  ((128,), jnp.float32),
  ((3, 4), jnp.float32),
]
SHAPES += [((5,), jnp.bfloat16), ((2, 2), jnp.float32)]


def _leaves(seed=0):
  keys = jax.random.split(jax.random.key(seed), len(SHAPES))
  return tuple(
    jax.random.normal(k, shape).astype(dtype)
    for k, (shape, dtype) in zip(keys, SHAPES, strict=True)
  )


def _storage(apart=()):
  avals = [jax.ShapeDtypeStruct(s, d) for s, d in SHAPES]
  return StoredParams(avals, 1 << 14, apart)


def test_round_trip_is_exact_and_keeps_big_leaves_as_they_are():
  storage, leaves = _storage(), _leaves()
  packed = storage.stored(leaves)
  assert isinstance(packed, PackedTree)
  # The 32 KiB kernel apart, then one buffer per dtype of the small ones.
  assert len(packed.buffers) == 3
  assert packed.buffers[0] is leaves[0]  # Not copied.
  assert [b.dtype for b in packed.buffers[1:]] == [jnp.float32, jnp.bfloat16]
  assert packed.buffers[1].shape == (128 + 12 + 4,)
  storage.stored(_leaves(1))  # Another pair kept: unpacked for real.
  back = storage.leaves(packed)
  assert back is not leaves and back[0] is leaves[0]
  for x, y in zip(back, leaves, strict=True):
    assert x.shape == y.shape and x.dtype == y.dtype
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
  # What a version holds: its buffers' bytes, the leaves' in all.
  total = sum(x.size * x.dtype.itemsize for x in leaves)
  assert sum(storage.buffer_bytes) == total
  assert storage.buffer_bytes == tuple(b.nbytes for b in packed.buffers)


def test_conversions_are_kept_by_identity():
  storage, leaves = _storage(), _leaves()
  packed = storage.stored(leaves)
  assert storage.stored(leaves) is packed  # A call starting again.
  assert storage.leaves(packed) is leaves
  other = storage.stored(_leaves(1))
  new = storage.leaves(other, remember=True)  # A call's end.
  assert storage.stored(new) is other
  # Unpacking without remembering (a recorded version) keeps the pair.
  storage.leaves(packed)
  assert storage.stored(new) is other
  assert storage.stored(None) is None and storage.leaves(None) is None


def test_traced_unpack_and_repack():
  storage, leaves = _storage(), _leaves()
  packed = storage.stored(leaves)

  @jax.jit
  def double(params):
    return stored_params_like(params, [2 * x for x in leaves_of(params)])

  out = double(packed)
  assert isinstance(out, PackedTree) and len(out.buffers) == 3
  for x, y in zip(storage.leaves(out), leaves, strict=True):
    np.testing.assert_array_equal(np.asarray(x), np.asarray(2 * y))
  # Leaf tuples pass as they are.
  assert isinstance(double(leaves), tuple)


def test_tied_leaves_apart_and_swapped():
  storage, leaves = _storage(apart=(2,)), _leaves()
  packed = storage.stored(leaves)
  assert len(packed.buffers) == 4  # Kernel, tied leaf, f32, bf16.
  assert param_leaf(packed, 2) is leaves[2]
  value = jnp.full((3, 4), 7.0)
  swapped = with_param_leaves(packed, {2: value})
  assert param_leaf(swapped, 2) is value
  assert swapped.buffers[2:] == packed.buffers[2:]  # The rest shared.
  np.testing.assert_array_equal(storage.leaves(swapped)[2], value)
  # On leaf tuples the same.
  assert with_param_leaves(leaves, {2: value})[2] is value
  assert param_leaf(leaves, 2) is leaves[2]
  with pytest.raises(RuntimeError, match="packed, not kept apart"):
    param_leaf(packed, 1)


def test_every_leaf_apart_needs_no_program():
  avals = [jax.ShapeDtypeStruct(s, d) for s, d in SHAPES]
  storage, leaves = StoredParams(avals, 0), _leaves()
  packed = storage.stored(leaves)
  assert all(a is b for a, b in zip(packed.buffers, leaves, strict=True))
  assert storage.leaves(storage.stored(_leaves(2)))[0].shape == (64, 128)
