"""PyTorch checkpoints (``pytorch_model.bin``, ``torch.save``'s zip
format) through ``hf:PATH``, read without torch and without running their
pickle: the tests' HuggingFace reference checkpoints, written as
``torch.save`` lays a state dict out (``tests/models/torch_format.py``),
load into jpipe's models and give HuggingFace's logits -- a tied head
sharing its embedding's storage, a weight stored transposed (a strided
view), shards with an index -- and a hostile or damaged file is refused
in one line, before anything is loaded."""

import json
import os
import pickle
import zipfile

import numpy as np
import pytest

from jpipe.models import bert, gpt2
from jpipe.train import hf_checkpoint, torch_checkpoint
from jpipe.train.errors import UsageError
from tests.models import hf_loading, torch_format
from tests.models.test_bert import BERT_TINY
from tests.models.test_gpt2 import GPT2_TINY

REFERENCE = os.path.join(os.path.dirname(__file__), "hf_reference")


def _reference_arrays(name):
  tensors = hf_checkpoint.Safetensors(os.path.join(REFERENCE, name))
  return {n: tensors.read(n) for n in tensors.names()}


def _gpt2_state():
  """GPT-2's state dict as PyTorch holds it: ``lm_head.weight`` the same
  storage as ``wte``'s, and one Conv1D weight stored transposed (its
  tensor a view with swapped strides)."""
  arrays = _reference_arrays("gpt2")
  state = torch_format.tensors(arrays)
  state["lm_head.weight"] = state["transformer.wte.weight"]
  name = "transformer.h.0.mlp.c_fc.weight"
  rows, cols = arrays[name].shape
  transposed = torch_format.Storage("t", arrays[name].T)
  state[name] = torch_format.View(transposed, 0, (rows, cols), (1, rows))
  return state


def test_gpt2_from_pytorch_model_bin(tmp_path):
  ref = np.load(os.path.join(REFERENCE, "gpt2", "reference.npz"))
  torch_format.torch_save(tmp_path / "pytorch_model.bin", _gpt2_state())
  tensors = hf_checkpoint.open_checkpoint(str(tmp_path))
  assert isinstance(tensors, torch_checkpoint.PytorchBin)
  arrays = _reference_arrays("gpt2")
  for name, want in arrays.items():  # Every tensor, the view's too.
    np.testing.assert_array_equal(tensors.read(name), want)
  np.testing.assert_array_equal(
    tensors.read("lm_head.weight"), arrays["transformer.wte.weight"]
  )
  model = gpt2.Model(**GPT2_TINY, dropout=0.0)
  params = hf_loading.load(model, gpt2.hf_names(model), tmp_path, ref["tokens"])
  logits = model.apply({"params": params}, ref["tokens"], train=False)
  np.testing.assert_allclose(logits, ref["logits"], rtol=1e-5, atol=1e-5)


def test_bert_from_sharded_pytorch_model_bin(tmp_path):
  """Two shards and ``pytorch_model.bin.index.json``, as
  ``save_pretrained(..., safe_serialization=False, max_shard_size=...)``
  writes them; each shard's storages keyed from 0 again."""
  reference = os.path.join(REFERENCE, "bert-pretraining")
  ref = np.load(os.path.join(reference, "reference.npz"))
  arrays = _reference_arrays("bert-pretraining")
  names = sorted(arrays)
  weight_map = {}
  for i, part in enumerate((names[::2], names[1::2])):
    shard = f"pytorch_model-{i + 1:05d}-of-00002.bin"
    state = torch_format.tensors({n: arrays[n] for n in part})
    torch_format.torch_save(tmp_path / shard, state, root=shard[:-4])
    weight_map.update(dict.fromkeys(part, shard))
  with open(tmp_path / "pytorch_model.bin.index.json", "w") as f:
    json.dump({"metadata": {}, "weight_map": weight_map}, f)
  model = bert.Model(**BERT_TINY, dropout=0.0, head="pretraining")
  args = (ref["tokens"], ref["types"])
  params = hf_loading.load(model, bert.hf_names(model), tmp_path, *args)
  mlm, nsp = model.apply({"params": params}, *args, train=False)
  np.testing.assert_allclose(mlm, ref["mlm"], rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(nsp, ref["nsp"], rtol=1e-5, atol=1e-5)


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
  _refused(tmp_path / "cut.bin", r"cut\.bin is not a PyTorch zip checkpoint")
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
  (tmp_path / "old.bin").write_bytes(pickle.dumps({"w": 1}, protocol=2))
  _refused(tmp_path / "old.bin", r"not a PyTorch zip checkpoint")
  # A directory without any checkpoint names all four kinds.
  (tmp_path / "nothing").mkdir()
  with pytest.raises(UsageError, match="flax_model.msgpack or pytorch_model"):
    hf_checkpoint.open_checkpoint(str(tmp_path / "nothing"))
