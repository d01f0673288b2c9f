"""A stage's params as the driver holds them during a call: a
``PackedTree`` (its small leaves in one flat buffer per dtype, the big
ones as they are), converted from and to the leaf tuple a
``PipelineState`` holds at the call's ends.

Every array a jitted program takes or returns costs the host microseconds
per call (on the development CPU ~1.5 µs an input, ~4-6 µs an output). A
GPT layer has 16 param leaves: every forward and backward took all of
them, and an asynchronous stage's backward, which steps in the same
program, returned all of them, every microbatch. Stored packed, a tiny
stage's params are 1-2 arrays. Inside a program unpacking is a slice
(packing a concatenation): leaves from ``own_buffer_bytes`` stay apart,
so no big weight is copied (XLA copies a weight sliced out of a flat
buffer before a matmul reads it: experiments/runtime/flat_params.py),
and so do tied leaves, which the driver swaps one by one.

The conversions run once a stage per call (a call runs every action of a
step): at its start, unless the leaves are the ones the previous call
returned (kept by identity with their packed form), and at its end. So
the packed form of the last returned params is kept besides them: the
stage's small leaves are held twice between calls.
"""

import math
from collections.abc import Sequence

import jax
import jax.numpy as jnp

from jpipe.runtime.build.flat import FlatLayout, PackedTree


def leaves_of(params) -> tuple:
  """A stage's param leaves from its params as a program receives them
  (stored packed or a leaf tuple; traceable)."""
  if isinstance(params, PackedTree):
    return params.unpack()
  return params


def stored_params_like(stored, leaves) -> object:
  """``leaves`` (a stage's param leaves) as ``stored`` is stored: in its
  layout where packed (traceable)."""
  if isinstance(stored, PackedTree):
    return stored.repack(tuple(leaves))
  return tuple(leaves)


def param_leaf(params, i: int):
  """Leaf ``i`` of a stage's params (stored packed: a leaf kept apart)."""
  if isinstance(params, PackedTree):
    return params.buffers[_own_index(params, i)]
  return params[i]


def with_param_leaves(params, leaves: dict):
  """A stage's params with leaves ``{position: value}`` replaced (stored
  packed: leaves kept apart), stored as ``params`` are."""
  if isinstance(params, PackedTree):
    buffers = list(params.buffers)
    for i, x in leaves.items():
      buffers[_own_index(params, i)] = x
    return PackedTree(buffers, params.treedef, params.layout)
  params = list(params)
  for i, x in leaves.items():
    params[i] = x
  return tuple(params)


def _own_index(packed, i: int) -> int:
  """The buffer of ``packed`` holding leaf i, one kept apart."""
  entry = packed.layout.entries[i]
  if entry[0] != "own":  # A driver bug, not a user error.
    raise RuntimeError(f"param leaf {i} is packed, not kept apart")
  return entry[1]


class StoredParams:
  """One stage's param leaves <-> the ``PackedTree`` the driver holds.

  Args:
    avals: the stage's param leaves' shapes and dtypes.
    own_buffer_bytes: a leaf of at least this many bytes keeps its own
      buffer (the stage's gradients' size).
    apart: positions that keep their own buffer whatever their size (tied
      leaves: the driver swaps them per microbatch).
    options: XLA options of the conversion programs (``jax.jit``'s).
  """

  def __init__(
    self,
    avals: Sequence,
    own_buffer_bytes: float,
    apart: Sequence[int] = (),
    options: dict | None = None,
  ):
    self.layout = FlatLayout(
      avals, own_buffer_bytes, storage=True, apart=tuple(apart)
    )
    self.treedef = jax.tree.structure(tuple(range(len(avals))))
    entries = self.layout.entries
    self.own = tuple(i for i, e in enumerate(entries) if e[0] == "own")
    self.small = tuple(i for i, e in enumerate(entries) if e[0] != "own")
    # Bytes of each buffer (own leaves, then the flat ones): what a
    # version holds (``HeldParams``).
    self.buffer_bytes = tuple(
      math.prod(avals[i].shape) * jnp.dtype(avals[i].dtype).itemsize
      for i in self.own
    ) + tuple(
      size * jnp.dtype(dtype).itemsize
      for size, dtype in zip(self.layout.sizes, self.layout.dtypes, strict=True)
    )
    # Own leaves never enter a program: a jitted program returns new
    # buffers even for an input it returns unchanged (a copy of every
    # big weight per call).
    options = options or None
    self._pack = jax.jit(self.layout.pack_small, compiler_options=options)
    self._unpack = jax.jit(self.layout.unpack_small, compiler_options=options)
    self._last = (None, None)  # (leaves, packed) of the last conversion

  def stored(self, leaves):
    """``leaves`` (a tuple; None: another process's stage) stored packed
    (and remembered with them); those ``leaves`` returned last: their
    packed form as it was."""
    if leaves is None or isinstance(leaves, PackedTree):
      return leaves
    last_leaves, last_packed = self._last
    if leaves is last_leaves:
      return last_packed
    leaves = tuple(leaves)
    small = (
      self._pack(tuple(leaves[i] for i in self.small)) if self.small else ()
    )
    packed = PackedTree(
      (*(leaves[i] for i in self.own), *small), self.treedef, self.layout
    )
    self._last = (leaves, packed)
    return packed

  def leaves(self, packed, remember: bool = False) -> tuple | None:
    """The leaf tuple of ``packed`` (None passes); ``remember``: kept with
    it (the params a call returns, which the next one most likely
    starts from)."""
    if packed is None or not isinstance(packed, PackedTree):
      return packed
    last_leaves, last_packed = self._last
    if packed is last_packed:
      return last_leaves
    n = len(self.own)
    small = self._unpack(packed.buffers[n:]) if self.small else ()
    leaves = self.layout.merged(packed.buffers[:n], small)
    if remember:
      self._last = (leaves, packed)
    return leaves
