"""The param versions one stage holds, counted as holders take and drop
them.

A stage holds params three ways while a call runs: its versions by step
(``InFlight.versions``: what later forwards may read), its live params,
and the params each in-flight forward used (the weight stash). Most are
the same tuple (every forward between two steps stashes the live
params), and versions share the arrays that did not change (a tied
replica's own leaves). What a schedule's memory needs is how many
distinct tuples and how many bytes of distinct arrays are held
(``CallResult.param_versions``, ``param_bytes``).

Counting them afresh at each forward went over every version and leaf:
~19 µs a forward at p = 8, m = 32 asynchronous, where every forward
follows a step. Counted as they come and go, a forward stashing the live
params costs one dict lookup and a step one pass over the leaves of the
version it adds and of the one it drops.
"""

from collections.abc import Iterable, Sequence


class HeldParams:
  """The distinct param tuples one stage holds and the bytes of their
  distinct arrays. A tuple (or array) counts once however many holders
  take it; it leaves when its last holder drops it. References are kept
  only while held, so nothing outlives its holders.

  Args:
    leaf_bytes: bytes of each of the stage's param leaves, in order (of
      each buffer, where versions are stored packed: ``StoredParams``).
    held: the tuples held at the start (one entry per holder; None is a
      tuple without arrays).
  """

  def __init__(self, leaf_bytes: Sequence[int], held: Iterable = ()):
    self.leaf_bytes = tuple(leaf_bytes)
    self._tuples = {}  # id -> [tuple, holders]
    # id -> tuples holding the array: one is held (and keeps it alive),
    # so its id stays its own while counted.
    self._arrays = {}
    self.nbytes = 0
    for params in held:
      self.take(params)

  @property
  def count(self) -> int:
    """Distinct tuples held."""
    return len(self._tuples)

  def take(self, params) -> None:
    """One more holder of ``params``."""
    entry = self._tuples.get(id(params))
    if entry is not None:
      entry[1] += 1
      return
    self._tuples[id(params)] = [params, 1]
    arrays, added = self._arrays, 0
    for x, n in _zip_bytes(params, self.leaf_bytes):
      key = id(x)
      holders = arrays.get(key, 0)
      arrays[key] = holders + 1
      if not holders:
        added += n
    self.nbytes += added

  def drop(self, params) -> None:
    """One holder of ``params`` let go of it (it must hold it)."""
    entry = self._tuples[id(params)]
    entry[1] -= 1
    if entry[1]:
      return
    del self._tuples[id(params)]
    arrays, dropped = self._arrays, 0
    for x, n in _zip_bytes(params, self.leaf_bytes):
      key = id(x)
      holders = arrays[key] - 1
      if holders:
        arrays[key] = holders
      else:
        del arrays[key]
        dropped += n
    self.nbytes -= dropped

  def replace(self, old, new) -> None:
    """A holder of ``old`` holds ``new`` instead."""
    if new is not old:
      self.take(new)
      self.drop(old)


def _zip_bytes(params, leaf_bytes):
  """(array, its bytes) of a held version: a leaf tuple, a stored
  ``PackedTree``'s buffers (``leaf_bytes`` are then the buffers'), or
  None (no arrays)."""
  arrays = getattr(params, "buffers", params) or ()
  return zip(arrays, leaf_bytes, strict=bool(arrays))
