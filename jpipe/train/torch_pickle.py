"""A ``torch.save`` pickle read as descriptions of tensors, without torch
and without running it.

Both of torch.save's formats pickle the state dict the same way: each
tensor a call of ``torch._utils._rebuild_tensor_v2(storage, offset, size,
stride, ...)`` (``_rebuild_tensor_v3(..., dtype)`` on an untyped storage
for the dtypes without a typed storage class, float8 and the wide unsigned
integers; ``_rebuild_tensor`` before PyTorch 1.0), each storage a
persistent id ``("storage", torch.<Type>Storage, key, location, numel)``
(the legacy format appends a view's metadata, None for a whole storage).

Unpickling that with ``pickle`` would run whatever callables the file
names (a damaged or hostile file runs code). The unpickler here knows only
the names a state dict uses -- ``OrderedDict``, the tensor and parameter
rebuilders, the storage classes and dtypes -- and refuses any other,
unrun; what it builds are descriptions (storage, offset, shape, strides)
that the file formats' readers (``torch_checkpoint``) check against the
storages' bytes and read.
"""

import dataclasses
import pickle
from collections import OrderedDict

import ml_dtypes
import numpy as np

# torch.<Name>Storage -> the element's NumPy dtype.
_STORAGES = {
  "DoubleStorage": np.float64,
  "FloatStorage": np.float32,
  "HalfStorage": np.float16,
  "BFloat16Storage": ml_dtypes.bfloat16,
  "LongStorage": np.int64,
  "IntStorage": np.int32,
  "ShortStorage": np.int16,
  "CharStorage": np.int8,
  "ByteStorage": np.uint8,
  "BoolStorage": np.bool_,
  "ComplexFloatStorage": np.complex64,
  "ComplexDoubleStorage": np.complex128,
}

# torch.<dtype> (``_rebuild_tensor_v3``'s last argument) -> NumPy's.
_DTYPES = {
  "float64": np.float64,
  "float32": np.float32,
  "float16": np.float16,
  "bfloat16": ml_dtypes.bfloat16,
  "float8_e4m3fn": ml_dtypes.float8_e4m3fn,
  "float8_e5m2": ml_dtypes.float8_e5m2,
  "float8_e4m3fnuz": ml_dtypes.float8_e4m3fnuz,
  "float8_e5m2fnuz": ml_dtypes.float8_e5m2fnuz,
  "float8_e8m0fnu": ml_dtypes.float8_e8m0fnu,
  "int64": np.int64,
  "int32": np.int32,
  "int16": np.int16,
  "int8": np.int8,
  "uint64": np.uint64,
  "uint32": np.uint32,
  "uint16": np.uint16,
  "uint8": np.uint8,
  "bool": np.bool_,
  "complex64": np.complex64,
  "complex128": np.complex128,
}


@dataclasses.dataclass(frozen=True)
class Storage:
  """A storage named by the pickle: its key, element dtype and count."""

  key: str
  dtype: np.dtype
  numel: int

  @property
  def nbytes(self) -> int:
    return self.numel * np.dtype(self.dtype).itemsize


@dataclasses.dataclass(frozen=True)
class Tensor:
  """A tensor as the pickle describes it: a view of a storage."""

  storage: Storage
  offset: int  # In elements.
  shape: tuple[int, ...]
  strides: tuple[int, ...]  # In elements.


def _rebuild_tensor(storage, offset, size, stride, *_):
  """``torch._utils._rebuild_tensor_v2``'s (and v1's) arguments as a
  description (requires_grad, backward hooks and metadata are not data)."""
  if not isinstance(storage, Storage):
    raise pickle.UnpicklingError("a tensor whose storage is not a storage")
  return Tensor(storage, int(offset), tuple(size), tuple(stride))


def _rebuild_tensor_v3(storage, offset, size, stride, grad, hooks, dtype, *_):
  """``_rebuild_tensor_v3``: an untyped storage (its numel in bytes) read
  as elements of ``dtype``."""
  if not isinstance(storage, Storage) or not isinstance(dtype, np.dtype):
    raise pickle.UnpicklingError("a tensor whose storage is not a storage")
  if storage.nbytes % dtype.itemsize:
    raise pickle.UnpicklingError(
      f"a storage of {storage.nbytes} bytes holds no whole {dtype} elements"
    )
  typed = Storage(storage.key, dtype, storage.nbytes // dtype.itemsize)
  return _rebuild_tensor(typed, offset, size, stride)


def _rebuild_parameter(data, *_):
  """``torch._utils._rebuild_parameter``: a Parameter is its data."""
  return data


_ALLOWED = {
  ("collections", "OrderedDict"): OrderedDict,
  ("torch._utils", "_rebuild_tensor"): _rebuild_tensor,
  ("torch._utils", "_rebuild_tensor_v2"): _rebuild_tensor,
  ("torch._utils", "_rebuild_tensor_v3"): _rebuild_tensor_v3,
  ("torch._utils", "_rebuild_parameter"): _rebuild_parameter,
  ("torch._utils", "_rebuild_parameter_with_state"): _rebuild_parameter,
  ("torch.storage", "UntypedStorage"): np.dtype(np.uint8),
}


class _StateDictUnpickler(pickle.Unpickler):
  """Builds a state dict's descriptions; any name beyond them is refused."""

  def find_class(self, module, name):
    if module == "torch" and name in _STORAGES:
      return np.dtype(_STORAGES[name])
    if module == "torch" and name in _DTYPES:
      return np.dtype(_DTYPES[name])
    if (module, name) in _ALLOWED:
      return _ALLOWED[(module, name)]
    raise pickle.UnpicklingError(
      f"it calls {module}.{name}, which a state dict of tensors does not"
    )

  def persistent_load(self, pid):
    if not (
      isinstance(pid, tuple)
      and len(pid) in (5, 6)
      and pid[0] == "storage"
      and isinstance(pid[1], np.dtype)
      and isinstance(pid[2], str)
      and isinstance(pid[4], int)
    ):
      raise pickle.UnpicklingError(f"an unknown persistent id {pid!r:.80}")
    if len(pid) == 6 and pid[5] is not None:
      # (A view of a storage: written only by PyTorch before 1.0.)
      raise pickle.UnpicklingError(
        "a storage view (PyTorch < 1.0), which jpipe does not read"
      )
    return Storage(pid[2], pid[1], pid[4])


def load_state_dict(stream) -> list[tuple[str, Tensor]]:
  """The (name, tensor description) entries of the state dict pickled at
  ``stream``'s position (left just past it); whatever stops it -- a
  refused name, a damaged stream of any kind, anything but a dict of
  tensors -- is a ValueError saying what."""
  try:
    state = _StateDictUnpickler(stream).load()
  except Exception as e:  # (A damaged pickle fails in many ways.)
    raise ValueError(f"its pickle: {type(e).__name__}: {e}") from None
  if not isinstance(state, dict):
    raise ValueError(f"it holds a {type(state).__name__}, not a state dict")
  out = []
  for name, t in state.items():
    if not isinstance(t, Tensor):
      raise ValueError(f"its entry {name!r} is not a tensor")
    out.append((str(name), t))
  return out


class _NoNames(pickle.Unpickler):
  """Plain data only (numbers, strings, lists, dicts): a name is refused."""

  def find_class(self, module, name):
    raise pickle.UnpicklingError(f"it calls {module}.{name}")


def load_plain(stream):
  """One pickled value of plain data at ``stream``'s position (the legacy
  format's header records and storage keys); a failure is a ValueError."""
  try:
    return _NoNames(stream).load()
  except Exception as e:  # (A damaged pickle fails in many ways.)
    raise ValueError(f"its pickle: {type(e).__name__}: {e}") from None


def contiguous(shape: tuple[int, ...]) -> tuple[int, ...]:
  """Row-major strides (in elements) of ``shape``."""
  return tuple(int(np.prod(shape[i + 1 :])) for i in range(len(shape)))


def span(t: Tensor) -> int:
  """How many elements from its offset a tensor's view reaches."""
  if any(d == 0 for d in t.shape):
    return 0
  return 1 + sum((d - 1) * s for d, s in zip(t.shape, t.strides, strict=True))


def check_view(name: str, t: Tensor, stored_bytes: int) -> None:
  """A tensor's view inside its storage, and its storage the size of the
  bytes the file holds for it; else a ValueError saying which."""
  if t.storage.nbytes != stored_bytes:
    raise ValueError(
      f"tensor {name!r}'s storage has {stored_bytes} bytes, not "
      f"{t.storage.numel} x {np.dtype(t.storage.dtype).itemsize}"
    )
  if (
    len(t.shape) != len(t.strides)
    or any(d < 0 for d in t.shape)
    or any(s < 0 for s in t.strides)
    or t.offset < 0
    or t.offset + span(t) > t.storage.numel
  ):
    raise ValueError(
      f"tensor {name!r} (shape {t.shape}, strides {t.strides}, offset "
      f"{t.offset}) lies outside its storage of {t.storage.numel}"
    )
