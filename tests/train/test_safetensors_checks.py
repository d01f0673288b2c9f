"""A safetensors file is checked before anything is read from it: each
damage a one-line error naming the file and the tensor (issue 68, 1)."""

import json

import numpy as np
import pytest

from jpipe.train import hf_checkpoint
from jpipe.train.errors import UsageError

A = np.arange(6, dtype=np.float32).reshape(2, 3)
B = np.arange(4, dtype=np.int32) - 2


def _write(path, tensors, *, header=None, data=None, header_size=None):
  """A safetensors file as the format defines it (an 8-byte little-endian
  header size, a JSON header, the data); ``header`` / ``data`` /
  ``header_size`` replace what ``tensors`` would give (to damage it)."""
  if header is None:
    header, offset = {"__metadata__": {"format": "pt"}}, 0
    for name, array in tensors.items():
      dtype = {"float32": "F32", "int32": "I32"}[str(array.dtype)]
      end = offset + array.nbytes
      header[name] = {
        "dtype": dtype,
        "shape": list(array.shape),
        "data_offsets": [offset, end],
      }
      offset = end
  if data is None:
    data = b"".join(a.tobytes() for a in tensors.values())
  text = json.dumps(header).encode()
  text += b" " * (-len(text) % 8)
  size = len(text) if header_size is None else header_size
  with open(path, "wb") as f:
    f.write(size.to_bytes(8, "little") + text + data)
  return header


def _refused(path, match):
  with pytest.raises(UsageError, match=match) as err:
    hf_checkpoint.Safetensors(str(path))
  assert "\n" not in str(err.value)  # One line.
  assert str(path) in str(err.value)


def test_a_sound_file_reads_back_each_tensor(tmp_path):
  path = tmp_path / "model.safetensors"
  _write(path, {"a": A, "b": B})
  tensors = hf_checkpoint.Safetensors(str(path))
  assert tensors.names() == ["a", "b"]
  np.testing.assert_array_equal(tensors.read("a"), A)
  np.testing.assert_array_equal(tensors.read("b"), B)
  # A zero-size tensor shares no byte with its neighbours.
  _write(path, {"a": A, "empty": np.zeros((0, 3), np.float32), "b": B})
  assert hf_checkpoint.Safetensors(str(path)).shape("empty") == (0, 3)


def test_overlapping_tensors_are_refused_not_loaded(tmp_path):
  """The one a new user met: b's range overlaps a's, so b would load
  a's bytes (and the run would train on them without a word)."""
  path = tmp_path / "model.safetensors"
  header = _write(path, {"a": A, "b": B})
  header["b"]["data_offsets"] = [8, 24]  # Inside a's [0, 24).
  _write(path, {"a": A, "b": B}, header=header)
  _refused(path, "tensors 'a' and 'b' overlap")


def test_a_range_other_than_shape_times_dtype_is_refused(tmp_path):
  path = tmp_path / "model.safetensors"
  header = _write(path, {"a": A, "b": B})
  header["a"]["shape"] = [3, 3]  # 36 bytes, its range holds 24.
  _write(path, {"a": A, "b": B}, header=header)
  _refused(path, r"tensor 'a': its bytes \[0, 24\) are not its shape")


def test_a_truncated_file_is_refused_at_open(tmp_path):
  path = tmp_path / "model.safetensors"
  _write(path, {"a": A, "b": B})
  whole = path.read_bytes()
  path.write_bytes(whole[:-8])  # The download stopped early.
  _refused(path, "tensor 'b'.* end past the file's 32 bytes of data")


def test_a_header_length_beyond_the_file_is_refused_unread(tmp_path):
  """A header size of 2^60 (or a file that is not safetensors at all)
  is refused before reading: not a MemoryError."""
  path = tmp_path / "model.safetensors"
  _write(path, {"a": A}, header_size=2**60)
  _refused(path, "not a safetensors file .*header claims 1152921504606846976")
  text = tmp_path / "notes.safetensors"
  text.write_text("these are notes, not weights\n" * 4)
  _refused(text, "not a safetensors file")


def test_malformed_entries_are_named(tmp_path):
  path = tmp_path / "model.safetensors"
  header = _write(path, {"a": A})
  header["a"] = {"dtype": "F32", "shape": [2, 3]}
  _write(path, {"a": A}, header=header)
  _refused(path, "tensor 'a' has no dtype / shape / data_offsets")
  header["a"] = {"dtype": "F32", "shape": [2, -3], "data_offsets": [0, 24]}
  _write(path, {"a": A}, header=header)
  _refused(path, "tensor 'a': shape")
  header["a"] = {"dtype": "C64", "shape": [2, 3], "data_offsets": [0, 24]}
  _write(path, {"a": A}, header=header)
  _refused(path, "dtype C64, which jpipe does not read")


def test_an_index_naming_a_missing_shard_is_one_line(tmp_path):
  index = {"weight_map": {"a": "model-00001-of-00002.safetensors"}}
  (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
  with pytest.raises(UsageError, match="not a safetensors file .*No such file"):
    hf_checkpoint.Safetensors(str(tmp_path))


@pytest.mark.parametrize(
  "text, match",
  [
    ('{"weight_map": {"a": "model-0', "JSONDecodeError"),  # Cut short.
    ('{"weights": {}}', "KeyError: 'weight_map'"),
    ("[1, 2]", "TypeError"),
    ('{"weight_map": {"a": 3}}', "its weight_map is not"),
    ('{"weight_map": {"a": "../model.safetensors"}}', "outside its directory"),
  ],
)
@pytest.mark.parametrize(
  "index, reader",
  [
    ("model.safetensors.index.json", hf_checkpoint.Safetensors),
    ("flax_model.msgpack.index.json", hf_checkpoint.FlaxMsgpack),
  ],
)
def test_a_damaged_index_is_one_line_naming_it(
  tmp_path, text, match, index, reader
):
  """A sharded checkpoint's index that is not ``{"weight_map": {tensor:
  shard file}}``: one line naming the index, before any shard is read."""
  (tmp_path / index).write_text(text)
  with pytest.raises(UsageError, match=match) as err:
    reader(str(tmp_path))
  assert "\n" not in str(err.value)
  assert str(tmp_path / index) in str(err.value)


def _sharded(directory, shards: dict, weight_map: dict):
  """Safetensors shards ({file: tensors}) and their index."""
  for file, tensors in shards.items():
    _write(directory / file, tensors)
  index = directory / "model.safetensors.index.json"
  index.write_text(json.dumps({"weight_map": weight_map}))


def test_each_tensor_is_read_from_the_shard_its_index_names(tmp_path):
  """A stale copy of a tensor in another shard is not read (the index is
  the checkpoint's word); a tensor no index entry names is not used; a
  shard missing a tensor its index puts there is refused."""
  one, two = (
    "model-00001-of-00002.safetensors",
    "model-00002-of-00002.safetensors",
  )
  _sharded(
    tmp_path, {one: {"a": A}, two: {"a": A + 7, "b": B}}, {"a": one, "b": two}
  )
  tensors = hf_checkpoint.Safetensors(str(tmp_path))
  np.testing.assert_array_equal(tensors.read("a"), A)  # Not shard 2's.
  assert tensors.names() == ["a", "b"]
  _sharded(tmp_path, {one: {"b": B}, two: {"a": A}}, {"a": one, "b": one})
  _refused(tmp_path, f"the index names 'a' in {one}, which does not hold it")


def test_a_single_file_beside_an_index_is_the_one_read(tmp_path):
  """As ``from_pretrained`` looks: model.safetensors first."""
  one = "model-00001-of-00001.safetensors"
  _sharded(tmp_path, {one: {"a": A + 1}}, {"a": one})
  _write(tmp_path / "model.safetensors", {"a": A})
  np.testing.assert_array_equal(
    hf_checkpoint.Safetensors(str(tmp_path)).read("a"), A
  )


def test_a_tensor_with_nan_or_inf_is_refused_when_read(tmp_path):
  path = tmp_path / "model.safetensors"
  bad = A.copy()
  bad[1, 2], bad[0, 0] = np.nan, np.inf
  _write(path, {"a": bad, "b": B})
  tensors = hf_checkpoint.Safetensors(str(path))
  assert int(np.asarray(hf_checkpoint.LazyTensor(tensors, "b", False))[0]) == -2
  with pytest.raises(UsageError, match="tensor 'a' holds 2 NaN or infinite"):
    np.asarray(hf_checkpoint.LazyTensor(tensors, "a", False))


@pytest.mark.parametrize("tree", [[1, 2], 3])
def test_a_msgpack_of_no_named_arrays_is_one_line(tmp_path, tree):
  from flax import serialization

  path = tmp_path / "model.msgpack"
  path.write_bytes(serialization.msgpack_serialize(tree))
  with pytest.raises(UsageError, match="not a Flax msgpack checkpoint"):
    hf_checkpoint.FlaxMsgpack(str(path))
