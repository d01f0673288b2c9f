"""PyTorch checkpoints (``pytorch_model.bin``, ``torch.save``'s zip
format) through ``hf:PATH``, read without torch and without running their
pickle: the tests' HuggingFace reference checkpoints, written as
``torch.save`` lays a state dict out (``tests/models/torch_format.py``),
load into jpipe's models and give HuggingFace's logits -- a tied head
sharing its embedding's storage, a weight stored transposed (a strided
view), shards with an index -- and a hostile or damaged file is refused
in one line, before anything is loaded."""

import io
import json
import os
import pickle
import zipfile

import numpy as np
import pytest

from jpipe.models import bert, gpt2
from jpipe.train import hf_checkpoint, torch_checkpoint, torch_pickle
from jpipe.train.errors import UsageError
from tests.models import hf_loading, torch_format
from tests.models.test_bert import BERT_TINY
from tests.models.test_gpt2 import GPT2_TINY

REFERENCE = os.path.join(os.path.dirname(__file__), "hf_reference")


def _reference_arrays(name):
  tensors = hf_checkpoint.Safetensors(os.path.join(REFERENCE, name))
  return {n: tensors.read(n) for n in tensors.names()}


def test_gpt2_from_a_legacy_pytorch_model_bin():
  """``torch.save``'s legacy format (as the Hub's 2019 GPT-2 and BERT
  files are), written by torch: ``lm_head.weight`` shares ``wte``'s
  storage, stored once."""
  directory = os.path.join(REFERENCE, "gpt2-torch-legacy")
  ref = np.load(os.path.join(REFERENCE, "gpt2", "reference.npz"))
  tensors = hf_checkpoint.open_checkpoint(directory)
  assert isinstance(tensors, torch_checkpoint.PytorchBin)
  arrays = _reference_arrays("gpt2")
  for name, want in arrays.items():
    np.testing.assert_array_equal(tensors.read(name), want)
  np.testing.assert_array_equal(
    tensors.read("lm_head.weight"), arrays["transformer.wte.weight"]
  )
  model = gpt2.Model(**GPT2_TINY, dropout=0.0)
  params = hf_loading.load(
    model, gpt2.hf_names(model), directory, ref["tokens"]
  )
  logits = model.apply({"params": params}, ref["tokens"], train=False)
  np.testing.assert_allclose(logits, ref["logits"], rtol=1e-5, atol=1e-5)


def test_bert_from_pytorch_model_bin_shards():
  """Zip-format shards and ``pytorch_model.bin.index.json`` written by
  torch, as transformers 4's ``save_pretrained(...,
  safe_serialization=False, max_shard_size=...)`` laid them out."""
  directory = os.path.join(REFERENCE, "bert-pretraining-torch")
  ref = np.load(os.path.join(REFERENCE, "bert-pretraining", "reference.npz"))
  model = bert.Model(**BERT_TINY, dropout=0.0, head="pretraining")
  args = (ref["tokens"], ref["types"])
  params = hf_loading.load(model, bert.hf_names(model), directory, *args)
  mlm, nsp = model.apply({"params": params}, *args, train=False)
  np.testing.assert_allclose(mlm, ref["mlm"], rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(nsp, ref["nsp"], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("file", ["zip.pt", "legacy.pt"])
def test_every_dtype_and_view_gives_torchs_bytes(file):
  """Each dtype torch.save writes (float8 and the wide unsigned integers
  through untyped storages, zip format only: torch reads them from no
  legacy file) and views of one storage -- transposed, a column, rows
  from an offset, 0-d, empty -- read as torch held them."""
  directory = os.path.join(REFERENCE, "torch-dtypes")
  ref = np.load(os.path.join(directory, "reference.npz"))
  tensors = torch_checkpoint.PytorchBin(os.path.join(directory, file))
  untyped = {"float8_e4m3fn", "float8_e5m2", "uint16", "uint32", "uint64"}
  want = {k[: -len(".shape")] for k in ref.files if k.endswith(".shape")}
  assert set(tensors.names()) == (
    want - untyped if file == "legacy.pt" else want
  )
  for name in tensors.names():
    got = tensors.read(name)
    assert got.shape == tuple(ref[f"{name}.shape"]), name
    assert got.shape == tensors.shape(name) and got.dtype == tensors.dtype(name)
    assert got.tobytes() == ref[f"{name}.bytes"].tobytes(), name
    if name not in (
      "matrix",
      "transposed",
      "column",
      "rows",
      "scalar",
      "empty",
    ):
      assert got.dtype.name == name  # Each named by its dtype.
  matrix = tensors.read("matrix")
  np.testing.assert_array_equal(tensors.read("transposed"), matrix.T)
  np.testing.assert_array_equal(tensors.read("column"), matrix[:, 2])
  np.testing.assert_array_equal(tensors.read("rows"), matrix[1:3])


class _Hostile:
  """Unpickles as a call of ``os.system``: what ``pickle.load`` of a
  hostile checkpoint would run."""

  def __init__(self, marker):
    self.marker = marker

  def __reduce__(self):
    return os.system, (f"touch {self.marker}",)


def _refused(path, match):
  with pytest.raises(UsageError, match=match) as err:
    torch_checkpoint.PytorchBin(str(path))
  assert "\n" not in str(err.value)


def test_a_pickle_calling_anything_else_is_refused_unrun(tmp_path):
  marker = tmp_path / "ran"
  state = torch_format.tensors({"w": np.ones(3, np.float32)})
  hostile = pickle.dumps({"w": _Hostile(marker)}, protocol=2)
  torch_format.torch_save(tmp_path / "a.bin", state, state_pickle=hostile)
  _refused(tmp_path / "a.bin", r"it calls (posix|os)\.system")
  assert not marker.exists()


def test_damage_is_one_line_naming_the_file(tmp_path):
  w = np.arange(12, dtype=np.float32).reshape(3, 4)
  state = torch_format.tensors({"w": w})
  torch_format.torch_save(tmp_path / "good.bin", state)
  assert np.array_equal(
    torch_checkpoint.PytorchBin(str(tmp_path / "good.bin")).read("w"), w
  )
  # Cut short: the zip's directory is gone.
  data = (tmp_path / "good.bin").read_bytes()
  (tmp_path / "cut.bin").write_bytes(data[: len(data) // 2])
  _refused(tmp_path / "cut.bin", r"cut\.bin is not a PyTorch checkpoint")
  # A view reaching past its storage's 12 elements.
  past = {"w": torch_format.View(state["w"].storage, 4, (3, 4), (4, 1))}
  torch_format.torch_save(tmp_path / "past.bin", past)
  _refused(tmp_path / "past.bin", r"tensor 'w' .* lies outside its storage")
  # A storage of 8 elements under a tensor of 12.
  short = {"w": torch_format.View(torch_format.Storage("0", w[:2]), 0, (3, 4))}
  torch_format.torch_save(tmp_path / "short.bin", short)
  _refused(tmp_path / "short.bin", r"outside its storage of 8")
  # A pickle cut short; one whose tensor has a number for its shape.
  with zipfile.ZipFile(tmp_path / "good.bin") as archive:
    pkl = archive.read("archive/data.pkl")
  torch_format.torch_save(
    tmp_path / "cut_pickle.bin", state, state_pickle=pkl[:-9]
  )
  _refused(tmp_path / "cut_pickle.bin", r"its pickle: \w+Error")
  odd = torch_format.View(state["w"].storage, 0, (3, 4))
  odd.shape = 12
  torch_format.torch_save(tmp_path / "odd.bin", {"w": odd})
  _refused(tmp_path / "odd.bin", r"its pickle: TypeError")
  # Not a state dict of tensors; a pre-1.6 (non-zip) file.
  torch_format.torch_save(
    tmp_path / "list.bin", state, state_pickle=pickle.dumps([1, 2], protocol=2)
  )
  _refused(tmp_path / "list.bin", r"it holds a list, not a state dict")
  (tmp_path / "dict.bin").write_bytes(pickle.dumps({"w": 1}, protocol=2))
  _refused(tmp_path / "dict.bin", r"it is a pickle, not a torch\.save file")


def _legacy_parts() -> tuple[bytes, bytes, bytes, bytes]:
  """The torch-written legacy file's header records, state dict pickle,
  storage keys pickle and storages, as bytes."""
  data = open(os.path.join(REFERENCE, "torch-dtypes", "legacy.pt"), "rb").read()
  stream = io.BytesIO(data)
  for _ in range(3):
    pickle.load(stream)
  header = stream.tell()
  torch_pickle.load_state_dict(stream)
  state = stream.tell()
  pickle.load(stream)
  keys = stream.tell()
  return data[:header], data[header:state], data[state:keys], data[keys:]


def test_damaged_or_hostile_legacy_files_are_one_line(tmp_path):
  header, state, keys, storages = _legacy_parts()
  good = tmp_path / "good.pt"
  good.write_bytes(header + state + keys + storages)
  assert "matrix" in torch_checkpoint.PytorchBin(str(good)).names()
  # A hostile state dict pickle: refused, never run.
  marker = tmp_path / "ran"
  hostile = pickle.dumps({"w": _Hostile(marker)}, protocol=2)
  (tmp_path / "hostile.pt").write_bytes(header + hostile + keys + storages)
  _refused(tmp_path / "hostile.pt", r"it calls (posix|os)\.system")
  assert not marker.exists()
  # Cut inside the storages; cut inside the pickle; a storage no tensor
  # names; big-endian.
  (tmp_path / "cut.pt").write_bytes((header + state + keys + storages)[:-9])
  _refused(tmp_path / "cut.pt", r"storage '\d+' lies past the end")
  (tmp_path / "cut_pickle.pt").write_bytes(header + state[:-5])
  _refused(tmp_path / "cut_pickle.pt", r"its pickle: \w+Error")
  extra = pickle.dumps(pickle.loads(keys) + ["999"], protocol=2)
  (tmp_path / "extra.pt").write_bytes(header + state + extra + storages)
  _refused(tmp_path / "extra.pt", r"a storage '999' no tensor names")
  big = header.replace(b"little_endianq\x02\x88", b"little_endianq\x02\x89")
  assert big != header
  (tmp_path / "big.pt").write_bytes(big + state + keys + storages)
  _refused(tmp_path / "big.pt", r"its tensors are big-endian")
  # Neither format: a tar file's first bytes.
  (tmp_path / "old.pt").write_bytes(b"storages" + bytes(600))
  _refused(tmp_path / "old.pt", r"is not a PyTorch checkpoint")
  # A directory without any checkpoint names all four kinds.
  (tmp_path / "nothing").mkdir()
  with pytest.raises(UsageError, match="flax_model.msgpack or pytorch_model"):
    hf_checkpoint.open_checkpoint(str(tmp_path / "nothing"))


def test_shards_are_read_as_their_index_says(tmp_path):
  """A stale copy of a tensor in another shard is not read; a shard
  missing a tensor its index puts there is refused in one line."""
  a = np.arange(6, dtype=np.float32).reshape(2, 3)
  one, two = (
    "pytorch_model-00001-of-00002.bin",
    "pytorch_model-00002-of-00002.bin",
  )
  torch_format.torch_save(tmp_path / one, torch_format.tensors({"a": a}))
  torch_format.torch_save(
    tmp_path / two, torch_format.tensors({"a": a + 7, "b": a[0]})
  )
  index = tmp_path / "pytorch_model.bin.index.json"
  index.write_text(json.dumps({"weight_map": {"a": one, "b": two}}))
  tensors = torch_checkpoint.PytorchBin(str(tmp_path))
  np.testing.assert_array_equal(tensors.read("a"), a)
  index.write_text(json.dumps({"weight_map": {"a": one, "b": one}}))
  with pytest.raises(UsageError, match=f"names 'b' in {one}, which does not"):
    torch_checkpoint.PytorchBin(str(tmp_path))
