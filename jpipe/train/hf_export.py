"""Trained params out as a HuggingFace checkpoint: ``model.safetensors``
in PyTorch's names and layout and the ``config.json`` transformers builds
the model from -- the inverse of ``init_from=hf:PATH``, for jpipe's
GPT-2 (``GPT2LMHeadModel``), T5 (``T5ForConditionalGeneration``, v1.0 and
v1.1) and BERT (its pretraining, classification and QA heads).

Each model's name map (``jpipe.models.<name>.hf_names``, the one loading
reads) is walked the other way: a param goes to the first name the map
tries (transformers' own), transposed where the map transposes (torch
Linear weights are [out, in]); a ``scan_layers`` leaf is split into its
layers' names. Weights tied in transformers (GPT-2's and T5 v1.0's head,
BERT's MLM decoder) are not written: ``from_pretrained`` ties them, as it
does for its own files. ``python -m jpipe.train.hf_export WORKDIR OUT``
exports a run's latest checkpoint.
"""

import json
import os
import struct
import sys
from typing import Any

import numpy as np

from jpipe.models import bert, gpt2, t5_v1
from jpipe.train import hf_checkpoint, pretrained

__all__ = ["hf_config", "save", "write_safetensors"]

# safetensors' dtype names, as the reader reads them.
_NAMES = {np.dtype(t): name for name, t in hf_checkpoint.DTYPES.items()}
_BERT_CLASSES = {
  "pretraining": "BertForPreTraining",
  "classification": "BertForSequenceClassification",
  "qa": "BertForQuestionAnswering",
}


def save(params, model, directory: str) -> list[str]:
  """Writes ``model``'s ``params`` (its Flax params tree; ``{"params":
  ...}`` too) into ``directory`` as transformers saves that model; returns
  the files written. A ValueError for another model, or params that are
  not ``model``'s (the first difference named)."""
  module = _module_of(model)
  names = module.hf_names(model)
  flat = pretrained.flat_paths(params)
  if set(flat) != set(names) and all(p.startswith("params/") for p in flat):
    flat = {p.removeprefix("params/"): x for p, x in flat.items()}
  missing = sorted(set(names) - set(flat))
  extra = sorted(set(flat) - set(names))
  if missing or extra:
    first = missing[0] if missing else extra[0]
    raise ValueError(
      f"the params are not this {type(model).__name__}'s: "
      + (f"no {first!r}" if missing else f"{first!r} it has not")
      + f" ({len(missing)} missing, {len(extra)} extra); pass the params "
      "of the model as configured (its sizes, head, scan_layers)"
    )
  tensors = {}
  for path, (theirs, transposed) in names.items():
    value = np.asarray(flat[path])
    if isinstance(theirs, list):  # A scan_layers leaf: a row per layer.
      for row, name in zip(value, theirs, strict=True):
        tensors[_first(name)] = _torch_layout(row, transposed)
    else:
      tensors[_first(theirs)] = _torch_layout(value, transposed)
  os.makedirs(directory, exist_ok=True)
  weights = os.path.join(directory, "model.safetensors")
  write_safetensors(weights, tensors)
  config = os.path.join(directory, "config.json")
  with open(config, "w") as f:
    json.dump(hf_config(model), f, indent=2, sort_keys=True)
    f.write("\n")
  return [weights, config]


def _module_of(model):
  for module in (gpt2, t5_v1, bert):
    if type(model) is module.Model:
      return module
  raise ValueError(
    f"no HuggingFace export for {type(model).__module__}."
    f"{type(model).__name__}: jpipe.models.gpt2, t5_v1 and bert have one"
  )


def _first(name) -> str:
  """The name transformers writes: the first a name map tries."""
  return name if isinstance(name, str) else name[0]


def _torch_layout(value: np.ndarray, transposed: bool) -> np.ndarray:
  return np.ascontiguousarray(value.T if transposed else value)


def hf_config(model) -> dict[str, Any]:
  """transformers' ``config.json`` fields of ``model`` (GPT-2, T5, BERT)."""
  kind = _module_of(model)
  if kind is gpt2:
    return {
      "architectures": ["GPT2LMHeadModel"],
      "model_type": "gpt2",
      "vocab_size": model.vocab_size,
      "n_positions": model.n_positions,
      "n_embd": model.d_model,
      "n_layer": model.num_layers,
      "n_head": model.num_heads,
      "n_inner": None,  # (4 n_embd.)
      "activation_function": "gelu_new",
      "layer_norm_epsilon": model.layer_norm_eps,
      "resid_pdrop": model.dropout,
      "embd_pdrop": model.dropout,
      "attn_pdrop": model.dropout,
      "tie_word_embeddings": True,
    }
  if kind is t5_v1:
    v11 = model.version == "1.1"
    return {
      "architectures": ["T5ForConditionalGeneration"],
      "model_type": "t5",
      "vocab_size": model.vocab_size,
      "d_model": model.d_model,
      "d_kv": model.d_kv,
      "d_ff": model.d_ff,
      "num_layers": model.num_layers,
      "num_decoder_layers": model.num_decoder_layers or model.num_layers,
      "num_heads": model.num_heads,
      "relative_attention_num_buckets": model.relative_attention_num_buckets,
      "relative_attention_max_distance": model.relative_attention_max_distance,
      "dropout_rate": model.dropout,
      "layer_norm_epsilon": t5_v1.RMSNorm.eps,
      "feed_forward_proj": "gated-gelu" if v11 else "relu",
      "tie_word_embeddings": not v11,
      "is_encoder_decoder": True,
      "decoder_start_token_id": 0,
      "pad_token_id": 0,
      "eos_token_id": 1,
    }
  out = {
    "architectures": [_BERT_CLASSES[model.head]],
    "model_type": "bert",
    "vocab_size": model.vocab_size,
    "hidden_size": model.d_model,
    "num_hidden_layers": model.num_layers,
    "num_attention_heads": model.num_heads,
    "intermediate_size": model.d_ff,
    "max_position_embeddings": model.max_position,
    "type_vocab_size": model.type_vocab_size,
    "layer_norm_eps": model.layer_norm_eps,
    "hidden_act": "gelu",
    "hidden_dropout_prob": model.dropout,
    "attention_probs_dropout_prob": model.dropout,
    "pad_token_id": 0,
  }
  if model.head == "classification":
    out["num_labels"] = model.num_classes
  return out


def write_safetensors(path: str, tensors: dict[str, np.ndarray]) -> None:
  """``tensors`` as a safetensors file: an 8-byte little-endian header
  size, the JSON header (dtype, shape, byte offsets of each tensor, padded
  to 8 bytes), then the tensors' little-endian bytes in header order."""
  header, offset = {"__metadata__": {"format": "pt"}}, 0
  for name, value in tensors.items():
    dtype = _NAMES.get(value.dtype)
    if dtype is None:
      raise ValueError(
        f"{name}: dtype {value.dtype} has no safetensors name here "
        f"({sorted(_NAMES.values())})"
      )
    size = value.size * value.dtype.itemsize
    header[name] = {
      "dtype": dtype,
      "shape": list(value.shape),
      "data_offsets": [offset, offset + size],
    }
    offset += size
  text = json.dumps(header, separators=(",", ":")).encode()
  text += b" " * (-len(text) % 8)
  tmp = path + ".tmp"
  with open(tmp, "wb") as f:
    f.write(struct.pack("<Q", len(text)))
    f.write(text)
    for value in tensors.values():
      f.write(value.astype(value.dtype.newbyteorder("<"), copy=False).tobytes())
  os.replace(tmp, path)  # (A cut write leaves no half file under the name.)


def _main(argv=None) -> int:
  import argparse

  import ml_collections

  from jpipe.train import tasks
  from jpipe.train.errors import UsageError

  parser = argparse.ArgumentParser(
    prog="python -m jpipe.train.hf_export",
    description="A jpipe run's latest checkpoint as a HuggingFace model "
    "folder (model.safetensors + config.json): its GPT-2, T5 or BERT.",
  )
  parser.add_argument("workdir", help="the run's --workdir")
  parser.add_argument("out", help="the folder to write")
  args = parser.parse_args(argv)
  path = os.path.join(args.workdir, "config.json")
  try:
    with open(path) as f:
      config = ml_collections.ConfigDict(json.load(f))
    name = config.model.name
    if name not in ("gpt2", "t5_v1", "bert"):
      raise UsageError(
        f"{args.workdir} trained model {name!r}: jpipe.models.gpt2, t5_v1 "
        "and bert export to HuggingFace"
      )
    module = {"gpt2": gpt2, "t5_v1": t5_v1, "bert": bert}[name]
    model = module.Model(**tasks.model_kwargs(config))
    template = tasks.build_task(config, abstract=True).params
    params = pretrained.load_params(args.workdir, template)
  except FileNotFoundError:
    print(
      f"error: {path} not found: give the --workdir of a finished or "
      "checkpointed python -m jpipe.train run (in Python: "
      "jpipe.train.hf_export.save(params, model, OUT))",
      file=sys.stderr,
    )
    return 2
  except (UsageError, pretrained.PretrainedError) as e:
    print(f"error: {e}", file=sys.stderr)
    return 2
  for written in save(params, model, args.out):
    print(written)
  return 0


if __name__ == "__main__":
  raise SystemExit(_main())
