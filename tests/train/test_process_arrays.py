"""Checkpoints written per process (issue 68, item 4): each process writes
the leaves it holds, a restore reads only the leaves it needs, every
damage is a one-line error naming the file and the leaf; a pipeline's
own part of its state dict is the gathered state dict's, leaf for leaf."""

import functools
import json
import os
from typing import NamedTuple

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import optax
import pytest

import jpipe
from jpipe.runtime import _stacked
from jpipe.train import checkpoint, process_arrays
from tests.partition import flax_models, scan_models
from tests.tiers import slow


class _Moments(NamedTuple):
  count: np.ndarray
  mu: dict


def _state():
  return {
    "params": {"a": np.arange(6, dtype=np.float32).reshape(2, 3)},
    "opt_state": (
      _Moments(np.int32(7), {"a": np.full((2, 3), 0.5, np.float32)}),
    ),
    "half": np.arange(4).astype(ml_dtypes.bfloat16),
    "step": np.int64(3),
  }


def _held_by(tree, process):
  """``tree`` as process 0 or 1 passes it: "params" and "step" are
  process 0's, the rest process 1's (abstract elsewhere)."""

  def part(path, leaf):
    first = jax.tree_util.keystr(path[:1])
    mine = (first in ("['params']", "['step']")) == (process == 0)
    return leaf if mine else jax.ShapeDtypeStruct(np.shape(leaf), leaf.dtype)

  return jax.tree_util.tree_map_with_path(part, tree)


def _written(tmp_path):
  state = _state()
  for process in (0, 1):
    process_arrays.write_arrays(
      str(tmp_path), process, _held_by(state, process)
    )
  return state


def _abstract(tree):
  return jax.tree.map(
    lambda a: jax.ShapeDtypeStruct(np.shape(a), a.dtype), tree
  )


def _assert_equal(a, b):
  assert jax.tree.structure(a) == jax.tree.structure(b)
  for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
    assert np.asarray(x).dtype == np.asarray(y).dtype
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def test_two_processes_parts_read_back_whole_and_in_part(tmp_path):
  state = _written(tmp_path)
  # Each process wrote only its leaves.
  files = sorted(os.listdir(tmp_path))
  assert "index_p0.json" in files and "index_p1.json" in files
  assert len([f for f in files if f.endswith(".npy")]) == 5
  everything = jax.tree.map(lambda _: True, state)
  _assert_equal(
    process_arrays.read_arrays(str(tmp_path), _abstract(state), everything),
    state,
  )
  # Only the params needed: the rest stays abstract (nothing read).
  needed = jax.tree_util.tree_map_with_path(
    lambda p, _: jax.tree_util.keystr(p).startswith("['params']"), state
  )
  part = process_arrays.read_arrays(str(tmp_path), _abstract(state), needed)
  np.testing.assert_array_equal(part["params"]["a"], state["params"]["a"])
  assert isinstance(part["half"], jax.ShapeDtypeStruct)
  assert isinstance(part["opt_state"][0].mu["a"], jax.ShapeDtypeStruct)


def test_read_without_a_template_rebuilds_the_saved_keys(tmp_path):
  state = _written(tmp_path)
  tree = process_arrays.read_tree(str(tmp_path))
  np.testing.assert_array_equal(tree["params"]["a"], state["params"]["a"])
  # Named tuples as dicts of their fields, tuples as lists.
  assert int(tree["opt_state"][0]["count"]) == 7
  assert tree["half"].dtype == ml_dtypes.bfloat16


def _refused(directory, template, match):
  needed = jax.tree.map(lambda _: True, template)
  with pytest.raises(ValueError, match=match) as err:
    process_arrays.read_arrays(str(directory), _abstract(template), needed)
  assert "\n" not in str(err.value)


def _file_of(directory, path):
  index = process_arrays.read_index(str(directory))
  return os.path.join(directory, index[path]["file"])


def test_damage_is_one_line_naming_the_file_and_leaf(tmp_path):
  state = _written(tmp_path)
  name = "['opt_state'][0].mu['a']"
  where = _file_of(tmp_path, name)
  data = bytearray(open(where, "rb").read())
  data[-1] ^= 0xFF  # One bit pattern changed in the last value.
  open(where, "wb").write(bytes(data))
  _refused(tmp_path, state, r"p1_\d\.npy fails its checksum at .*mu\['a'\]")
  open(where, "wb").write(bytes(data[:-5]))  # Truncated.
  _refused(tmp_path, state, r"p1_\d\.npy \(\['opt_state'\]\[0\]\.mu\['a'\]\)")


def test_a_missing_index_a_leaf_written_twice_and_another_model_are_refused(
  tmp_path,
):
  state = _written(tmp_path)
  bigger = dict(state, params={"a": np.zeros((3, 3), np.float32)})
  _refused(tmp_path, bigger, r"saved \['params'\]\['a'\] has shape \(2, 3\)")
  more = dict(state, extra=np.zeros(2, np.float32))
  _refused(tmp_path, more, r"the checkpoint has no \['extra'\]")
  process_arrays.write_arrays(str(tmp_path), 2, {"step": np.int64(3)})
  _refused(tmp_path, state, r"\['step'\] is written twice")
  empty = tmp_path / "empty"
  empty.mkdir()
  _refused(empty, state, "has no index_p")


def test_checkpoints_save_and_restore_per_process(tmp_path):
  """Through ``Checkpoints`` (orbax's manager: its step directories and
  rotation); a damaged file is a CheckpointError naming the fix."""
  state = _state()
  saves = checkpoint.Checkpoints(str(tmp_path), keep=2)
  meta = {"step": 3, "fingerprint": {"model": "m"}}
  saves.save(3, state, meta, per_process=True)
  assert os.path.isdir(tmp_path / "checkpoints" / "3" / process_arrays.ITEM)
  needed = jax.tree.map(lambda _: True, state)
  got, saved_meta = saves.restore(_abstract(state), meta["fingerprint"], needed)
  _assert_equal(got, state)
  assert saved_meta["step"] == 3
  item = tmp_path / "checkpoints" / "3" / process_arrays.ITEM
  where = _file_of(item, "['params']['a']")
  open(where, "wb").write(open(where, "rb").read()[:-4])
  with pytest.raises(checkpoint.CheckpointError, match="delete .*checkpoints"):
    saves.restore(_abstract(state), meta["fingerprint"], needed)
  saves.close()


@pytest.mark.parametrize("gap_aware", [False, slow(True)])
def test_a_pipelines_own_part_is_its_state_dict(tmp_path, gap_aware):
  """In one process every leaf is this process's: ``local_state_dict``
  holds the gathered ``state_dict``'s values (tied weights and the
  optimizer's state, Gap-Aware's statistics included), the layout its
  shapes, all needed; written per process and read back, it loads into
  the same state."""
  loss_fn, params, batch, _ = flax_models.CASES["gpt_tied"]()
  options = {"optimizer": optax.adam(1e-2)}
  if gap_aware:
    options = {
      "optimizer": optax.sgd(0.3),
      "schedule": "async",
      "weight_stashing": True,
      "gap_aware": "ga",
      "gap_aware_options": {"optimizer": "sgd", "learning_rate": 0.3},
    }
  pipe = jpipe.Pipeline(
    loss_fn, params, batch, num_stages=2, devices=jax.devices()[:2], **options
  )
  state = pipe.init(params)
  state, _ = pipe.step(state, batch)
  state, _ = pipe.flush(state)
  whole = pipe.state_dict(state)
  own = pipe.local_state_dict(state)
  _assert_equal(jax.device_get(own), whole)
  layout, needed = pipe.state_dict_layout()
  assert jax.tree.structure(layout) == jax.tree.structure(whole)
  assert all(jax.tree.leaves(needed))
  for a, b in zip(jax.tree.leaves(layout), jax.tree.leaves(whole), strict=True):
    assert (a.shape, a.dtype) == (np.shape(b), np.asarray(b).dtype)
  process_arrays.write_arrays(str(tmp_path), 0, own)
  back = pipe.load_state_dict(
    process_arrays.read_arrays(str(tmp_path), layout, needed)
  )
  _assert_equal(pipe.state_dict(back), whole)
  assert jnp.isfinite(pipe.step(back, batch)[1]["loss"])


def _rows_of(leaf, held):
  """A stacked leaf as one process gives it: the rows ``held`` (its
  stages' layers), the others as another process's abstract values."""
  rows = [
    leaf[k] if leaf.ndim == 1 else leaf[k : k + 1] for k in range(len(leaf))
  ]
  return _stacked._join(
    [
      r if k in held else jax.ShapeDtypeStruct(np.shape(r), r.dtype)
      for k, r in enumerate(rows)
    ]
  )


def test_a_stacked_leaf_written_in_rows_by_two_processes(tmp_path):
  """A scanned model's stacked leaf whose layers sit in two processes:
  each writes its rows (pieces), a read joins them; a row in no file or
  in two is one line naming the leaf."""
  w = np.arange(24, dtype=np.float32).reshape(4, 2, 3)
  count = np.arange(4).astype(ml_dtypes.bfloat16)  # Rows of scalars.
  held = {0: (0, 3), 1: (1, 2)}  # Process 0: layers 0 and 3; 1: 1, 2.
  for process, rows in held.items():
    part = {"w": _rows_of(w, rows), "count": _rows_of(count, rows)}
    assert isinstance(part["w"], jpipe.runtime.HeldRows)
    process_arrays.write_arrays(str(tmp_path), process, part)
  want = {"w": w, "count": count}
  everything = jax.tree.map(lambda _: True, want)
  got = process_arrays.read_arrays(str(tmp_path), _abstract(want), everything)
  _assert_equal(jax.tree.map(np.asarray, got), want)
  _assert_equal(process_arrays.read_tree(str(tmp_path)), want)
  # Nothing of process 1 (rows 1, 2 missing); twice (process 2 too).
  lost = tmp_path / "lost"
  process_arrays.write_arrays(str(lost), 0, {"w": _rows_of(w, (0, 3))})
  _refused(lost, {"w": w}, r"\['w'\]'s rows 1\.\.2 are in no processes' files")
  process_arrays.write_arrays(str(tmp_path), 2, {"w": _rows_of(w, (2,))})
  _refused(tmp_path, {"w": w}, r"\['w'\]'s rows 2\.\.2 are in two")


def test_a_nested_scans_leaf_written_in_rows_by_two_processes(tmp_path):
  """A leaf ``[a, b, ...]`` of a scan in a scan, its rows (row i * b + j:
  layer [i, j]) in two processes, not whole outer rows: written as rows
  (the index names the leading axes), read back in the leaf's layout."""
  w = np.arange(24, dtype=np.float32).reshape(2, 3, 4)
  held = {0: (0, 1, 4), 1: (2, 3, 5)}  # Layers [1, 0] and [1, 2] apart.
  for process, rows in held.items():
    part = _stacked._moved(_rows_of(w.reshape(6, 4), rows), 0, (2, 3))
    assert part.aval.shape == w.shape and part.layers == (2, 3)
    process_arrays.write_arrays(str(tmp_path), process, {"w": part})
  with open(tmp_path / "index_p1.json") as f:
    entry = json.load(f)["['w']"]
  assert (entry["shape"], entry["layers"]) == ([2, 3, 4], [2, 3])
  assert [p["rows"] for p in entry["pieces"]] == [[2, 4], [5, 6]]
  got = process_arrays.read_arrays(
    str(tmp_path), _abstract({"w": w}), {"w": True}
  )
  _assert_equal(jax.tree.map(np.asarray, got), {"w": w})
  _assert_equal(process_arrays.read_tree(str(tmp_path)), {"w": w})
  # Damaged indexes, each one line: two processes' disagree; both hold
  # rows' axes that do not lead the shape.
  entry["layers"] = [3, 2]
  with open(tmp_path / "index_p1.json", "w") as f:
    json.dump({"['w']": entry}, f)
  _refused(tmp_path, {"w": w}, r"\['w'\]'s rows are described differently")
  with open(tmp_path / "index_p0.json") as f:
    first = json.load(f)
  first["['w']"]["layers"] = [3, 2]
  with open(tmp_path / "index_p0.json", "w") as f:
    json.dump(first, f)
  _refused(tmp_path, {"w": w}, r"\['w'\]'s index entry is damaged")


@pytest.mark.parametrize(
  "make, stacked, first",
  [
    pytest.param(scan_models.plain_case, ("layers", "w1"), 2, id="axis 0"),
    slow(  # (HeldRows on axis 1 alone: the test above.)
      lambda: scan_models.linen_case(scan_axis=1),
      ("params", "blocks", "Dense_0", "kernel"),
      2,
      id="axis 1",
    ),
    slow(  # Rows of [2, 4] leaves, process 1's from inside an outer row.
      lambda: scan_models.linen_case(remat_scan=(2, 4)),
      ("params", "blocks", "Block_0", "Dense_0", "kernel"),
      1,
      id="nn.remat_scan",
    ),
  ],
)
def test_a_pipelines_parts_of_a_stacked_leaf_across_processes(
  tmp_path, monkeypatch, make, stacked, first
):
  """A scanned model's 4 stages as if stages ``0..first - 1`` and the
  rest ran in two processes (``transport.leads``: the process that writes a stage):
  each process's ``local_state_dict`` holds its layers' rows of every
  stacked leaf, params and Adam's moments (layers stacked on axis 0, on
  axis 1 as MaxText stacks them, or on axes 0 and 1 by a scan in a scan);
  written per process and read back whole, they are the gathered state
  dict, and it loads."""
  loss_fn, params, batch = make()
  pipe = jpipe.Pipeline(
    loss_fn,
    params,
    batch,
    num_stages=4,
    devices=jax.devices()[:4],
    num_microbatches=2,
    optimizer=optax.adam(1e-2),
  )
  state, _ = pipe.step(pipe.init(params), batch)
  whole = pipe.state_dict(state)
  for process in (0, 1):
    mine = set(range(first)) if process == 0 else set(range(first, 4))
    monkeypatch.setattr(pipe.transport, "leads", lambda s, mine=mine: s in mine)
    part = pipe.local_state_dict(state)
    leaf = functools.reduce(lambda t, k: t[k], stacked, part["params"])
    assert isinstance(leaf, jpipe.runtime.HeldRows)
    process_arrays.write_arrays(str(tmp_path), process, part)
  monkeypatch.undo()
  layout, needed = pipe.state_dict_layout()
  back = process_arrays.read_arrays(str(tmp_path), layout, needed)
  _assert_equal(jax.tree.map(np.asarray, back), whole)
  _assert_equal(pipe.state_dict(pipe.load_state_dict(back)), whole)


def test_typed_keys_in_the_model_state_are_saved_as_their_key_data(
  tmp_path, monkeypatch
):
  """A model state holding typed PRNG keys (a key per scanned layer, split
  at every call): the state dict holds their key data (uint32 ``[...,
  2]``: a checkpoint holds arrays), as does each process's part -- the
  keys' rows from two processes' stages as ``HeldRows`` -- and the
  layout; written (per process, and whole through orbax) and read back,
  they load as keys, and the next step equals the run that never
  stopped."""
  rng = np.random.RandomState(0)
  batch = {
    "x": rng.randn(8, 6).astype(np.float32),
    "y": rng.randint(0, 3, 8).astype(np.int32),
  }
  loss_fn, params, model_state = scan_models.batch_stats_case(batch)
  pipe = jpipe.Pipeline(
    loss_fn,
    params,
    batch,
    model_state=model_state,
    num_stages=4,
    devices=jax.devices()[:4],
    num_microbatches=2,
    optimizer=optax.sgd(0.1),
  )
  state, _ = pipe.step(pipe.init(params, model_state), batch)
  whole = pipe.state_dict(state)
  keys = whole["model_state"]["batch_stats"]["layers"]["key"]
  assert (keys.dtype, keys.shape) == (np.uint32, (4, 2))  # 4 layers' keys.
  np.testing.assert_array_equal(
    keys,
    jax.random.key_data(
      pipe.gather_model_state(state)["batch_stats"]["layers"]["key"]
    ),
  )
  for process, mine in ((0, {0, 1}), (1, {2, 3})):
    monkeypatch.setattr(pipe.transport, "leads", lambda s, mine=mine: s in mine)
    part = pipe.local_state_dict(state)
    rows = part["model_state"]["batch_stats"]["layers"]["key"]
    assert isinstance(rows, jpipe.runtime.HeldRows)
    assert rows.aval.dtype == np.uint32
    process_arrays.write_arrays(str(tmp_path / "parts"), process, part)
  monkeypatch.undo()
  layout, needed = pipe.state_dict_layout()
  back = process_arrays.read_arrays(str(tmp_path / "parts"), layout, needed)
  _assert_equal(jax.tree.map(np.asarray, back), whole)
  saves = checkpoint.Checkpoints(str(tmp_path / "whole"), keep=1)
  saves.save(1, jax.tree.map(np.asarray, whole), {"fingerprint": {}})
  orbax_back, _ = saves.restore(whole, {})
  saves.close()
  continued, _ = pipe.step(state, batch)
  for saved in (back, orbax_back):
    resumed, _ = pipe.step(pipe.load_state_dict(saved), batch)
    _assert_equal(pipe.state_dict(resumed), pipe.state_dict(continued))
  wrong = jax.tree.map(lambda x: x, whole)
  wrong["model_state"]["batch_stats"]["layers"]["key"] = keys[:, :1]
  with pytest.raises(ValueError, match="PRNG key's data has shape"):
    pipe.load_state_dict(wrong)
