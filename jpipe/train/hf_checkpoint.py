"""HuggingFace checkpoints -- ``safetensors`` (PyTorch names and layout),
Flax ``msgpack``, or PyTorch's own ``pytorch_model.bin``
(``torch_checkpoint``) -- read into jpipe's models by their name maps.

``config.init_from=hf:PATH``: PATH is a ``*.safetensors`` file or a
directory holding ``model.safetensors`` or a sharded
``model.safetensors.index.json`` (what ``save_pretrained`` writes and the
Hub serves), or, failing those, ``flax_model.msgpack`` (or its sharded
``flax_model.msgpack.index.json``; a ``*.msgpack`` file also works). A
model module that can take such weights has ``hf_names(model) -> {our
param path: (HuggingFace name, transposed)}`` (e.g.
``jpipe.models.t5_v1``), in PyTorch's names and layout. A safetensors
leaf is read from its file alone (a header lookup and one read: no
library, no copy of the whole file). A msgpack file has no index to seek
by: each file (shard) is read whole, and its leaves are renamed and laid
out as PyTorch's by the rules HuggingFace's own converter
(``convert_pytorch_state_dict_to_flax``) applies in reverse: a 2-D
``kernel`` is the transposed ``weight`` (Linear, and GPT-2's Conv1D), a
4-D one the (H, W, in, out) ``weight``, ``embedding`` and a layer norm's
``scale`` are ``weight``; the nesting joined by "." is the PyTorch name.
"""

import json
import os
import re

import ml_dtypes
import numpy as np

from jpipe.train.errors import UsageError

PREFIX = "hf:"

DTYPES = {
  "F64": np.float64,
  "F32": np.float32,
  "F16": np.float16,
  "BF16": ml_dtypes.bfloat16,
  "I64": np.int64,
  "I32": np.int32,
  "I16": np.int16,
  "I8": np.int8,
  "U8": np.uint8,
  "BOOL": np.bool_,
}


def is_hf(source) -> bool:
  return isinstance(source, str) and source.startswith(PREFIX)


class Safetensors:
  """The tensors of one checkpoint (one file or an index of shards), read
  one at a time.

  Args:
    path: a ``.safetensors`` file, or a directory with
      ``model.safetensors`` or ``model.safetensors.index.json``.
  """

  def __init__(self, path: str):
    path = os.path.expanduser(path)
    if os.path.isdir(path) and not _holds(
      path, "model.safetensors", "model.safetensors.index.json"
    ):
      raise UsageError(
        f"{PREFIX}{path}: no model.safetensors, "
        "model.safetensors.index.json, flax_model.msgpack or "
        "pytorch_model.bin in the directory (a HuggingFace model saved "
        "with save_pretrained, or downloaded from the Hub)"
      )
    if not os.path.exists(path):
      raise UsageError(f"{PREFIX}{path}: no such file or directory")
    shards = shard_map(path, "model.safetensors")
    self.path = shards[0][0] if shards[0][1] is None else path
    self._entries = {}  # name -> (file, dtype, shape, start offset)
    for file, named in shards:
      header = _header(file)
      check_shard_holds(path, file, named, header)
      # (A stale copy of a tensor in a shard the index does not name for
      # it is not read.)
      self._entries.update(
        header if named is None else {n: header[n] for n in named}
      )

  def names(self) -> list[str]:
    return sorted(self._entries)

  def shape(self, name: str) -> tuple[int, ...]:
    return self._entries[name][2]

  def dtype(self, name: str) -> np.dtype:
    return np.dtype(self._entries[name][1])

  def read(self, name: str) -> np.ndarray:
    """The tensor ``name``, read from its file (only its bytes)."""
    file, dtype, shape, start = self._entries[name]
    count = int(np.prod(shape))
    with open(file, "rb") as f:
      f.seek(start)
      data = np.fromfile(
        f, dtype=np.dtype(dtype).newbyteorder("<"), count=count
      )
    return data.reshape(shape)


class FlaxMsgpack:
  """The tensors of a HuggingFace Flax checkpoint (``flax_model.msgpack``
  or its shards) under PyTorch's names and layout (module docstring).

  Args:
    path: a ``.msgpack`` file, or a directory with ``flax_model.msgpack``
      or ``flax_model.msgpack.index.json``.
  """

  def __init__(self, path: str):
    from flax import serialization  # Only for a Flax checkpoint.

    path = os.path.expanduser(path)
    self.path = path
    self._arrays = {}
    for file, named in shard_map(path, "flax_model.msgpack"):
      try:
        with open(file, "rb") as f:
          tree = serialization.msgpack_restore(f.read())
      except (OSError, ValueError) as e:
        raise UsageError(
          f"{PREFIX}{file} is not a Flax msgpack checkpoint "
          f"({type(e).__name__}: {e})"
        ) from e
      if not isinstance(tree, dict):
        raise UsageError(
          f"{PREFIX}{file} is not a Flax msgpack checkpoint (it holds a "
          f"{type(tree).__name__}, not a tree of named arrays)"
        )
      flat = list(_flat(tree))
      check_shard_holds(path, file, named, ["/".join(k) for k, _ in flat])
      for keys, value in flat:
        # (The index names Flax paths, "a/b/kernel": its shard's only.)
        if named is None or "/".join(keys) in named:
          name, array = _as_pytorch(keys, np.asarray(value))
          self._arrays[name] = array

  def names(self) -> list[str]:
    return sorted(self._arrays)

  def shape(self, name: str) -> tuple[int, ...]:
    return self._arrays[name].shape

  def dtype(self, name: str) -> np.dtype:
    return self._arrays[name].dtype

  def read(self, name: str) -> np.ndarray:
    return self._arrays[name]


def shard_map(path: str, single: str) -> list[tuple[str, set | None]]:
  """``(file, the tensor names the index puts in it)`` of each file of a
  checkpoint whose file is named ``single`` in a directory (``None``: all
  of the file's, where there is no index): the one file where it is
  there (``from_pretrained`` looks for it first), else the shards its
  ``single + ".index.json"`` names; ``path`` itself where it is no
  directory."""
  if not os.path.isdir(path):
    return [(path, None)]
  if os.path.isfile(os.path.join(path, single)):
    return [(os.path.join(path, single), None)]
  index = os.path.join(path, single + ".index.json")
  if not os.path.isfile(index):
    return [(os.path.join(path, single), None)]
  named: dict[str, set] = {}
  for name, shard in _weight_map(index).items():
    named.setdefault(shard, set()).add(name)
  return [(os.path.join(path, shard), named[shard]) for shard in sorted(named)]


def check_shard_holds(path, file, named, held) -> None:
  """A UsageError where the index puts a tensor in shard ``file`` that
  it does not hold (``named``: the index's names for it, None: no index;
  ``held``: the shard's)."""
  missing = sorted(set(named or ()) - set(held))
  if missing:
    raise UsageError(
      f"{PREFIX}{path}: the index names {missing[0]!r} in "
      f"{os.path.basename(file)}, which does not hold it"
    )


def _weight_map(index: str) -> dict[str, str]:
  """A sharded checkpoint's index (``*.index.json``): its ``weight_map``,
  tensor name -> shard file name; a UsageError naming the file if it is
  not such JSON (damaged, cut short, another format)."""
  try:
    with open(index) as f:
      weight_map = json.load(f)["weight_map"]
  except (OSError, ValueError, KeyError, TypeError) as e:
    raise UsageError(
      f"{PREFIX}{index} is not a checkpoint index: {type(e).__name__}: {e} "
      '(it should be JSON with "weight_map": {tensor name: shard file}); '
      "copy or save the checkpoint again"
    ) from e
  if not isinstance(weight_map, dict) or not all(
    isinstance(k, str) and isinstance(v, str) for k, v in weight_map.items()
  ):
    raise UsageError(
      f"{PREFIX}{index} is not a checkpoint index: its weight_map is not "
      "{tensor name: shard file}; copy or save the checkpoint again"
    )
  outside = sorted({f for f in weight_map.values() if os.path.basename(f) != f})
  if outside:
    raise UsageError(
      f"{PREFIX}{index} names shard {outside[0]!r} outside its directory "
      "(an index names its shards by file name); copy or save the "
      "checkpoint again"
    )
  return weight_map


def _flat(tree, prefix=()):
  """(keys, leaf) of a nested dict, depth first."""
  for key, value in tree.items():
    if isinstance(value, dict):
      yield from _flat(value, (*prefix, str(key)))
    else:
      yield (*prefix, str(key)), value


def _as_pytorch(keys, value):
  """A Flax leaf's PyTorch name and layout."""
  *module, leaf = keys
  if leaf == "kernel" and value.ndim == 2:
    leaf, value = "weight", value.T
  elif (
    leaf == "kernel" and value.ndim == 4
  ):  # (H, W, in, out) -> (out, in, H, W)
    leaf, value = "weight", value.transpose(3, 2, 0, 1)
  elif leaf in ("embedding", "scale"):
    leaf = "weight"
  return ".".join((*module, leaf)), value


def open_checkpoint(path: str):
  """``Safetensors`` of ``path``; ``FlaxMsgpack`` where it is a
  ``.msgpack`` file or a directory with a Flax checkpoint but no
  safetensors; ``PytorchBin`` (``torch_checkpoint``) where it is a
  ``.bin`` / ``.pt`` / ``.pth`` file or a directory with only
  ``pytorch_model.bin`` (or its shards)."""
  from jpipe.train.torch_checkpoint import PytorchBin  # (It imports this.)

  expanded = os.path.expanduser(path)
  if expanded.endswith(".msgpack"):
    return FlaxMsgpack(path)
  if expanded.endswith((".bin", ".pt", ".pth")):
    return PytorchBin(path)
  if os.path.isdir(expanded) and not _holds(
    expanded, "model.safetensors", "model.safetensors.index.json"
  ):
    if _holds(expanded, "flax_model.msgpack", "flax_model.msgpack.index.json"):
      return FlaxMsgpack(path)
    if _holds(expanded, "pytorch_model.bin", "pytorch_model.bin.index.json"):
      return PytorchBin(path)
  return Safetensors(path)


def _holds(directory: str, *names: str) -> bool:
  return any(os.path.isfile(os.path.join(directory, n)) for n in names)


# The safetensors library's own bound on a header (its MAX_HEADER_SIZE).
_MAX_HEADER_BYTES = 100_000_000


def _header(file: str) -> dict:
  """{name: (file, dtype, shape, absolute offset)} of a safetensors file
  (an 8-byte little-endian header size, a JSON header, the data), every
  entry checked against the file before anything is read from it: the
  header inside the file, each tensor's byte range its shape times its
  dtype's size, inside the data, overlapping no other (a file that fails
  is refused in one line naming it and the tensor; nothing is loaded)."""
  try:
    file_bytes = os.path.getsize(file)
    with open(file, "rb") as f:
      size = int.from_bytes(f.read(8), "little")
      if not 2 <= size <= min(_MAX_HEADER_BYTES, file_bytes - 8):
        raise ValueError(
          f"its header claims {size} bytes of a {file_bytes}-byte file"
        )
      header = json.loads(f.read(size))
    if not isinstance(header, dict):
      raise ValueError("its header is not a JSON object")
  except (OSError, ValueError) as e:
    raise UsageError(
      f"{PREFIX}{file} is not a safetensors file ({type(e).__name__}: {e})"
    ) from e
  data_bytes = file_bytes - 8 - size
  out, ranges = {}, []
  for name, entry in header.items():
    if name == "__metadata__":
      continue
    dtype, shape, (begin, end) = _entry(file, name, entry, data_bytes)
    ranges.append((begin, end, name))
    out[name] = (file, dtype, shape, 8 + size + begin)
  _check_disjoint(file, ranges)
  return out


def _entry(file, name, entry, data_bytes):
  """One header entry's (dtype, shape, (begin, end)), or the one-line
  error naming what about it cannot be right."""
  where = f"{PREFIX}{file}: tensor {name!r}"
  try:
    dtype_name, shape = entry["dtype"], entry["shape"]
    begin, end = entry["data_offsets"]
  except (KeyError, TypeError, ValueError):
    raise UsageError(
      f"{where} has no dtype / shape / data_offsets [begin, end] in the "
      "header: the file is not safetensors or is damaged"
    ) from None
  if dtype_name not in DTYPES:
    raise UsageError(
      f"{where} has dtype {dtype_name}, which jpipe does not read "
      f"({sorted(DTYPES)})"
    )
  if not (
    isinstance(shape, list)
    and all(isinstance(d, int) and d >= 0 for d in shape)
    and all(isinstance(x, int) for x in (begin, end))
  ):
    raise UsageError(
      f"{where}: shape {shape} or offsets {[begin, end]} are not whole numbers >= 0"
    )
  dtype = DTYPES[dtype_name]
  want = int(np.prod(shape, dtype=object)) * np.dtype(dtype).itemsize
  if not 0 <= begin <= end or end - begin != want:
    raise UsageError(
      f"{where}: its bytes [{begin}, {end}) are not its shape {shape} x "
      f"{dtype_name} ({want} bytes): the file is damaged"
    )
  if end > data_bytes:
    raise UsageError(
      f"{where}: its bytes [{begin}, {end}) end past the file's "
      f"{data_bytes} bytes of data: the file is truncated (download it "
      "again)"
    )
  return dtype, tuple(shape), (begin, end)


def _check_disjoint(file, ranges) -> None:
  """No two tensors' byte ranges share a byte (an overlap would load one
  tensor's bytes as another's); ``ranges``: (begin, end, name)."""
  reach, holder = 0, None  # The furthest end so far, and whose it is.
  for begin, end, name in sorted(r for r in ranges if r[1] > r[0]):
    if begin < reach:
      raise UsageError(
        f"{PREFIX}{file}: tensors {holder!r} and {name!r} overlap in the "
        "file (their byte ranges share bytes): the file is damaged"
      )
    reach, holder = end, name


class LazyTensor:
  """A checkpoint tensor read when converted to an array (``np.asarray``,
  as ``Pipeline.init`` does leaf by leaf on the way to the leaf's stage):
  a multi-GB checkpoint is never whole in host memory. Has the ``shape``
  and ``dtype`` it will have (transposed, cast), so tracing and checks
  need no read. ``reads`` counts its reads."""

  def __init__(self, tensors, name: str, transposed: bool, dtype=None):
    self._tensors, self.name, self.transposed = tensors, name, transposed
    shape = tensors.shape(name)
    self.shape = tuple(reversed(shape)) if transposed else shape
    self.dtype = np.dtype(dtype or tensors.dtype(name))
    self.ndim = len(self.shape)
    self.size = int(np.prod(self.shape))
    self.reads = 0

  def astype(self, dtype) -> "LazyTensor":
    """The same tensor, cast to ``dtype`` when read."""
    return LazyTensor(self._tensors, self.name, self.transposed, dtype)

  def __array__(self, dtype=None, copy=None):
    del copy  # A read is always a new array.
    self.reads += 1
    value = self._tensors.read(self.name)
    finite = np.isfinite(value) if value.dtype.kind in "fc" else None
    if finite is not None and not finite.all():
      bad = int(value.size - finite.sum())
      raise UsageError(
        f"{PREFIX}{self._tensors.path}: tensor {self.name!r} holds {bad} "
        "NaN or infinite values: the file is damaged, or the training that "
        "wrote it diverged; use another checkpoint"
      )
    value = value.T if self.transposed else value
    return np.asarray(value, dtype=dtype or self.dtype)

  def __repr__(self):
    return f"LazyTensor({self.name!r}, {self.shape}, {self.dtype})"


class LazyStack:
  """Per-layer checkpoint tensors stacked on a new leading axis when
  read (a scanned model's stacked leaf from ``h.0...``, ``h.1...``): a
  ``LazyTensor`` whose shape is (layers, *a layer's shape)."""

  def __init__(self, rows: list[LazyTensor], dtype=None):
    self.rows = rows
    self.shape = (len(rows), *rows[0].shape)
    self.dtype = np.dtype(dtype or rows[0].dtype)
    self.ndim = len(self.shape)
    self.size = int(np.prod(self.shape))
    self.name = rows[0].name

  @property
  def reads(self) -> int:
    return sum(row.reads for row in self.rows)

  def astype(self, dtype) -> "LazyStack":
    """The same stack, cast to ``dtype`` when read."""
    return LazyStack(self.rows, dtype)

  def __getitem__(self, rows: slice) -> "LazyStack":
    """Rows ``rows`` (a slice), still unread: a stage reads only its own
    layers."""
    if not isinstance(rows, slice) or rows.step not in (None, 1):
      raise TypeError(f"a LazyStack takes a slice of rows, got {rows!r}")
    picked = self.rows[rows]
    if not picked:
      raise IndexError(f"{rows!r} selects no row of {len(self.rows)}")
    return LazyStack(picked, self.dtype)

  def __array__(self, dtype=None, copy=None):
    del copy  # A read is always a new array.
    return np.stack(
      [np.asarray(r, dtype=dtype or self.dtype) for r in self.rows]
    )

  def __repr__(self):
    return f"LazyStack({self.name!r}.., {self.shape}, {self.dtype})"


# Buffers a PyTorch model saves beside its weights (GPT-2's causal mask,
# BERT's position ids, BatchNorm's counter): never params.
_BUFFERS = re.compile(
  r"(\.attn\.(masked_)?bias|position_ids|num_batches_tracked)$"
)


def unused_names(leaves) -> list[str]:
  """The tensors of the checkpoint ``leaves`` (params' leaves, some of
  them ``params``' lazy tensors) came from that none of them reads,
  buffers aside: a checkpoint of a bigger model (more layers), or a head
  this model lacks."""
  used, checkpoint = set(), None
  for leaf in leaves:
    for row in getattr(leaf, "rows", [leaf]):
      if isinstance(row, LazyTensor):
        used.add(row.name)
        checkpoint = row._tensors
  if checkpoint is None:
    return []
  return [
    n for n in checkpoint.names() if n not in used and not _BUFFERS.search(n)
  ]


def params(path: str, names: dict) -> dict:
  """``{our path: LazyTensor}`` of the checkpoint at ``path`` by the model's
  name map (our path -> (a name, or names tried in order; transposed), or
  for a scanned model's stacked leaf (a list of such names, one per row;
  transposed): a ``LazyStack`` of them, whose rows must share a shape); a
  UsageError naming the first name the checkpoint lacks. Names the map
  does not use (e.g. HuggingFace's tied copies
  ``encoder.embed_tokens.weight``) are ignored."""
  tensors = open_checkpoint(path)
  have = set(tensors.names())

  def lazy(ours, candidates, transposed):
    if isinstance(candidates, str):
      candidates = (candidates,)
    found = [n for n in candidates if n in have]
    if not found:
      raise UsageError(
        f"{PREFIX}{path} has no tensor {candidates[0]!r} (for {ours!r}); is "
        "it a checkpoint of this architecture and version? It has e.g. "
        f"{sorted(have)[:3]}"
      )
    return LazyTensor(tensors, found[0], transposed)

  out = {}
  for ours, (candidates, transposed) in names.items():
    if not isinstance(candidates, list):
      out[ours] = lazy(ours, candidates, transposed)
      continue
    rows = [lazy(ours, c, transposed) for c in candidates]
    odd = next((r for r in rows if r.shape != rows[0].shape), None)
    if odd is not None:
      raise UsageError(
        f"{PREFIX}{path}: {odd.name!r} has shape {odd.shape} but "
        f"{rows[0].name!r} {rows[0].shape}: the layers stacked into "
        f"{ours!r} must share one shape"
      )
    out[ours] = LazyStack(rows)
  return out
