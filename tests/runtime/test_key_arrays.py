"""Typed PRNG keys as plain arrays and back (``build/key_arrays.py``):
what checkpoints, cross-process transfers and broadcasts carry."""

import jax
import numpy as np
import pytest
from jax.sharding import SingleDeviceSharding

from jpipe.runtime.build.key_arrays import (
  host_key_data,
  is_key,
  key_data,
  wrap_key_data,
)


@pytest.mark.parametrize("impl", ["threefry2x32", "rbg"])
def test_key_data_round_trips_each_implementation(impl):
  keys = jax.random.split(jax.random.key(7, impl=impl), 3)
  data = host_key_data(keys)
  assert isinstance(data, np.ndarray) and data.dtype == np.uint32
  np.testing.assert_array_equal(data, jax.random.key_data(keys))
  back = wrap_key_data(data, jax.ShapeDtypeStruct(keys.shape, keys.dtype))
  assert back.dtype == keys.dtype  # The same implementation.
  np.testing.assert_array_equal(jax.random.key_data(back), data)
  # The same draws as the original keys.
  np.testing.assert_array_equal(
    jax.random.uniform(back[1], (4,)), jax.random.uniform(keys[1], (4,))
  )


def test_abstract_keys_give_their_datas_spec_with_the_sharding():
  device = jax.devices()[0]
  spec = jax.ShapeDtypeStruct(
    (5,),
    jax.random.key(0).dtype,
    sharding=SingleDeviceSharding(device),
  )
  data = key_data(spec)
  assert data.shape == (5, 2) and data.dtype == np.uint32
  assert data.sharding == spec.sharding


def test_other_leaves_pass_unchanged():
  x = np.arange(3, dtype=np.uint32)  # A raw PRNGKey is a plain array.
  assert not is_key(x) and not is_key(None)
  assert key_data(x) is x and host_key_data(x) is x
  assert wrap_key_data(x, x) is x
