"""Params out as HuggingFace checkpoints (``jpipe.train.hf_export``),
held to transformers' own files: HF's tiny GPT-2, T5 (v1.0, v1.1) and
BERT checkpoints (tests/models/hf_reference, written by transformers),
read into jpipe and exported again, give the same tensors byte for byte
under the same names, and the same config fields."""

import json
import os
import struct
import subprocess
import sys

import numpy as np
import pytest

from jpipe.models import bert, gpt2, t5_v1
from jpipe.train import hf_export, pretrained
from tests.models import hf_loading
from tests.models.test_bert import BERT_TINY
from tests.models.test_gpt2 import GPT2_TINY
from tests.models.test_t5_v1 import TINY as T5_TINY

REFERENCE = os.path.join(
  os.path.dirname(os.path.dirname(__file__)), "models", "hf_reference"
)

CASES = {
  "gpt2": ("gpt2", gpt2.Model(**GPT2_TINY, dropout=0.0), ("tokens",)),
  "gpt2-scan": (
    "gpt2",
    gpt2.Model(**GPT2_TINY, dropout=0.0, scan_layers=True),
    ("tokens",),
  ),
  **{
    f"t5-v{v}": (
      f"t5-v{v}",
      t5_v1.Model(**T5_TINY, dropout=0.0, version=v),
      ("inputs", "targets"),
    )
    for v in ("1.0", "1.1")
  },
  **{
    f"bert-{h}": (
      f"bert-{h}",
      bert.Model(**BERT_TINY, dropout=0.0, head=h, num_classes=3),
      ("tokens", "types"),
    )
    for h in bert.HEADS
  },
}


def _tensors(path) -> dict:
  """A safetensors file's (or sharded folder's) {name: (dtype, shape,
  bytes)}, read from the format's definition (not jpipe's reader)."""
  if not os.path.exists(path):
    with open(path + ".index.json") as f:
      shards = sorted(set(json.load(f)["weight_map"].values()))
    out = {}
    for shard in shards:
      out.update(_tensors(os.path.join(os.path.dirname(path), shard)))
    return out
  with open(path, "rb") as f:
    size = struct.unpack("<Q", f.read(8))[0]
    header, data = json.loads(f.read(size)), f.read()
  return {
    name: (e["dtype"], e["shape"], data[slice(*e["data_offsets"])])
    for name, e in header.items()
    if name != "__metadata__"
  }


def _loaded(case):
  folder, model, keys = CASES[case]
  directory = os.path.join(REFERENCE, folder)
  ref = np.load(os.path.join(directory, "reference.npz"))
  module = {gpt2.Model: gpt2, t5_v1.Model: t5_v1, bert.Model: bert}
  names = module[type(model)].hf_names(model)
  inputs = [ref[k] for k in keys]
  return directory, model, names, inputs


@pytest.mark.parametrize("case", sorted(CASES))
def test_an_export_is_transformers_own_checkpoint(case, tmp_path):
  directory, model, names, inputs = _loaded(case)
  params = hf_loading.load(model, names, directory, *inputs)
  hf_export.save(params, model, str(tmp_path))
  theirs = _tensors(os.path.join(directory, "model.safetensors"))
  ours = _tensors(str(tmp_path / "model.safetensors"))
  extra = set(ours) - set(theirs)
  if case == "t5-v1.1":  # Google's v1.1 keeps its own head; the reference
    # (transformers 5) tied it to shared.weight, whence it was read.
    assert extra == {"lm_head.weight"}
    head = np.frombuffer(ours.pop("lm_head.weight")[2], np.float32)
    np.testing.assert_array_equal(
      head, np.frombuffer(theirs["shared.weight"][2], np.float32)
    )
  else:
    assert not extra
  assert set(ours) == set(theirs)  # (Tied weights are not in either.)
  for name, entry in ours.items():
    assert entry == theirs[name], name
  with open(os.path.join(directory, "config.json")) as f:
    their_config = json.load(f)
  with open(tmp_path / "config.json") as f:
    our_config = json.load(f)
  differ = {
    k
    for k, v in our_config.items()
    if k in their_config and their_config[k] != v
  }
  assert differ == ({"tie_word_embeddings"} if case == "t5-v1.1" else set())
  # And back: init_from=hf: of the export is the same params.
  again = hf_loading.load(model, names, str(tmp_path), *inputs)
  for path, value in pretrained.flat_paths(params).items():
    np.testing.assert_array_equal(pretrained.flat_paths(again)[path], value)


def test_params_of_another_model_are_refused(tmp_path):
  directory, model, names, inputs = _loaded("gpt2")
  params = hf_loading.load(model, names, directory, *inputs)
  deeper = gpt2.Model(**{**GPT2_TINY, "num_layers": 3}, dropout=0.0)
  with pytest.raises(
    ValueError, match=r"no 'block_2/.*' \(\d+ missing, 0 extra"
  ):
    hf_export.save(params, deeper, str(tmp_path))
  with pytest.raises(ValueError, match="jpipe.models.gpt2, t5_v1 and bert"):
    hf_export.save(params, object(), str(tmp_path))
  assert not os.listdir(tmp_path)


@pytest.mark.slow
def test_the_cli_exports_a_runs_latest_checkpoint(tmp_path, capsys):
  """python -m jpipe.train.hf_export WORKDIR OUT: the run's GPT-2 as HF
  files that init_from=hf: reads back to the checkpoint's params."""
  import ml_collections

  from jpipe.train import config_plan, tasks, train_lib

  root = os.path.dirname(os.path.dirname(os.path.dirname(__file__)))
  config = config_plan.load_config_file(os.path.join(root, "configs/gpt_lm.py"))
  config.model.name = "gpt2"
  config.model.kwargs = ml_collections.ConfigDict(
    dict(vocab_size=256, n_positions=64, d_model=16, num_layers=2, num_heads=2)
  )
  config.data.sequence_length = 32
  config.data.batch_size = 8
  config.pipeline.num_stages = 2
  config.train.steps = 2
  config.train.eval_every = 2
  config.train.checkpoint_every = 2
  config.train.profile_last_step = False
  workdir, out = str(tmp_path / "run"), str(tmp_path / "hf")
  train_lib.train_and_evaluate(config, workdir)
  # As README shows it: python -m jpipe.train.hf_export WORKDIR OUT.
  done = subprocess.run(
    [sys.executable, "-m", "jpipe.train.hf_export", workdir, out],
    capture_output=True,
    text=True,
    cwd=root,
    env=dict(os.environ, PYTHONPATH=root),
    timeout=300,
  )
  assert done.returncode == 0, done.stderr[-2000:]
  assert "model.safetensors" in done.stdout
  template = tasks.build_task(config, abstract=True).params
  trained = pretrained.load_params(workdir, template)
  model = gpt2.Model(**config.model.kwargs)
  exported = pretrained.load_params(
    f"hf:{out}", template, hf_names=gpt2.hf_names(model)
  )
  for path, value in pretrained.flat_paths(trained).items():
    np.testing.assert_array_equal(pretrained.flat_paths(exported)[path], value)
  assert hf_export._main([str(tmp_path / "none"), out]) == 2
  assert "config.json not found" in capsys.readouterr().err
