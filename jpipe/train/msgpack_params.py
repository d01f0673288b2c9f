"""A Flax msgpack params file (``flax.serialization.to_bytes``), read
without trusting it.

Flax writes a msgpack map whose arrays are extension records (type 1,
type 3 for a NumPy scalar) holding ``(shape, dtype name, row-major
bytes)``; arrays over 1 GiB are split into such records under a
``{"__msgpack_chunked_array__": True, "shape": ..., "chunks": ...}``
map. ``flax.serialization.msgpack_restore`` trusts all of it: a damaged
record fails in a reshape naming no array, and a file that is a number
or a list loads as "params" the model then has none of. Here each
damage is a one-line ``PretrainedError`` naming the file, the array
where there is one, and the fix: an empty or truncated file, bytes past
its end, a top level that is not a map, a record whose byte count is not
its shape times its dtype's size, an unknown dtype or record type.
"""

import math
from typing import Any

import jax.numpy as jnp
import msgpack
import numpy as np

from jpipe.train.errors import PretrainedError

_NDARRAY, _COMPLEX, _SCALAR = 1, 2, 3  # flax.serialization's record types.
_CHUNKED = "__msgpack_chunked_array__"


def read(path: str) -> Any:
  """The params pytree of the msgpack file at ``path`` (NumPy arrays)."""
  with open(path, "rb") as f:
    data = f.read()
  fix = "re-download or re-save it (flax.serialization.to_bytes(params))"
  if not data:
    raise PretrainedError(f"{path} is empty (0 bytes); {fix}")
  try:
    tree = msgpack.unpackb(data, raw=False, strict_map_key=False)
  except msgpack.ExtraData as e:
    raise PretrainedError(
      f"{path} is not a Flax msgpack file: {len(e.extra)} of its "
      f"{len(data)} bytes follow the first msgpack value; {fix}, or give "
      "an orbax checkpoint directory or hf:PATH for safetensors"
    ) from None
  except (ValueError, msgpack.UnpackException) as e:
    if "incomplete input" in str(e):  # What msgpack says of a cut.
      why = f"is cut short: it ends inside a value at {len(data)} bytes"
    else:
      why = f"is not a Flax msgpack file ({e})"
    raise PretrainedError(f"{path} {why}; {fix}") from None
  if not isinstance(tree, dict):
    raise PretrainedError(
      f"{path} holds a msgpack {type(tree).__name__}, not a map of params "
      f"as flax.serialization.to_bytes(params) writes; {fix}"
    )
  return _decoded(tree, "", lambda name, why: _damaged(path, name, why, fix))


def _damaged(path: str, name: str, why: str, fix: str):
  raise PretrainedError(f"{path} is damaged at {name!r}: {why}; {fix}")


def _decoded(node, name: str, fail) -> Any:
  """``node`` with its array records (and chunked arrays) as arrays;
  ``name`` is its path ("a/b/c"); ``fail(name, why)`` raises."""
  if isinstance(node, dict):
    if node.get(_CHUNKED) is True:
      return _unchunked(node, name, fail)
    return {
      k: _decoded(v, f"{name}/{k}" if name else str(k), fail)
      for k, v in node.items()
    }
  if isinstance(node, list):
    return [_decoded(v, f"{name}/{i}", fail) for i, v in enumerate(node)]
  if not isinstance(node, msgpack.ExtType):
    return node
  if node.code == _COMPLEX:
    try:
      real, imag = msgpack.unpackb(node.data)
      return complex(real, imag)
    except (ValueError, TypeError, msgpack.UnpackException):
      fail(name, "its complex number is not a (real, imag) pair")
  if node.code not in (_NDARRAY, _SCALAR):
    fail(name, f"msgpack extension type {node.code} is not one Flax writes")
  array = _array(node.data, name, fail)
  return array[()] if node.code == _SCALAR else array


def _array(record: bytes, name: str, fail) -> np.ndarray:
  """The array of a ``(shape, dtype name, bytes)`` record, its byte count
  checked against its shape and dtype."""
  try:
    shape, dtype_name, buffer = msgpack.unpackb(record, raw=True)
  except (ValueError, TypeError, msgpack.UnpackException):
    fail(name, "its array record is not (shape, dtype, bytes)")
  if not (
    isinstance(shape, list)
    and all(isinstance(d, int) and d >= 0 for d in shape)
    and isinstance(dtype_name, bytes)
    and isinstance(buffer, bytes)
  ):
    fail(name, "its array record is not (shape, dtype, bytes)")
  try:
    dtype = jnp.dtype(dtype_name.decode("ascii", "replace"))
  except (TypeError, ValueError):
    dtype = None
  if dtype is None or dtype.hasobject:
    fail(
      name, f"its dtype {dtype_name.decode('ascii', 'replace')!r} is unknown"
    )
  want = math.prod(shape) * dtype.itemsize
  if len(buffer) != want:
    fail(
      name,
      f"shape {tuple(shape)} {dtype.name} needs {want} bytes, its record "
      f"holds {len(buffer)}",
    )
  return np.frombuffer(buffer, dtype).reshape(shape)


def _unchunked(node: dict, name: str, fail) -> np.ndarray:
  """An array Flax split into chunks (its ``shape`` and ``chunks`` maps
  keyed "0", "1", ...), its element count checked."""
  shape, chunks = node.get("shape"), node.get("chunks")
  if not (isinstance(shape, dict) and isinstance(chunks, dict) and chunks):
    fail(name, "its chunked array has no shape or no chunks")
  try:
    shape = tuple(shape[str(i)] for i in range(len(shape)))
    chunks = [chunks[str(i)] for i in range(len(chunks))]
  except KeyError:
    fail(name, "its chunked array's shape or chunks are not numbered 0..n-1")
  if not all(isinstance(d, int) and d >= 0 for d in shape):
    fail(name, f"its chunked array's shape {shape} is not a shape")
  parts = [_decoded(c, name, fail) for c in chunks]
  if not all(isinstance(p, np.ndarray) and p.ndim == 1 for p in parts):
    fail(name, "its chunks are not flat arrays")
  if len({p.dtype for p in parts}) != 1:
    fail(name, "its chunks differ in dtype")
  size = sum(p.size for p in parts)
  if size != math.prod(shape):
    fail(
      name,
      f"shape {shape} needs {math.prod(shape)} values, its chunks hold {size}",
    )
  return np.concatenate(parts).reshape(shape)
