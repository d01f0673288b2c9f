"""``init_from`` files are checked as they are read: a damaged Flax
msgpack file or orbax checkpoint, or a path of the wrong kind, is a
one-line error naming the file, the array where known, and the fix
(issue 68, 1)."""

import glob
import os

import flax.serialization
import jax
import jax.numpy as jnp
import msgpack
import numpy as np
import orbax.checkpoint as ocp
import pytest

from jpipe.train import pretrained
from jpipe.train.checkpoint import checksums
from jpipe.train.errors import CheckpointError, PretrainedError

PARAMS = {
  "params": {
    "dense": {
      "kernel": np.arange(6, dtype=np.float32).reshape(2, 3),
      "bias": np.zeros(3, np.float32),
    }
  }
}


def _refused(source, match, kind=PretrainedError):
  with pytest.raises(kind, match=match) as err:
    pretrained.load_params(str(source), PARAMS)
  assert "\n" not in str(err.value)  # One line.
  return str(err.value)


def _retyped(record: bytes, shape=None, dtype=None, data=None) -> bytes:
  """A Flax array record with its shape, dtype name or bytes replaced."""
  old = msgpack.unpackb(record, raw=True)
  new = [old[0] if shape is None else shape, dtype or old[1], data or old[2]]
  return msgpack.packb(new, use_bin_type=True)


def _tampered(**change) -> bytes:
  """PARAMS as Flax writes them, the kernel's record changed."""
  tree = msgpack.unpackb(flax.serialization.to_bytes(PARAMS), raw=False)
  dense = tree["params"]["dense"]
  dense["kernel"] = msgpack.ExtType(1, _retyped(dense["kernel"].data, **change))
  return msgpack.packb(tree, use_bin_type=True)


def test_a_sound_msgpack_file_loads_as_flax_wrote_it(tmp_path, monkeypatch):
  path = tmp_path / "flax_model.msgpack"
  path.write_bytes(flax.serialization.to_bytes(PARAMS))
  loaded = pretrained.load_params(str(path), PARAMS)
  np.testing.assert_array_equal(
    loaded["params"]["dense"]["kernel"], PARAMS["params"]["dense"]["kernel"]
  )
  # Arrays over Flax's chunk size are written in chunks: read back whole.
  monkeypatch.setattr(flax.serialization, "MAX_CHUNK_SIZE", 8)
  path.write_bytes(flax.serialization.to_bytes(PARAMS))
  assert b"__msgpack_chunked_array__" in path.read_bytes()
  loaded = pretrained.load_params(str(path), PARAMS)
  np.testing.assert_array_equal(
    loaded["params"]["dense"]["kernel"], PARAMS["params"]["dense"]["kernel"]
  )


GOOD = flax.serialization.to_bytes(PARAMS)


@pytest.mark.parametrize(
  "data, match",
  [
    (b"", r"is empty \(0 bytes\); re-download or re-save it"),
    (GOOD[:-20], r"is cut short: it ends inside a value at \d+ bytes"),
    (GOOD + b"junk", r"4 of its \d+ bytes follow the first msgpack value"),
    (b"\x01", r"holds a msgpack int, not a map of params"),
    (msgpack.packb([1.0, 2.0]), r"holds a msgpack list, not a map"),
    (
      _tampered(shape=[2, 4]),
      r"damaged at 'params/dense/kernel': shape \(2, 4\) float32 needs 32 "
      r"bytes, its record holds 24",
    ),
    (
      _tampered(data=b"\x00" * 23),
      r"'params/dense/kernel': shape \(2, 3\) float32 needs 24 bytes, its "
      r"record holds 23",
    ),
    (_tampered(shape=[-1, 3]), r"'params/dense/kernel': its array record"),
    (_tampered(dtype=b"floot32"), r"its dtype 'floot32' is unknown"),
    (_tampered(dtype=b"object"), r"its dtype 'object' is unknown"),
  ],
  ids=[
    "empty",
    "truncated",
    "trailing",
    "a number",
    "a list",
    "shape",
    "bytes",
    "negative",
    "dtype",
    "object",
  ],
)
def test_a_damaged_msgpack_file_is_one_line(tmp_path, data, match):
  """Each was a reshape or msgpack error naming no array, or (a number, a
  list) "params ... have no 'params/dense/bias'"; a shape of -1 loaded."""
  path = tmp_path / "flax_model.msgpack"
  path.write_bytes(data)
  assert str(path) in _refused(path, match)


def test_a_damaged_chunked_array_is_one_line(tmp_path, monkeypatch):
  monkeypatch.setattr(flax.serialization, "MAX_CHUNK_SIZE", 8)
  tree = msgpack.unpackb(flax.serialization.to_bytes(PARAMS), raw=False)
  kernel = tree["params"]["dense"]["kernel"]
  assert kernel["__msgpack_chunked_array__"]
  del kernel["chunks"][str(len(kernel["chunks"]) - 1)]  # Its last chunk.
  path = tmp_path / "chunked.msgpack"
  path.write_bytes(msgpack.packb(tree, use_bin_type=True))
  _refused(path, r"'params/dense/kernel': shape \(2, 3\) needs 6 values")


def _orbax(path):
  checkpointer = ocp.StandardCheckpointer()
  checkpointer.save(path, PARAMS)
  checkpointer.wait_until_finished()
  return path


def _cut(pattern, size):
  for name in glob.glob(pattern):
    with open(name, "r+b") as f:
      f.truncate(size)


def test_a_damaged_orbax_checkpoint_is_one_line_naming_the_array(tmp_path):
  """Was "is not an orbax checkpoint of params" with tensorstore's
  1,300-character spec; now a damaged checkpoint, its array and cause, a
  CheckpointError (the CLI ends at once: no late-read tracebacks)."""
  path = _orbax(tmp_path / "orbax")
  _cut(str(path / "d" / "*"), 100)
  message = _refused(
    path,
    r"orbax is a damaged orbax checkpoint \(array 'params\.dense\.\w+': "
    r"OUT_OF_RANGE: Requested byte range .* of size 100\): its files "
    "changed",
    CheckpointError,
  )
  assert len(message) < 400 and "tensorstore_spec" not in message
  _cut(str(path / "_METADATA"), 0)
  _refused(path, r"damaged orbax checkpoint \(JSONDecodeError: Expecting")


def test_a_path_of_the_wrong_kind_says_what_to_give(tmp_path):
  (tmp_path / "hf").mkdir()
  (tmp_path / "hf" / "flax_model.msgpack").write_bytes(GOOD)
  _refused(
    tmp_path / "hf",
    r"hf is not an orbax checkpoint \(it has no _METADATA\) but "
    r"flax_model.msgpack: give \S*hf/flax_model.msgpack",
  )
  (tmp_path / "hf" / "model.safetensors").write_bytes(b"")
  os.remove(tmp_path / "hf" / "flax_model.msgpack")
  _refused(tmp_path / "hf", r"but safetensors files: give hf:\S*hf;")
  _refused(
    tmp_path / "hf" / "model.safetensors",
    r"model.safetensors is a safetensors file: give hf:\S*model.safetensors",
  )
  (tmp_path / "work" / "checkpoints").mkdir(parents=True)
  _refused(
    tmp_path / "work",
    r"work is a jpipe workdir without a checkpoint \(\S*checkpoints holds "
    r"no step\); train it until it saves one",
  )
  _refused(tmp_path / "work" / "checkpoints", r"no _METADATA")


def test_integers_for_a_float_param_are_refused_as_quantized():
  """An int8 tensor (a quantized checkpoint, its scales elsewhere) was
  cast to float32 silently: weights 127x too large. Float widths cast."""
  quantized = {"params": {"dense": dict(PARAMS["params"]["dense"])}}
  quantized["params"]["dense"]["kernel"] = np.ones((2, 3), np.int8)
  with pytest.raises(
    PretrainedError,
    match=r"'params/dense/kernel' is int8, the model's float32: a quantized",
  ):
    pretrained.load_params(quantized, PARAMS)
  halves = jax.tree.map(lambda a: a.astype(jnp.bfloat16), PARAMS)
  loaded = pretrained.load_params(halves, PARAMS)
  assert loaded["params"]["dense"]["kernel"].dtype == np.float32
  np.testing.assert_array_equal(
    loaded["params"]["dense"]["kernel"], PARAMS["params"]["dense"]["kernel"]
  )


def test_a_workdir_whose_newest_checkpoint_is_empty_names_the_one_before(
  tmp_path,
):
  """A save cut short left checkpoints/2 empty: the error names it and
  the intact checkpoint before it (it said "not an orbax checkpoint; give
  a jpipe workdir", which it was)."""
  manager = ocp.CheckpointManager(str(tmp_path / "work" / "checkpoints"))
  manager.save(
    1,
    args=ocp.args.Composite(
      state=ocp.args.StandardSave(PARAMS),
      meta=ocp.args.JsonSave({"step": 1, "checksums": checksums(PARAMS)}),
    ),
  )
  manager.wait_until_finished()
  manager.close()
  (tmp_path / "work" / "checkpoints" / "2").mkdir()
  _refused(
    tmp_path / "work",
    r"checkpoints/2 is an incomplete checkpoint \(no state in it.*\)\. The "
    r"checkpoint before it: init_from=\S*work/checkpoints/1$",
  )
  before = pretrained.load_params(
    str(tmp_path / "work" / "checkpoints" / "1"), PARAMS
  )
  np.testing.assert_array_equal(
    before["params"]["dense"]["kernel"], PARAMS["params"]["dense"]["kernel"]
  )
