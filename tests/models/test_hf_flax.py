"""HuggingFace Flax checkpoints (``flax_model.msgpack``) through
``hf:PATH``: the tests' PyTorch reference checkpoints, written as
HuggingFace's own converter (``convert_pytorch_state_dict_to_flax``)
lays Flax params out -- Linear/Conv1D ``weight`` -> transposed
``kernel``, Embedding ``weight`` -> ``embedding``, LayerNorm ``weight``
-> ``scale`` (T5's own norm keeps ``weight``), nested by the dotted name
-- load into jpipe's models and give HuggingFace's logits. (transformers
5 has no Flax models to write them with.)"""

import json
import os
import re

import numpy as np
import pytest
from flax import serialization, traverse_util

from jpipe.models import bert, gpt2, t5_v1
from jpipe.train import hf_checkpoint
from jpipe.train.errors import UsageError
from tests.models import hf_loading
from tests.models.test_bert import BERT_TINY
from tests.models.test_gpt2 import GPT2_TINY
from tests.models.test_t5_v1 import T5_ATOL, TINY
from tests.tiers import slow

REFERENCE = os.path.join(os.path.dirname(__file__), "hf_reference")
EMBEDDINGS = re.compile(
  r"(wte|wpe|shared|embed_tokens|word_embeddings|position_embeddings|"
  r"token_type_embeddings|relative_attention_bias)\.weight$"
)
NORMS = re.compile(r"(ln_\d|ln_f|LayerNorm|layer_norm)\.(weight|gamma)$")


def _flax_tree(directory, t5=False):
  """The PyTorch checkpoint as HuggingFace's converter makes Flax params."""
  tensors = hf_checkpoint.Safetensors(directory)
  tree = {}
  for name in tensors.names():
    value = tensors.read(name)
    *module, leaf = name.split(".")
    if EMBEDDINGS.search(name):
      leaf = "embedding"
    elif NORMS.search(name):
      leaf = "weight" if t5 else "scale"
    elif leaf == "weight" and value.ndim == 2:
      leaf, value = "kernel", value.T
    node = tree
    for key in module:
      node = node.setdefault(key, {})
    node[leaf] = value
  return tree


def _write(tree, directory, shards=1):
  """flax_model.msgpack, or ``shards`` files and their index."""
  os.makedirs(directory, exist_ok=True)
  if shards == 1:
    with open(os.path.join(directory, "flax_model.msgpack"), "wb") as f:
      f.write(serialization.msgpack_serialize(tree))
    return
  # As transformers' flax_shard_checkpoint: the index names each leaf by
  # its "/"-joined path, and a shard holds whole leaves of any modules.
  flat = traverse_util.flatten_dict(tree, sep="/")
  keys = sorted(flat)
  weight_map = {}
  for i in range(shards):
    part = {k: flat[k] for k in keys[i::shards]}
    name = f"flax_model-{i + 1:05d}-of-{shards:05d}.msgpack"
    with open(os.path.join(directory, name), "wb") as f:
      f.write(
        serialization.msgpack_serialize(
          traverse_util.unflatten_dict(part, sep="/")
        )
      )
    weight_map.update({k: name for k in part})
  with open(os.path.join(directory, "flax_model.msgpack.index.json"), "w") as f:
    json.dump({"weight_map": weight_map}, f)


def test_gpt2_from_flax_msgpack(tmp_path):
  reference = os.path.join(REFERENCE, "gpt2")
  ref = np.load(os.path.join(reference, "reference.npz"))
  _write(_flax_tree(reference), tmp_path)
  model = gpt2.Model(**GPT2_TINY, dropout=0.0)
  params = hf_loading.load(model, gpt2.hf_names(model), tmp_path, ref["tokens"])
  logits = model.apply({"params": params}, ref["tokens"], train=False)
  np.testing.assert_allclose(logits, ref["logits"], rtol=1e-5, atol=1e-5)


def test_bert_from_sharded_flax_msgpack(tmp_path):
  reference = os.path.join(REFERENCE, "bert-pretraining")
  ref = np.load(os.path.join(reference, "reference.npz"))
  _write(_flax_tree(reference), tmp_path, shards=2)
  model = bert.Model(**BERT_TINY, dropout=0.0, head="pretraining")
  args = (ref["tokens"], ref["types"])
  params = hf_loading.load(model, bert.hf_names(model), tmp_path, *args)
  mlm, nsp = model.apply({"params": params}, *args, train=False)
  np.testing.assert_allclose(mlm, ref["mlm"], rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(nsp, ref["nsp"], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("version", [slow("1.0"), "1.1"])
def test_t5_from_a_flax_msgpack_file(tmp_path, version):
  reference = os.path.join(REFERENCE, f"t5-v{version}")
  ref = np.load(os.path.join(reference, "reference.npz"))
  path = tmp_path / "t5.msgpack"
  path.write_bytes(
    serialization.msgpack_serialize(_flax_tree(reference, t5=True))
  )
  model = t5_v1.Model(**TINY, dropout=0.0, version=version)
  params = hf_loading.load(
    model, t5_v1.hf_names(model), str(path), ref["inputs"], ref["targets"]
  )
  logits = model.apply(
    {"params": params}, ref["inputs"], ref["targets"], train=False
  )
  np.testing.assert_allclose(logits, ref["logits"], rtol=1e-5, atol=T5_ATOL)


def test_a_directory_without_a_checkpoint_says_what_it_looks_for(tmp_path):
  with pytest.raises(
    UsageError, match="flax_model.msgpack or pytorch_model.bin in the directory"
  ):
    hf_checkpoint.open_checkpoint(str(tmp_path))
  bad = tmp_path / "bad.msgpack"
  bad.write_bytes(b"\xc1 not msgpack")
  with pytest.raises(UsageError, match="not a Flax msgpack checkpoint"):
    hf_checkpoint.open_checkpoint(str(bad))
