"""Typed PRNG key arrays where only plain arrays go.

``jax.random.key`` arrays (optax's noise keys, NNX's RNG streams, a
dropout key a stage makes) have a key dtype that checkpoints, the
cross-process transfer server and broadcasts do not take. There they go as
their key data (uint32 ``[..., k]``) and come back as keys of the same
PRNG implementation. Raw ``uint32`` keys (``jax.random.PRNGKey``) are
plain arrays already.
"""

import functools

import jax
import numpy as np


def is_key(leaf) -> bool:
  """Whether ``leaf`` (an array or an abstract value) is a typed PRNG key
  array (``jax.random.key``)."""
  dtype = getattr(leaf, "dtype", None)
  return dtype is not None and jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key)


def key_data(leaf):
  """A typed key leaf as its key data (a jax array stays on its device;
  an abstract value gives the data's, its sharding kept); any other leaf
  as it is."""
  if not is_key(leaf):
    return leaf
  if isinstance(leaf, jax.ShapeDtypeStruct):
    data = jax.eval_shape(
      jax.random.key_data, jax.ShapeDtypeStruct(leaf.shape, leaf.dtype)
    )
    return jax.ShapeDtypeStruct(data.shape, data.dtype, sharding=leaf.sharding)
  return jax.random.key_data(leaf)


def host_key_data(leaf):
  """``key_data`` on the host (NumPy) for a concrete typed key."""
  data = key_data(leaf)
  if is_key(leaf) and not isinstance(data, jax.ShapeDtypeStruct):
    return np.asarray(data)
  return data


def wrap_key_data(data, template):
  """``key_data``'s inverse: ``data``'s numbers as keys of ``template``'s
  PRNG implementation (``template``: a key array or its abstract value);
  ``data`` as it is where ``template`` is no key."""
  if not is_key(template):
    return data
  return jax.random.wrap_key_data(data, impl=_impl(template.dtype))


@functools.cache
def _impl(dtype):
  """The PRNG implementation of a key dtype (once per dtype: transfers
  of keys ask per microbatch)."""
  impl = []  # (key_impl takes a key, a traced one too.)
  jax.eval_shape(
    lambda t: impl.append(jax.random.key_impl(t)),
    jax.ShapeDtypeStruct((), dtype),
  )
  return impl[0]


def keys_from_data(saved, template):
  """A saved leaf as ``template`` holds it: key data (uint32 ``[...,
  k]``, as a state dict holds keys) made keys of ``template``'s PRNG
  implementation where ``template`` (an array or abstract value) is a
  typed key; any other leaf, and a key, as it is."""
  if not is_key(template) or is_key(saved):
    return saved
  want = key_data(jax.ShapeDtypeStruct(template.shape, template.dtype)).shape
  if tuple(np.shape(saved)) != tuple(want):
    raise ValueError(
      f"a saved PRNG key's data has shape {tuple(np.shape(saved))}, the "
      f"model's key {tuple(template.shape)} needs {tuple(want)}: it was "
      "saved for another model"
    )
  return wrap_key_data(np.asarray(saved), template)
