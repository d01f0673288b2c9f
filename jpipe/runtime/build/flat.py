"""A stage's gradient leaves, and its stored optimizer state
(``PackedTree``), as few buffers: the small ones packed into one flat
buffer per dtype (a stored state's: per width), the big ones as they are.

Every array passed to or returned from a jitted call costs the host a few
microseconds: on the development CPU a call taking and returning 1 array
dispatched in 14 µs, 10 in 45 µs, 60 in 230 µs. A GPT stage has ~30
parameter leaves, and its backward takes the gradient accumulator and
returns the new one; the driver keeps that accumulator packed (one buffer
per dtype, unpacked once before the optimizer step), which cut the
dispatch of a 2-layer GPT stage's backward from 960-1,385 µs to
230-650 µs (experiments/RESULTS.md). Inside a program the packing is a
concatenation: a copy, which for a big leaf costs more than its dispatch
(``OWN_BUFFER_BYTES``), so big leaves are not packed. An asynchronous
stage's step returns its whole optimizer state every microbatch: stored
packed, an Adam state is ~1 array where it was twice the leaves and a
count (experiments/runtime/packed_state.py).

A stage's params are stored packed the same way while the driver runs
(``build/stored_params.py``), with the same size from which a leaf keeps its
own buffer: XLA copies each weight sliced out of a flat buffer before a
matmul reads it, which made a forward 1.4-2.7x slower at pipeline-sized
microbatches when every weight was packed
(experiments/runtime/flat_params.py).
"""

from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jpipe.partition import default_residual_own_bytes
from jpipe.runtime.build.grad_dtype import cast_floating

# Leaves of at least this many bytes keep their own buffer (FlatLayout),
# and so do a saving forward's residuals (``own_buffer_bytes``). Packing
# a leaf copies it (a concatenation inside the program; where a packed
# residual feeds a matmul, its slice is copied again), which on a CPU
# costs as much as the few microseconds of dispatch a buffer fewer saves
# from a few KiB. With 1 MiB (before), a GPT 8 x 128 on one device
# (its 32-256 KiB kernels and activations all packed), gpipe over 8
# microbatches of 2 x 64 tokens, ran 1.147x one jitted step at 2 stages
# and 1.231x at 4; with 16 KiB 1.073x and 1.149x, no worse than with
# nothing packed (experiments/runtime/pack_threshold.py, paired rounds).
# A tiny model's leaves (a dispatch-bound stage of a few KiB) all stay
# packed. On an accelerator the copy runs at memory bandwidth (~1 us per
# MiB on an H100) and the host's dispatch paces small programs: gradient
# leaves from 4 MiB stay apart there (measured:
# experiments/runtime/flat_grads.py on an H100), residuals from 1 MiB
# (not measured on a GPU; jpipe.partition's RESIDUAL_OWN_BYTES).
OWN_BUFFER_BYTES = {"cpu": 1 << 14}
ACCELERATOR_OWN_BUFFER_BYTES = 1 << 22


def own_buffer_bytes(platform: str, residuals: bool = False) -> int:
  """The size from which a gradient leaf (a saving forward's residual,
  with ``residuals``) keeps its own buffer on ``platform`` (``"cpu"``,
  ``"gpu"``, ``"tpu"``...)."""
  if residuals:
    return default_residual_own_bytes(platform)
  return OWN_BUFFER_BYTES.get(platform, ACCELERATOR_OWN_BUFFER_BYTES)


class FlatLayout:
  """Where each leaf of a fixed tuple lives: its own buffer (a big leaf)
  or a slice of one flat buffer per dtype (the small ones).

  Built from example leaves or avals (their shapes and dtypes). ``pack``
  and ``unpack`` are traceable; use them inside jitted programs (``unpack``
  also slices host arrays). A gradient layout (the default) with a
  non-floating leaf is not packed (``pack``/``unpack`` are identities),
  since its gradient would be float0; a ``storage`` layout (a stored
  state's: ``PackedTree``) packs numbers of any dtype, those of one width
  in one buffer (bitcast to an unsigned integer of that width where
  dtypes mix: an Adam state's f32 moments and int32 count), and keeps
  apart only what a flat buffer would change: a weakly typed leaf
  (unpacked it would be strongly typed, and promote differently) and
  non-numeric ones (PRNG keys). Layouts of the same leaves compare equal
  (a jitted program's cache key).

  Args:
    leaves: the tuple's leaves (arrays or avals).
    own_buffer_bytes: a leaf of at least this many bytes stays its own
      buffer (default: the CPU's, ``own_buffer_bytes("cpu")``; ``math.inf``
      packs every leaf). Copying a big gradient into a flat buffer is a
      pass over memory that saves only a few microseconds of dispatch: on
      the development CPU (one core) packing a 4-layer stage's 16 MiB of
      kernel gradients made its backward 55 -> 73 ms (the pipeline's, in
      experiments/distributed/throughput.py's model).
    storage: a stored state's layout (see above), not a gradient's.
    apart: positions of leaves that keep their own buffer whatever their
      size (a stage's tied params, which the driver replaces one by one).
  """

  def __init__(
    self,
    leaves: Sequence[jax.Array],
    own_buffer_bytes: float = OWN_BUFFER_BYTES["cpu"],
    *,
    storage: bool = False,
    apart: Sequence[int] = (),
  ):
    self.shapes = tuple(tuple(np.shape(x)) for x in leaves)
    dtypes = [_dtype(x.dtype) for x in leaves]
    sizes_of = [int(np.prod(s, dtype=np.int64)) for s in self.shapes]
    big = [
      size * d.itemsize >= own_buffer_bytes or i in apart
      for i, (size, d) in enumerate(zip(sizes_of, dtypes, strict=True))
    ]
    self.storage = storage
    if storage:
      self.packed = True
      big = [
        b or getattr(x, "weak_type", False) or not _numeric(d)
        for b, x, d in zip(big, leaves, dtypes, strict=True)
      ]
    else:
      self.packed = all(jnp.issubdtype(d, jnp.inexact) for d in dtypes)
    self.num_own = sum(big)
    self.leaf_dtypes = tuple(dtypes)
    # A stored state's small leaves of one width share a buffer whatever
    # their dtype (an Adam state's f32 moments and int32 count: one buffer
    # in and out of every step, not two); a gradient's, one per dtype.
    group_of = _width if storage else (lambda d: ("dtype", d.name))
    group_keys = [group_of(d) for d in dtypes]
    members = {}  # group -> its leaves' dtypes, groups in first-leaf order
    for key, d, b in zip(group_keys, dtypes, big, strict=True):
      if not b:
        members.setdefault(key, set()).add(d)
    index = {key: i for i, key in enumerate(members)}
    # The buffer's dtype: its leaves' one, else an unsigned integer of
    # their width they are bitcast to (no float semantics on the bits:
    # an integer's bits are no float's denormal to flush).
    self.dtypes: tuple = tuple(
      next(iter(m)) if len(m) == 1 else jnp.dtype(f"uint{8 * k[1]}")
      for k, m in members.items()
    )
    # Per leaf: ("own", buffer index) or (group, offset, size) in group
    # buffer num_own + group.
    self.entries = []
    sizes = [0] * len(self.dtypes)
    own = 0
    for size, key, is_big in zip(sizes_of, group_keys, big, strict=True):
      if is_big:
        self.entries.append(("own", own))
        own += 1
        continue
      group = index[key]
      self.entries.append((group, sizes[group], size))
      sizes[group] += size
    self.sizes = tuple(sizes)
    self.entries = tuple(self.entries)

  def _key(self) -> tuple:
    return (
      self.packed,
      self.storage,
      self.shapes,
      self.leaf_dtypes,
      self.dtypes,
      self.entries,
    )

  def __eq__(self, other) -> bool:
    return isinstance(other, FlatLayout) and self._key() == other._key()

  def __hash__(self) -> int:
    return hash(self._key())

  def pack(self, leaves) -> tuple:
    """Leaves -> the big leaves as they are, then one 1-D buffer per dtype
    of the small ones (in ``self.dtypes`` order). A gradient layout built
    from wider dtypes than its leaves' (``grad_accum_dtype``) casts each
    floating leaf to its own first."""
    if not self.storage:
      leaves = [
        cast_floating(x, d)
        for x, d in zip(leaves, self.leaf_dtypes, strict=True)
      ]
    if not self.packed:
      return tuple(leaves)
    own = [x for e, x in zip(self.entries, leaves, strict=True) if _own(e)]
    small = [
      x for e, x in zip(self.entries, leaves, strict=True) if not _own(e)
    ]
    return (*own, *self.pack_small(small))

  def unpack(self, flat) -> tuple:
    """The inverse of ``pack``."""
    if not self.packed:
      return tuple(flat)
    flat = tuple(flat)
    own, packed = flat[: self.num_own], flat[self.num_own :]
    return self.merged(own, self.unpack_small(packed))

  def pack_small(self, small) -> tuple:
    """The small leaves alone (in the leaves' order) -> their flat
    buffers (``pack``'s last ones)."""
    groups = [[] for _ in self.dtypes]
    entries = [e for e in self.entries if not _own(e)]
    for (group, _, _), x in zip(entries, small, strict=True):
      groups[group].append(_bitcast(jnp.reshape(x, (-1,)), self.dtypes[group]))
    return tuple(jnp.concatenate(g) if len(g) > 1 else g[0] for g in groups)

  def unpack_small(self, packed) -> tuple:
    """The flat buffers alone -> the small leaves, in the leaves' order."""
    return tuple(
      # (Methods, not jnp's functions: host arrays stay on the host.)
      _bitcast(packed[entry[0]][entry[1] : entry[1] + entry[2]], dtype).reshape(
        shape
      )
      for entry, shape, dtype in zip(
        self.entries, self.shapes, self.leaf_dtypes, strict=True
      )
      if not _own(entry)
    )

  def merged(self, own, small) -> tuple:
    """Every leaf, in order, from the big ones and the small ones."""
    own, small = iter(own), iter(small)
    return tuple(next(own) if _own(e) else next(small) for e in self.entries)


def _own(entry) -> bool:
  """Whether a layout entry is a leaf with its own buffer."""
  return entry[0] == "own"


def _dtype(dtype):
  """``jnp.dtype(dtype)``, or an extended dtype (a typed PRNG key's,
  ``key<fry>``: optax.add_noise's state) as it is: NumPy has no name for
  it."""
  if jax.dtypes.issubdtype(dtype, jax.dtypes.extended):
    return dtype
  return jnp.dtype(dtype)


def _width(dtype):
  """A stored leaf's buffer group: real numbers by their width (bitcast
  to one another losslessly), anything else (booleans, complex numbers,
  PRNG keys) by its dtype."""
  dtype = _dtype(dtype)
  if jnp.issubdtype(dtype, jnp.integer):
    bits = jnp.iinfo(dtype).bits
  elif jnp.issubdtype(dtype, jnp.floating):
    bits = jnp.finfo(dtype).bits
  else:
    return ("dtype", dtype.name)
  # (Sub-byte types, int4's, fill a byte each but bitcast by their bits.)
  if bits != 8 * dtype.itemsize:
    return ("dtype", dtype.name)
  return ("width", dtype.itemsize)


def _bitcast(x, dtype):
  """``x``'s bits as ``dtype`` (same width): a view on the host, a
  bitcast in a program."""
  if x.dtype == dtype:
    return x
  if isinstance(x, np.ndarray):
    return x.view(dtype)
  return jax.lax.bitcast_convert_type(x, dtype)


def _numeric(dtype) -> bool:
  """Whether a flat buffer holds leaves of ``dtype`` unchanged (numbers
  and booleans; not PRNG keys or other extended dtypes)."""
  return jnp.issubdtype(dtype, jnp.number) or jnp.issubdtype(dtype, jnp.bool_)


@jax.tree_util.register_pytree_node_class
class PackedTree:
  """A pytree stored as few arrays: its small leaves in one flat buffer
  per width, the big ones as they are (a storage ``FlatLayout``).

  Its pytree children are those buffers, so a jitted program taking or
  returning it handles a few arrays instead of every leaf (a stage's
  Adam state: its 2 x leaves moments and a count -> ~1 array), each of
  which costs the host microseconds per call. ``unpack`` is the tree
  (traceable: a program unpacks at its start and ``pack``s what it
  returns, the same per-leaf math; on host arrays it slices on the
  host). Built by ``pack``; ``jax.tree.map`` over it maps the buffers
  (bits, not numbers, where dtypes share one: an unsigned integer's).

  Attributes:
    buffers: the stored arrays (``layout.pack``'s order).
    treedef: the tree's structure.
    layout: where each leaf lives in ``buffers``.
  """

  __slots__ = ("buffers", "treedef", "layout")

  def __init__(self, buffers, treedef, layout: FlatLayout):
    self.buffers = tuple(buffers)
    self.treedef = treedef
    self.layout = layout

  @classmethod
  def pack(cls, tree, own_buffer_bytes: float) -> "PackedTree":
    """``tree`` stored: leaves of at least ``own_buffer_bytes`` apart
    (traceable)."""
    leaves, treedef = jax.tree.flatten(tree)
    layout = FlatLayout(leaves, own_buffer_bytes, storage=True)
    return cls(layout.pack(leaves), treedef, layout)

  def repack(self, tree) -> "PackedTree":
    """``tree`` (structured and shaped as this one's) stored in this
    one's layout (traceable)."""
    leaves = self.treedef.flatten_up_to(tree)
    return PackedTree(self.layout.pack(leaves), self.treedef, self.layout)

  def unpack(self):
    """The stored tree."""
    return jax.tree.unflatten(self.treedef, self.layout.unpack(self.buffers))

  def tree_flatten(self):
    return self.buffers, (self.treedef, self.layout)

  @classmethod
  def tree_unflatten(cls, aux, buffers):
    return cls(buffers, *aux)

  def __repr__(self) -> str:
    return (
      f"PackedTree({self.treedef.num_leaves} leaves in "
      f"{len(self.buffers)} buffers)"
    )
