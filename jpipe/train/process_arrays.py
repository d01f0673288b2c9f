"""A checkpoint item each process writes its own part of: the arrays it holds.

A pipeline across processes keeps each stage's state only in the process
that runs the stage. Gathering it to one process before a save (orbax's
``StandardSave`` of host arrays) would need the whole training state in
one host's memory; this item instead has every process write the leaves
it holds, one array at a time, as ``.npy`` files (``p<process>_<n>.npy``)
with an index ``index_p<process>.json``: per leaf its global path (the
``jax.tree_util.keystr`` of the state dict), its keys (to rebuild the tree
without a template), shape, dtype and CRC-32. A restore reads the indexes
(small) and only the leaves the restoring process needs; any process
count or partition can read it. orbax's ``CheckpointManager`` still owns
the step directory: its temporary name, the rename when every process
has finished, rotation and the barriers between processes.

A leaf held by another process is given as a ``jax.ShapeDtypeStruct``
(``write_arrays`` skips it); ``read_arrays`` returns the template's
``ShapeDtypeStruct`` for a leaf not needed here. A scanned model's
stacked leaf whose rows (layers) are on stages of several processes is
given as ``jpipe.runtime.HeldRows``: each process writes its rows, the
index entry lists the pieces (``"pieces": [{"rows": [a, b], "file",
"crc32"}]``, rows a..b-1 on the leaf's layer axis ``"axis"``, 0 when
absent; a nested scan's leaf, whose rows index its leading axes
``"layers"`` ``[a, b]``, has them as ``[rows, ...]``, row ``i * b + j``
the layer ``[i, j]``), and a read joins them, checking every row is there
once.
"""

import dataclasses
import glob
import json
import os
import zlib
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp

from jpipe.runtime import HeldRows

__all__ = [
  "ProcessArraysRestore",
  "ProcessArraysSave",
  "SavedLeaf",
  "read_arrays",
  "read_tree",
  "write_arrays",
]

ITEM = "arrays"  # The item's name in a step directory.


def write_arrays(directory: str, process: int, tree: Any) -> None:
  """Writes ``tree``'s leaves held here (all but ``ShapeDtypeStruct``
  ones) and this process's index into ``directory``."""
  os.makedirs(directory, exist_ok=True)
  index = {}
  flat = jax.tree_util.tree_flatten_with_path(tree)[0]
  for n, (path, leaf) in enumerate(flat):
    if isinstance(leaf, jax.ShapeDtypeStruct):
      continue  # Another process holds it and writes it.
    entry = {"keys": [_key(k) for k in path]}
    if isinstance(leaf, HeldRows):  # Rows of a leaf several processes hold.
      entry |= {"shape": list(leaf.aval.shape), "dtype": str(leaf.aval.dtype)}
      entry["axis"] = leaf.axis
      if leaf.layers:  # (Rows of the leading axes, merged.)
        entry["layers"] = list(leaf.layers)
      entry["pieces"] = [
        {"rows": [a, a + len(rows)]}
        | _write(
          directory,
          f"p{process}_{n}_{a}.npy",
          # (The leaf's layout; merged leading axes stay rows.)
          rows if leaf.layers else np.moveaxis(rows, 0, leaf.axis),
        )
        for a, rows in leaf.pieces
      ]
    else:  # One leaf on the host at a time.
      host = np.require(jax.device_get(leaf), requirements="C")  # (0-d kept)
      if host.dtype == object:
        raise TypeError(
          f"{jax.tree_util.keystr(path)} is a {type(leaf).__name__}, not "
          "an array: a checkpoint holds arrays"
        )
      entry |= _write(directory, f"p{process}_{n}.npy", host)
      del host
    index[jax.tree_util.keystr(path)] = entry
  with open(os.path.join(directory, f"index_p{process}.json"), "w") as f:
    json.dump(index, f)


def _write(directory: str, name: str, host: np.ndarray) -> dict:
  """Writes one host array as ``name``; its index fields (file, shape,
  dtype, CRC-32)."""
  host = np.require(host, requirements="C")
  # .npy has no bfloat16 / float8: such leaves go as unsigned integers
  # of their width, their dtype in the index.
  stored = (
    host.view(f"u{host.dtype.itemsize}") if host.dtype.kind == "V" else host
  )
  np.save(os.path.join(directory, name), stored, allow_pickle=False)
  return {
    "file": name,
    "shape": list(host.shape),
    "dtype": str(host.dtype),
    "crc32": _crc32(host),
  }


def _key(k) -> str | int:
  """A path entry as a JSON value (a dict key, a sequence index or a
  named tuple's field)."""
  for attr in ("key", "idx", "name"):
    if hasattr(k, attr):
      return getattr(k, attr)
  return str(k)


def _crc32(array: np.ndarray) -> str:
  """The CRC-32 (hex) of a C-contiguous array's bytes, read in place (no
  copy: a leaf may be big)."""
  return format(zlib.crc32(array.reshape(-1).view(np.uint8)), "08x")


def read_index(directory: str) -> dict[str, dict]:
  """Every process's index merged: ``{path: entry}``. A ValueError names
  an unreadable index or a leaf two processes both wrote."""
  names = sorted(glob.glob(os.path.join(directory, "index_p*.json")))
  if not names:
    raise ValueError(f"{directory} has no index_p*.json (an incomplete save)")
  merged: dict[str, dict] = {}
  for name in names:
    try:
      with open(name) as f:
        index = json.load(f)
    except (OSError, ValueError) as e:
      raise ValueError(f"{name} is unreadable ({e})") from e
    for path, entry in index.items():
      if path in merged and "pieces" in entry and "pieces" in merged[path]:
        if _without_pieces(entry) != _without_pieces(merged[path]):
          raise ValueError(
            f"{path}'s rows are described differently by {name} and "
            "another index (shape, dtype or layer axes): a mixed save"
          )
        pieces = merged[path]["pieces"] + entry["pieces"]
        merged[path] = dict(entry, pieces=pieces)  # Rows of several.
      elif path in merged:
        raise ValueError(f"{path} is written twice ({name} and another index)")
      else:
        merged[path] = entry
  return merged


def _without_pieces(entry: dict) -> dict:
  return {k: v for k, v in entry.items() if k != "pieces"}


def read_leaf(directory: str, path: str, entry: dict) -> np.ndarray:
  """One saved leaf, checked against its index entry (shape, dtype,
  CRC-32; a leaf written in rows by several processes: every row once);
  a ValueError names the file and the leaf."""
  if "pieces" not in entry:
    return _read_file(directory, path, entry, entry["shape"])
  shape, dtype = entry["shape"], jax.numpy.dtype(entry["dtype"])
  axis = entry.get("axis", 0)
  whole, layers = shape, entry.get("layers", [])
  if layers:  # The rows of the leading axes: [rows, ...] until the end.
    if list(layers) != list(shape[: len(layers)]) or axis != 0:
      raise ValueError(
        f"{path}'s index entry is damaged: its rows' axes {layers} (at "
        f"axis {axis}) do not lead its shape {shape}"
      )
    shape = [int(np.prod(layers)), *shape[len(layers) :]]
  value, row = np.empty(shape, dtype), 0
  for piece in sorted(entry["pieces"], key=lambda p: p["rows"]):
    a, b = piece["rows"]
    if a != row:
      raise ValueError(
        f"{path}'s rows {min(a, row)}..{max(a, row) - 1} are "
        f"{'in no' if a > row else 'in two'} processes' files: an "
        "incomplete or mixed save"
      )
    part = [*shape[:axis], b - a, *shape[axis + 1 :]]
    value[(slice(None),) * axis + (slice(a, b),)] = _read_file(
      directory, path, piece, part
    )
    row = b
  if row != shape[axis]:
    raise ValueError(
      f"{path}'s rows {row}..{shape[axis] - 1} are in no process's files: an "
      "incomplete save"
    )
  return value.reshape(whole)


def _read_file(directory: str, path: str, entry: dict, shape) -> np.ndarray:
  """One saved array, checked: ``shape``, the entry's dtype and CRC-32."""
  where = os.path.join(directory, entry["file"])
  try:
    stored = np.load(where, allow_pickle=False)
    dtype = jax.numpy.dtype(entry["dtype"])
    value = stored.view(dtype) if dtype.kind == "V" else stored
  except (OSError, ValueError, TypeError, EOFError) as e:
    raise ValueError(f"{where} ({path}) is unreadable ({e})") from e
  if list(value.shape) != list(shape) or str(value.dtype) != entry["dtype"]:
    raise ValueError(
      f"{where} ({path}) holds {value.dtype}{list(value.shape)}, its index "
      f"says {entry['dtype']}{list(shape)}"
    )
  if _crc32(value) != entry["crc32"]:
    raise ValueError(
      f"{where} fails its checksum at {path}: its files changed after they "
      f"were written (disk or copy damage)"
    )
  return value


# A leaf of this many bytes or more is checked when read, then read again
# where it is placed (``SavedLeaf``): a restore holds one on the host at
# a time. Smaller ones stay read.
LAZY_BYTES = 2**20


class SavedLeaf:
  """A saved leaf, already checked, read again when converted
  (``np.asarray``): restoring a stage's state places one leaf at a time
  instead of holding all of them on the host first."""

  def __init__(self, directory: str, path: str, entry: dict):
    self.directory, self.path, self.entry = directory, path, entry
    self.shape = tuple(entry["shape"])
    self.dtype = jax.numpy.dtype(entry["dtype"])

  def __array__(self, dtype=None, copy=None):
    del copy  # Always a new array.
    value = read_leaf(self.directory, self.path, self.entry)
    return value if dtype is None else value.astype(dtype)

  def __repr__(self) -> str:
    return f"SavedLeaf({self.path}: {self.dtype}{list(self.shape)})"


def _checked(directory: str, path: str, entry: dict):
  """The leaf (read and checked), or a ``SavedLeaf`` of it when big."""
  value = read_leaf(directory, path, entry)
  if value.nbytes < LAZY_BYTES:
    return value
  del value  # Checked; read again where it is placed.
  return SavedLeaf(directory, path, entry)


def read_arrays(directory: str, template: Any, needed: Any) -> Any:
  """``template``'s structure with each needed leaf read from the files
  (checked: its shape against the template's, its checksum; a big one as
  a ``SavedLeaf``) and the template's leaf elsewhere. ``needed``:
  booleans in ``template``'s structure.

  Leaves under a ``"gap_aware"`` statistics dict that were not saved (no
  Gap-Aware stage held them) are left out, as a fresh state starts them.
  """
  index = read_index(directory)
  flat, treedef = jax.tree_util.tree_flatten_with_path(template)
  wants = jax.tree.leaves(needed)
  leaves = []
  for (path, aval), want in zip(flat, wants, strict=True):
    name = jax.tree_util.keystr(path)
    entry = index.get(name)
    if entry is None:
      if want and not name.startswith(_GAP):
        raise ValueError(
          f"the checkpoint has no {name}: saved for another model"
        )
      leaves.append(aval)  # (Gap-Aware statistics: dropped below.)
      continue
    if entry is not None and list(entry["shape"]) != list(aval.shape):
      raise ValueError(
        f"saved {name} has shape {tuple(entry['shape'])}, the model needs "
        f"{tuple(aval.shape)}: saved for another model"
      )
    leaves.append(_checked(directory, name, entry) if want else aval)
  tree = jax.tree_util.tree_unflatten(treedef, leaves)
  if isinstance(tree, dict) and tree.get("gap_aware"):
    tree["gap_aware"] = _without_avals(tree["gap_aware"])
  return tree


_GAP = "['gap_aware']"


def _without_avals(node):
  """``node``'s dicts without their ``ShapeDtypeStruct`` entries: Gap-Aware
  statistics not read here start fresh (``select_optimizer_states``)."""
  if not isinstance(node, dict):
    return node
  return {
    k: _without_avals(v)
    for k, v in node.items()
    if not isinstance(v, jax.ShapeDtypeStruct)
  }


def read_tree(directory: str) -> dict:
  """Every saved leaf in nested dicts and lists by its saved keys (named
  tuples as dicts of their fields), without a template."""
  root: dict = {}
  for path, entry in read_index(directory).items():
    node, keys = root, entry["keys"]
    for k in keys[:-1]:
      node = node.setdefault(k, {})
    node[keys[-1]] = read_leaf(directory, path, entry)
  return _lists(root)


def _lists(node):
  """Dicts keyed 0..n-1 (a sequence's entries) as lists."""
  if not isinstance(node, dict):
    return node
  node = {k: _lists(v) for k, v in node.items()}
  if node and all(isinstance(k, int) for k in node):
    return [node[i] for i in sorted(node)]
  return node


class ProcessArraysHandler(ocp.CheckpointHandler):
  """orbax's handler of the item: ``write_arrays`` / ``read_arrays`` in
  this process."""

  def save(self, directory, args: "ProcessArraysSave"):
    write_arrays(os.fspath(directory), jax.process_index(), args.tree)

  def restore(self, directory, args: "ProcessArraysRestore"):
    return read_arrays(os.fspath(directory), args.template, args.needed)

  def metadata(self, directory):
    return None


@ocp.args.register_with_handler(ProcessArraysHandler, for_save=True)
@dataclasses.dataclass
class ProcessArraysSave(ocp.args.CheckpointArgs):
  """Save: a pytree, leaves held elsewhere as ``jax.ShapeDtypeStruct``."""

  tree: Any


@ocp.args.register_with_handler(ProcessArraysHandler, for_restore=True)
@dataclasses.dataclass
class ProcessArraysRestore(ocp.args.CheckpointArgs):
  """Restore: the wanted structure (``ShapeDtypeStruct`` leaves) and,
  in its structure, whether this process needs each leaf."""

  template: Any
  needed: Any
