"""Files in ``torch.save``'s zip format, written without torch (which the
tests do not install), as PyTorch (>= 1.6, and 2.x's ``byteorder``
record) lays them out: a zip archive of uncompressed members under one
root folder -- ``data.pkl`` (pickle protocol 2 of the state dict, each
tensor ``torch._utils._rebuild_tensor_v2(storage, offset, size, stride,
requires_grad, OrderedDict())``, each storage the persistent id
``("storage", torch.<Type>Storage, key, "cpu", numel)``), ``data/<key>``
(a storage's little-endian bytes, 64-byte aligned by the local header's
extra field, as torch's writer aligns them), ``version`` and
``byteorder``.

The pickle names torch's callables by module and name; they are stand-ins
registered under those names only while pickling (pickle checks a global
resolves to the object it writes)."""

import collections
import contextlib
import io
import pickle
import struct
import sys
import types
import zipfile

import ml_dtypes
import numpy as np

_STORAGE_NAMES = {
  np.dtype(np.float64): "DoubleStorage",
  np.dtype(np.float32): "FloatStorage",
  np.dtype(np.float16): "HalfStorage",
  np.dtype(ml_dtypes.bfloat16): "BFloat16Storage",
  np.dtype(np.int64): "LongStorage",
  np.dtype(np.int32): "IntStorage",
  np.dtype(np.uint8): "ByteStorage",
  np.dtype(np.bool_): "BoolStorage",
}


class Storage:
  """A storage: its key and flat data."""

  def __init__(self, key: str, data: np.ndarray):
    self.key, self.data = key, np.ascontiguousarray(data).reshape(-1)


class View:
  """A tensor: a view (offset, shape, strides in elements) of a storage."""

  def __init__(self, storage, offset=0, shape=None, strides=None):
    self.storage, self.offset = storage, offset
    self.shape = tuple(storage.data.shape if shape is None else shape)
    if strides is None:
      strides = [
        int(np.prod(self.shape[i + 1 :])) for i in range(len(self.shape))
      ]
    self.strides = tuple(strides)


def tensors(arrays: dict[str, np.ndarray]) -> dict[str, View]:
  """Each array as a contiguous tensor of a storage of its own."""
  return {
    name: View(Storage(str(i), a), 0, np.shape(a))
    for i, (name, a) in enumerate(arrays.items())
  }


@contextlib.contextmanager
def _torch_names():
  """``torch``, ``torch._utils`` and the storage classes, as stand-ins."""
  torch = types.ModuleType("torch")
  utils = types.ModuleType("torch._utils")

  def _rebuild_tensor_v2(*args):
    raise AssertionError("a stand-in: only pickled")

  _rebuild_tensor_v2.__module__ = "torch._utils"
  _rebuild_tensor_v2.__qualname__ = "_rebuild_tensor_v2"
  utils._rebuild_tensor_v2 = _rebuild_tensor_v2
  for name in _STORAGE_NAMES.values():
    setattr(torch, name, type(name, (), {"__module__": "torch"}))
  torch._utils = utils
  saved = {k: sys.modules.get(k) for k in ("torch", "torch._utils")}
  sys.modules.update({"torch": torch, "torch._utils": utils})
  try:
    yield torch, utils
  finally:
    for k, v in saved.items():
      if v is None:
        sys.modules.pop(k)
      else:
        sys.modules[k] = v


class _Pickler(pickle.Pickler):
  def __init__(self, file, torch, utils):
    super().__init__(file, protocol=2)
    self.torch, self.utils = torch, utils

  def persistent_id(self, obj):
    if isinstance(obj, Storage):
      kind = getattr(self.torch, _STORAGE_NAMES[obj.data.dtype])
      return ("storage", kind, obj.key, "cpu", obj.data.size)
    return None

  def reducer_override(self, obj):
    if isinstance(obj, View):
      args = (obj.storage, obj.offset, obj.shape, obj.strides, False)
      return self.utils._rebuild_tensor_v2, (*args, collections.OrderedDict())
    return NotImplemented


def torch_save(path, state: dict, root="archive", state_pickle=None) -> None:
  """``state`` ({name: View}) as ``torch.save(state_dict, path)`` writes
  it; ``state_pickle``: data.pkl's bytes instead (a damaged or hostile
  file)."""
  storages = {}
  for view in state.values():
    storages[view.storage.key] = view.storage
  if state_pickle is None:
    with _torch_names() as (torch, utils):
      buffer = io.BytesIO()
      _Pickler(buffer, torch, utils).dump(collections.OrderedDict(state))
      state_pickle = buffer.getvalue()
  with zipfile.ZipFile(path, "w", zipfile.ZIP_STORED) as archive:
    archive.writestr(f"{root}/data.pkl", state_pickle)
    archive.writestr(f"{root}/byteorder", "little")
    for key, storage in storages.items():
      _write_aligned(archive, f"{root}/data/{key}", storage.data.tobytes())
    archive.writestr(f"{root}/version", "3\n")


def _write_aligned(archive, name: str, data: bytes) -> None:
  """A member whose data starts at a multiple of 64 in the file, padded
  by an extra field of its local header (torch's writer aligns so)."""
  info = zipfile.ZipInfo(name)
  info.compress_type = zipfile.ZIP_STORED
  start = archive.fp.tell() + 30 + len(name.encode())
  pad = (-(start + 4)) % 64
  info.extra = struct.pack("<HH", 0x4246, pad) + b"Z" * pad
  archive.writestr(info, data)
