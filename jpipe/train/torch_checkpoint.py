"""PyTorch checkpoints (``pytorch_model.bin``, ``torch.save``'s zip format)
read tensor by tensor, without torch and without running the pickle.

A HuggingFace model saved before safetensors (``save_pretrained(...,
safe_serialization=False)``, and many Hub repositories) holds its state
dict as ``torch.save`` writes it since PyTorch 1.6: a zip archive with
``<root>/data.pkl`` (the dict, pickled, each tensor a call of
``torch._utils._rebuild_tensor_v2`` on a storage named by a persistent id
``("storage", torch.<Type>Storage, key, location, numel)``) and each
storage's bytes uncompressed in ``<root>/data/<key>``.

Unpickling that with ``pickle`` would run whatever callables the file
names (a damaged or hostile file runs code). Here the pickle is read by an
unpickler that knows only the names a state dict uses -- ``OrderedDict``,
the tensor and parameter rebuilders and the typed storage classes -- and
refuses any other in one line naming it, before anything is loaded; what
it builds are descriptions (storage, offset, shape, strides), and a tensor
is read from its storage's bytes in the archive when asked for (one seek
and one read, its strides applied as NumPy's). Every description is checked
against its storage's size first.
"""

import dataclasses
import os
import pickle
import zipfile
from collections import OrderedDict

import ml_dtypes
import numpy as np

from jpipe.train.errors import UsageError
from jpipe.train.hf_checkpoint import PREFIX, shard_files

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
}


@dataclasses.dataclass(frozen=True)
class _Storage:
  """A storage named by the pickle: its member's key, dtype, elements."""

  key: str
  dtype: np.dtype
  numel: int


@dataclasses.dataclass(frozen=True)
class _Tensor:
  """A tensor as the pickle describes it: a view of a storage."""

  storage: _Storage
  offset: int
  shape: tuple[int, ...]
  strides: tuple[int, ...]  # In elements.


def _rebuild_tensor(storage, offset, size, stride, *_):
  """``torch._utils._rebuild_tensor_v2``'s arguments as a description
  (requires_grad, backward hooks and metadata are not data)."""
  if not isinstance(storage, _Storage):
    raise pickle.UnpicklingError("a tensor whose storage is not a storage")
  return _Tensor(storage, int(offset), tuple(size), tuple(stride))


def _rebuild_parameter(data, *_):
  """``torch._utils._rebuild_parameter``: a Parameter is its data."""
  return data


_ALLOWED = {
  ("collections", "OrderedDict"): OrderedDict,
  ("torch._utils", "_rebuild_tensor_v2"): _rebuild_tensor,
  ("torch._utils", "_rebuild_parameter"): _rebuild_parameter,
  ("torch._utils", "_rebuild_parameter_with_state"): _rebuild_parameter,
}


class _StateDictUnpickler(pickle.Unpickler):
  """Builds a state dict's descriptions; any name beyond them is refused."""

  def find_class(self, module, name):
    if module == "torch" and name in _STORAGES:
      return np.dtype(_STORAGES[name])
    if (module, name) in _ALLOWED:
      return _ALLOWED[(module, name)]
    raise pickle.UnpicklingError(
      f"it calls {module}.{name}, which a state dict of tensors does not"
    )

  def persistent_load(self, pid):
    if not (
      isinstance(pid, tuple)
      and len(pid) == 5
      and pid[0] == "storage"
      and isinstance(pid[1], np.dtype)
      and isinstance(pid[2], str)
      and isinstance(pid[4], int)
    ):
      raise pickle.UnpicklingError(f"an unknown persistent id {pid!r:.80}")
    return _Storage(pid[2], pid[1], pid[4])


class PytorchBin:
  """The tensors of a PyTorch checkpoint (one file or an index of shards),
  read one at a time, under their state dict names.

  Args:
    path: a ``torch.save`` file (``.bin``, ``.pt``, ``.pth``), or a
      directory with ``pytorch_model.bin`` or
      ``pytorch_model.bin.index.json``.
  """

  def __init__(self, path: str):
    path = os.path.expanduser(path)
    files = shard_files(path, "pytorch_model.bin")
    self.path = path
    self._entries: dict[str, tuple[str, _Tensor, int]] = {}
    for file in files:
      for name, tensor, start in _read_index(file):
        self._entries[name] = (file, tensor, start)

  def names(self) -> list[str]:
    return sorted(self._entries)

  def shape(self, name: str) -> tuple[int, ...]:
    return self._entries[name][1].shape

  def dtype(self, name: str) -> np.dtype:
    return np.dtype(self._entries[name][1].storage.dtype)

  def read(self, name: str) -> np.ndarray:
    """The tensor ``name``: the bytes of its storage it spans, read from
    the archive, laid out by its strides (a strided view copied)."""
    file, t, start = self._entries[name]
    dtype = np.dtype(t.storage.dtype).newbyteorder("<")
    span = _span(t)
    with open(file, "rb") as f:
      f.seek(start + t.offset * dtype.itemsize)
      flat = np.fromfile(f, dtype=dtype, count=span)
    if len(flat) != span:
      raise UsageError(
        f"{PREFIX}{file}: tensor {name!r} lies past the end of the file: "
        "it is cut short; copy or save the checkpoint again"
      )
    if span == int(np.prod(t.shape)) and t.strides == _contiguous(t.shape):
      return flat.reshape(t.shape)  # (Its bytes as they lie: no copy.)
    view = np.lib.stride_tricks.as_strided(
      flat, t.shape, [s * dtype.itemsize for s in t.strides], writeable=False
    )
    return np.array(view)


def _contiguous(shape: tuple[int, ...]) -> tuple[int, ...]:
  """Row-major strides (in elements) of ``shape``."""
  return tuple(int(np.prod(shape[i + 1 :])) for i in range(len(shape)))


def _span(t: _Tensor) -> int:
  """How many elements from its offset a tensor's view reaches."""
  if any(d == 0 for d in t.shape):
    return 0
  return 1 + sum((d - 1) * s for d, s in zip(t.shape, t.strides, strict=True))


def _read_index(file: str) -> list[tuple[str, _Tensor, int]]:
  """(name, description, absolute offset of its storage's bytes) of every
  tensor of one ``torch.save`` file, each checked against its storage; a
  file that is not such an archive, names a callable outside a state
  dict's, or holds a view past its storage is one line naming it."""
  where = f"{PREFIX}{file}"
  if not os.path.isfile(file):
    raise UsageError(f"{where}: no such file")
  if not zipfile.is_zipfile(file):
    raise UsageError(
      f"{where} is not a PyTorch zip checkpoint (torch.save's format since "
      "PyTorch 1.6; an older file, or a damaged one): save it again with "
      "save_pretrained(..., safe_serialization=True)"
    )
  try:
    with zipfile.ZipFile(file) as archive:
      (pkl,) = [n for n in archive.namelist() if n.endswith("/data.pkl")] or [
        None
      ]
      if pkl is None:
        raise ValueError("it has no <root>/data.pkl")
      root = pkl[: -len("data.pkl")]
      order = root + "byteorder"
      if order in archive.namelist() and archive.read(order) != b"little":
        raise ValueError("its tensors are big-endian")
      tensors = _tensors(_unpickled(archive, pkl))
      members = {i.filename: i for i in archive.infolist()}
      starts = {}
      with open(file, "rb") as raw:
        for name, t in tensors:
          info = members.get(f"{root}data/{t.storage.key}")
          if info is None:
            raise ValueError(f"tensor {name!r}'s storage is not in it")
          starts[t.storage.key] = _data_start(raw, info)
          _check_view(name, t, info)
      return [(n, t, starts[t.storage.key]) for n, t in tensors]
  except (
    OSError,
    ValueError,
    EOFError,
    pickle.UnpicklingError,
    zipfile.BadZipFile,
  ) as e:
    raise UsageError(
      f"{where} cannot be read as a PyTorch state dict: {e} (jpipe reads "
      "torch.save's tensors without running its pickle); copy or save the "
      "checkpoint again"
    ) from None


def _unpickled(archive: zipfile.ZipFile, member: str):
  """``data.pkl``'s state dict of descriptions; whatever stops its
  unpickling (a refused name, a damaged stream of any kind) as a
  ValueError saying what."""
  try:
    return _StateDictUnpickler(archive.open(member)).load()
  except Exception as e:  # (A damaged pickle fails in many ways.)
    raise ValueError(f"its pickle: {type(e).__name__}: {e}") from None


def _tensors(state) -> list[tuple[str, _Tensor]]:
  """A state dict's (name, tensor) entries; anything else is refused."""
  if not isinstance(state, dict):
    raise ValueError(f"it holds a {type(state).__name__}, not a state dict")
  out = []
  for name, t in state.items():
    if not isinstance(t, _Tensor):
      raise ValueError(f"its entry {name!r} is not a tensor")
    out.append((str(name), t))
  return out


def _data_start(raw, info: zipfile.ZipInfo) -> int:
  """Where a stored (uncompressed) member's bytes begin in the file: after
  its local header (30 bytes, then its name and extra field)."""
  if info.compress_type != zipfile.ZIP_STORED:
    raise ValueError(f"{info.filename} is compressed (torch.save stores it)")
  raw.seek(info.header_offset)
  local = raw.read(30)
  if len(local) != 30 or local[:4] != b"PK\x03\x04":
    raise ValueError(f"{info.filename}'s local header is damaged")
  name_length = int.from_bytes(local[26:28], "little")
  extra_length = int.from_bytes(local[28:30], "little")
  return info.header_offset + 30 + name_length + extra_length


def _check_view(name: str, t: _Tensor, info: zipfile.ZipInfo) -> None:
  """A tensor's view inside its storage, and the storage the size its
  member holds."""
  itemsize = np.dtype(t.storage.dtype).itemsize
  if t.storage.numel * itemsize != info.file_size:
    raise ValueError(
      f"tensor {name!r}'s storage has {info.file_size} bytes, not "
      f"{t.storage.numel} x {itemsize}"
    )
  if (
    len(t.shape) != len(t.strides)
    or any(d < 0 for d in t.shape)
    or any(s < 0 for s in t.strides)
    or t.offset < 0
    or t.offset + _span(t) > t.storage.numel
  ):
    raise ValueError(
      f"tensor {name!r} (shape {t.shape}, strides {t.strides}, offset "
      f"{t.offset}) lies outside its storage of {t.storage.numel}"
    )
