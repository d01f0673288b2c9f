"""PyTorch checkpoints (``pytorch_model.bin``, ``.pt``, ``.pth``) read
tensor by tensor, without torch and without running their pickle.

A HuggingFace model saved before safetensors (``save_pretrained(...,
safe_serialization=False)`` in transformers 4, and many Hub repositories)
holds its state dict as ``torch.save`` writes it, in one of two formats:

- the zip format (PyTorch >= 1.6): a zip archive with ``<root>/data.pkl``
  (the dict, pickled) and each storage's bytes uncompressed in
  ``<root>/data/<key>``;
- the legacy format (PyTorch < 1.6, and ``_use_new_zipfile_serialization=
  False``; the Hub's 2019 checkpoints, GPT-2's and BERT's among them): five
  pickles in a row -- a magic number, the protocol version (1001), the
  writer's byte order and type sizes, the state dict, the sorted storage
  keys -- then each storage in that order as its element count (int64)
  and its bytes.

The state dict's pickle is read by ``torch_pickle`` as descriptions;
each is checked against the bytes its storage has in the file before
anything is loaded, and a tensor is read when asked for (one seek and one
read, its strides applied as NumPy's).
"""

import os
import zipfile

import numpy as np

from jpipe.train import torch_pickle
from jpipe.train.errors import UsageError
from jpipe.train.hf_checkpoint import PREFIX, check_shard_holds, shard_map
from jpipe.train.torch_pickle import Tensor

# The legacy format's first pickle and its protocol version.
_LEGACY_MAGIC = 0x1950A86A20F9469CFC6C
_LEGACY_PROTOCOL = 1001


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
    self.path = path
    self._entries: dict[str, tuple[str, Tensor, int]] = {}
    for file, named in shard_map(path, "pytorch_model.bin"):
      index = _read_index(file)
      check_shard_holds(path, file, named, [name for name, _, _ in index])
      for name, tensor, start in index:
        if named is None or name in named:  # (The index's shard only.)
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
    span = torch_pickle.span(t)
    with open(file, "rb") as f:
      f.seek(start + t.offset * dtype.itemsize)
      flat = np.fromfile(f, dtype=dtype, count=span)
    if len(flat) != span:
      raise UsageError(
        f"{PREFIX}{file}: tensor {name!r} lies past the end of the file: "
        "it is cut short; copy or save the checkpoint again"
      )
    if span == int(np.prod(t.shape)) and t.strides == torch_pickle.contiguous(
      t.shape
    ):
      return flat.reshape(t.shape)  # (Its bytes as they lie: no copy.)
    view = np.lib.stride_tricks.as_strided(
      flat, t.shape, [s * dtype.itemsize for s in t.strides], writeable=False
    )
    return np.array(view)


def _read_index(file: str) -> list[tuple[str, Tensor, int]]:
  """(name, description, absolute offset of its storage's bytes) of every
  tensor of one ``torch.save`` file, in either format, each checked
  against its storage's bytes; a file that is neither format, names a
  callable outside a state dict's, or holds a view past its storage is one
  line naming it."""
  where = f"{PREFIX}{file}"
  if not os.path.isfile(file):
    raise UsageError(f"{where}: no such file")
  try:
    if zipfile.is_zipfile(file):
      return _zip_index(file)
    with open(file, "rb") as f:
      if f.read(1) == b"\x80":  # (A pickle, protocol 2 or later.)
        return _legacy_index(file)
  except (OSError, ValueError, zipfile.BadZipFile) as e:
    raise UsageError(
      f"{where} cannot be read as a PyTorch state dict: {e} (jpipe reads "
      "torch.save's tensors without running its pickle); copy or save the "
      "checkpoint again"
    ) from None
  raise UsageError(
    f"{where} is not a PyTorch checkpoint (neither torch.save's zip format "
    "nor its legacy pickles: torch's older tar format, or a damaged file); "
    "load it with torch and save it again with save_pretrained"
  )


def _zip_index(file: str) -> list[tuple[str, Tensor, int]]:
  """``_read_index`` of the zip format."""
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
    with archive.open(pkl) as stream:
      tensors = torch_pickle.load_state_dict(stream)
    members = {i.filename: i for i in archive.infolist()}
    starts = {}
    with open(file, "rb") as raw:
      for name, t in tensors:
        info = members.get(f"{root}data/{t.storage.key}")
        if info is None:
          raise ValueError(f"tensor {name!r}'s storage is not in it")
        if t.storage.key not in starts:  # (Tied weights share a storage.)
          starts[t.storage.key] = _data_start(raw, info)
        torch_pickle.check_view(name, t, info.file_size)
    return [(n, t, starts[t.storage.key]) for n, t in tensors]


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


def _legacy_index(file: str) -> list[tuple[str, Tensor, int]]:
  """``_read_index`` of the legacy format: the header records checked,
  the state dict's descriptions, then the storages walked in the order of
  their keys (each an int64 element count, then its bytes)."""
  size = os.path.getsize(file)
  with open(file, "rb") as f:
    if torch_pickle.load_plain(f) != _LEGACY_MAGIC:
      raise ValueError("it is a pickle, not a torch.save file")
    if torch_pickle.load_plain(f) != _LEGACY_PROTOCOL:
      raise ValueError("its legacy format's version is not 1001")
    info = torch_pickle.load_plain(f)
    if not isinstance(info, dict) or not info.get("little_endian"):
      raise ValueError("its tensors are big-endian")
    tensors = torch_pickle.load_state_dict(f)
    keys = torch_pickle.load_plain(f)
    if not isinstance(keys, list):
      raise ValueError("its list of storages is damaged")
    storages = {t.storage.key: t.storage for _, t in tensors}
    starts, stored = {}, {}
    for key in keys:
      if key not in storages:
        raise ValueError(f"it stores a storage {key!r} no tensor names")
      count = f.read(8)
      numel = int.from_bytes(count, "little", signed=True)
      starts[key] = f.tell()
      stored[key] = numel * np.dtype(storages[key].dtype).itemsize
      if len(count) != 8 or numel < 0 or starts[key] + stored[key] > size:
        raise ValueError(f"storage {key!r} lies past the end: it is cut short")
      f.seek(stored[key], os.SEEK_CUR)
  for name, t in tensors:
    if t.storage.key not in starts:
      raise ValueError(f"tensor {name!r}'s storage is not in it")
    torch_pickle.check_view(name, t, stored[t.storage.key])
  return [(n, t, starts[t.storage.key]) for n, t in tensors]
