"""The "collective" transport's sends: a ``ppermute`` inside
``shard_map`` over a two-device mesh of the sender's and the receiver's
device (gloo on CPU, NCCL on GPU), both processes calling the same
program (``jpipe.runtime.build.transport``)."""

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jpipe.runtime.build.user_mesh import own_mesh


class CollectivePairs:
  """Pair programs (one per device pair, shape and dtype) and the
  receivers' unused input shards, made once and kept."""

  def __init__(self):
    self._pairs: dict[tuple, Any] = {}
    self._blanks: dict[tuple, jax.Array] = {}

  def send(self, x, a, b, aval):
    """Sends ``x`` (on device a; None on the receiver) to device b of
    another process; returns the value (shape and dtype ``aval``) on the
    receiver, None on the sender."""
    shape, dtype = tuple(aval.shape), np.dtype(aval.dtype)
    key = (a, b, shape, dtype)
    if key not in self._pairs:
      self._pairs[key] = _pair_program(a, b)
    program, sharding = self._pairs[key]
    if x is not None:  # (A replica group's value: gathered onto a.)
      shard = jnp.reshape(jax.device_put(x, a), _shard_shape(shape))
    else:
      shard = self._blank(b, shape, dtype)
    out = program(
      jax.make_array_from_single_device_arrays(
        _global_shape(shape), sharding, [shard]
      )
    )
    if x is not None:
      return None
    return out.addressable_shards[0].data.reshape(shape)

  def _blank(self, device, shape, dtype):
    """The receiver's (unused) input shard, allocated once per shape."""
    key = (device, shape, dtype)
    if key not in self._blanks:
      self._blanks[key] = jax.device_put(
        jnp.zeros(_shard_shape(shape), dtype), device
      )
    return self._blanks[key]


def _shard_shape(shape):
  """A value's shard in the pair array: axis 0 stacks sender, receiver."""
  return shape if shape else (1,)


def _global_shape(shape):
  s = _shard_shape(shape)
  return (2 * s[0], *s[1:])


def _pair_program(a, b):
  """A jitted send from device a to device b: (program, input sharding)."""
  mesh = own_mesh(Mesh(np.array([a, b]), ("pair",)))
  spec = PartitionSpec("pair")

  def send(x):
    return jax.lax.ppermute(x, "pair", [(0, 1)])

  program = jax.jit(
    jax.shard_map(send, mesh=mesh, in_specs=spec, out_specs=spec)
  )
  return program, NamedSharding(mesh, spec)
