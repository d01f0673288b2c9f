"""A stage's parameter (or gradient) leaves as one flat buffer per dtype.

Every array passed to or returned from a jitted call costs the host a few
microseconds: on the development CPU a call taking and returning 1 array
dispatched in 14 µs, 10 in 45 µs, 60 in 230 µs. A GPT stage has ~30
parameter leaves, and its backward takes the gradient accumulator and
returns the new one; the driver keeps that accumulator packed (one buffer
per dtype, unpacked once before the optimizer step), which cut the
dispatch of a 2-layer GPT stage's backward from 960-1,385 µs to
230-650 µs (experiments/RESULTS.md). Inside a program, the packing is a
concatenation XLA fuses into the gradient computation.

Params are NOT kept packed: XLA copies each weight sliced out of a flat
buffer before a matmul reads it, which made a forward 1.4-2.7x slower at
pipeline-sized microbatches (experiments/runtime/flat_params.py).
"""

from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np


class FlatLayout:
  """Where each leaf of a fixed tuple lives in per-dtype flat buffers.

  Built from example leaves or avals (their shapes and dtypes). ``pack`` and
  ``unpack`` are traceable; use them inside jitted programs. A tuple with
  a non-floating leaf is not packed (``pack``/``unpack`` are identities),
  since its gradient would be float0.
  """

  def __init__(self, leaves: Sequence[jax.Array]):
    self.shapes = tuple(tuple(x.shape) for x in leaves)
    dtypes = [jnp.dtype(x.dtype) for x in leaves]
    self.packed = all(jnp.issubdtype(d, jnp.inexact) for d in dtypes)
    self.dtypes: tuple = tuple(dict.fromkeys(dtypes))
    self.entries = []  # per leaf: (group, offset, size)
    sizes = [0] * len(self.dtypes)
    for shape, dtype in zip(self.shapes, dtypes, strict=True):
      group = self.dtypes.index(dtype)
      size = int(np.prod(shape, dtype=np.int64))
      self.entries.append((group, sizes[group], size))
      sizes[group] += size
    self.sizes = tuple(sizes)

  def pack(self, leaves) -> tuple:
    """Leaves -> one 1-D buffer per dtype (in ``self.dtypes`` order)."""
    if not self.packed:
      return tuple(leaves)
    groups = [[] for _ in self.dtypes]
    for (group, _, _), x in zip(self.entries, leaves, strict=True):
      groups[group].append(jnp.reshape(x, (-1,)))
    return tuple(jnp.concatenate(g) if len(g) > 1 else g[0] for g in groups)

  def unpack(self, flat) -> tuple:
    """The inverse of ``pack``."""
    if not self.packed:
      return tuple(flat)
    return tuple(
      jnp.reshape(flat[group][offset : offset + size], shape)
      for (group, offset, size), shape in zip(
        self.entries, self.shapes, strict=True
      )
    )
