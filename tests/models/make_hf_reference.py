"""Writes the HuggingFace reference the model tests compare against:
tiny random T5 v1.0 / v1.1 checkpoints (``save_pretrained``: safetensors,
v1.1 in shards with an index), GPT-2's and BERT's (its three heads),
their logits, T5's relative position buckets and BERT's parameter
counts at full size, from HuggingFace's PyTorch implementation; and
``torch.save``'s own files: GPT-2's state dict in the legacy format (as
the Hub's 2019 ``pytorch_model.bin`` files are), BERT's in zip-format
shards with an index (as transformers 4 wrote ``pytorch_model.bin``), and
tensors of every dtype and view in both formats with their bytes.

The tests read these files, so they need neither torch nor transformers.
Regenerate (after a change of the reference library) with

  pip install -e ".[reference]"   # torch (its CPU build) and transformers
  python -m tests.models.make_hf_reference

Written with torch 2.14.1 and transformers 5.25.0 (versions.json).
"""

import json
import os
import shutil

import numpy as np
import torch
import transformers
from transformers.models.t5.modeling_t5 import T5Attention

from tests.models.test_bert import BERT_TINY
from tests.models.test_gpt2 import GPT2_TINY
from tests.models.test_t5_v1 import TINY

OUT = os.path.join(os.path.dirname(__file__), "hf_reference")

# torch.save's dtypes: with a typed storage class (both formats), and
# without one (zip format only, ``_rebuild_tensor_v3``).
TYPED = (
  "float64 float32 float16 bfloat16 int64 int32 int16 int8 uint8 bool "
  "complex64 complex128"
).split()
UNTYPED = "float8_e4m3fn float8_e5m2 uint16 uint32 uint64".split()


def t5(version: str, seed: int):
  config = transformers.T5Config(
    vocab_size=TINY["vocab_size"],
    d_model=TINY["d_model"],
    d_kv=TINY["d_kv"],
    d_ff=TINY["d_ff"],
    num_layers=TINY["num_layers"],
    num_decoder_layers=TINY["num_decoder_layers"],
    num_heads=TINY["num_heads"],
    relative_attention_num_buckets=TINY["relative_attention_num_buckets"],
    relative_attention_max_distance=TINY["relative_attention_max_distance"],
    dropout_rate=0.0,
    feed_forward_proj="gated-gelu" if version == "1.1" else "relu",
    tie_word_embeddings=version == "1.0",
    decoder_start_token_id=0,
    pad_token_id=0,
  )
  torch.manual_seed(seed)
  model = transformers.T5ForConditionalGeneration(config).eval()
  with torch.no_grad():  # Random norms too, so a swapped norm shows.
    for name, p in model.named_parameters():
      if "layer_norm" in name:
        p.uniform_(0.5, 1.5)
  return model


def gpt2_model(seed: int):
  config = transformers.GPT2Config(
    vocab_size=GPT2_TINY["vocab_size"],
    n_positions=GPT2_TINY["n_positions"],
    n_embd=GPT2_TINY["d_model"],
    n_layer=GPT2_TINY["num_layers"],
    n_head=GPT2_TINY["num_heads"],
    resid_pdrop=0.0,
    embd_pdrop=0.0,
    attn_pdrop=0.0,
  )
  torch.manual_seed(seed)
  model = transformers.GPT2LMHeadModel(config).eval()
  with torch.no_grad():  # Random norms and biases, so a swap shows.
    for name, p in model.named_parameters():
      if "ln_" in name or name.endswith("bias"):
        p.uniform_(-0.5, 1.5)
  return model


def bert_model(head: str, seed: int):
  config = transformers.BertConfig(
    vocab_size=BERT_TINY["vocab_size"],
    hidden_size=BERT_TINY["d_model"],
    num_hidden_layers=BERT_TINY["num_layers"],
    num_attention_heads=BERT_TINY["num_heads"],
    intermediate_size=BERT_TINY["d_ff"],
    max_position_embeddings=BERT_TINY["max_position"],
    hidden_dropout_prob=0.0,
    attention_probs_dropout_prob=0.0,
    num_labels=3 if head == "classification" else 2,
  )
  cls = {
    "pretraining": transformers.BertForPreTraining,
    "classification": transformers.BertForSequenceClassification,
    "qa": transformers.BertForQuestionAnswering,
  }[head]
  torch.manual_seed(seed)
  model = cls(config).eval()
  with torch.no_grad():  # Random norms and biases, so a swap shows.
    for name, p in model.named_parameters():
      if "LayerNorm" in name or name.endswith("bias"):
        p.uniform_(-0.5, 1.5)
  return model


def torch_dtypes(formats: dict[str, bool]):
  """``torch.save`` of a tensor of each dtype and of views (strided,
  offset, 0-d, empty) sharing storages, in each format (name -> whether
  legacy); ``reference.npz``: each tensor's shape and contiguous bytes."""
  directory = os.path.join(OUT, "torch-dtypes")
  os.makedirs(directory)
  base = torch.linspace(-3.0, 3.0, 12).reshape(3, 4)
  state = {}
  for name in TYPED + UNTYPED:
    dtype = getattr(torch, name)
    if name == "bool":
      state[name] = base > 0
    elif dtype.is_floating_point or dtype.is_complex:
      state[name] = base.to(dtype)
    elif name.startswith("uint"):
      state[name] = (base + 3).round().to(dtype)
    else:
      state[name] = (base * 10).round().to(dtype)
  x = torch.arange(24, dtype=torch.float32).reshape(4, 6)
  state.update(
    matrix=x,
    transposed=x.T,  # Strides (1, 6).
    column=x[:, 2],  # Offset 2, stride 6.
    rows=x[1:3],  # Offset 6.
    scalar=torch.tensor(7.5),
    empty=torch.zeros(0, 4),
  )
  for file, legacy in formats.items():
    saved = {k: v for k, v in state.items() if not legacy or k not in UNTYPED}
    torch.save(
      saved,
      os.path.join(directory, file),
      _use_new_zipfile_serialization=not legacy,
    )
  np.savez(
    os.path.join(directory, "reference.npz"),
    **{
      f"{k}.bytes": v.contiguous().reshape(-1).view(torch.uint8).numpy()
      for k, v in state.items()
    },
    **{f"{k}.shape": np.array(v.shape, np.int64) for k, v in state.items()},
  )


def pytorch_model_bin_shards(model, directory: str, shards: int):
  """``model``'s state dict in ``shards`` zip-format files and
  ``pytorch_model.bin.index.json``, as transformers 4's
  ``save_pretrained(..., safe_serialization=False, max_shard_size=...)``
  laid them out (transformers 5 writes safetensors only)."""
  os.makedirs(directory)
  state = model.state_dict()
  names = list(state)
  per_shard = -(-len(names) // shards)
  weight_map = {}
  for i in range(shards):
    file = f"pytorch_model-{i + 1:05d}-of-{shards:05d}.bin"
    part = {n: state[n] for n in names[i * per_shard : (i + 1) * per_shard]}
    torch.save(part, os.path.join(directory, file))
    weight_map.update(dict.fromkeys(part, file))
  total = sum(t.numel() * t.element_size() for t in state.values())
  with open(os.path.join(directory, "pytorch_model.bin.index.json"), "w") as f:
    json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f)


def main():
  shutil.rmtree(OUT, ignore_errors=True)
  os.makedirs(OUT)
  rng = np.random.default_rng(0)
  inputs = rng.integers(1, 300, size=(2, 30)).astype(np.int32)
  inputs[1, 22:] = 0  # Padding, masked out.
  targets = rng.integers(1, 300, size=(2, 11)).astype(np.int32)
  for version, seed, shard in (("1.0", 0, "10GB"), ("1.1", 1, "20KB")):
    model = t5(version, seed)
    directory = os.path.join(OUT, f"t5-v{version}")
    model.save_pretrained(directory, max_shard_size=shard)
    with torch.no_grad():
      logits = model(
        input_ids=torch.tensor(inputs, dtype=torch.long),
        attention_mask=torch.tensor(inputs > 0, dtype=torch.long),
        labels=torch.tensor(targets, dtype=torch.long),
      ).logits.numpy()
    np.savez(
      os.path.join(directory, "reference.npz"),
      inputs=inputs,
      targets=targets,
      logits=logits,
    )
  gpt2 = gpt2_model(seed=2)
  directory = os.path.join(OUT, "gpt2")
  gpt2.save_pretrained(directory)
  tokens = rng.integers(0, GPT2_TINY["vocab_size"], size=(2, 20))
  with torch.no_grad():
    logits = gpt2(input_ids=torch.tensor(tokens, dtype=torch.long)).logits
  np.savez(
    os.path.join(directory, "reference.npz"),
    tokens=tokens.astype(np.int32),
    logits=logits.numpy(),
  )
  legacy = os.path.join(OUT, "gpt2-torch-legacy")
  os.makedirs(legacy)  # (lm_head.weight shares wte's storage: stored once.)
  torch.save(
    gpt2.state_dict(),
    os.path.join(legacy, "pytorch_model.bin"),
    _use_new_zipfile_serialization=False,
  )
  tokens = rng.integers(1, BERT_TINY["vocab_size"], size=(2, 24))
  tokens[1, 17:] = 0  # [PAD], masked out.
  types = np.zeros_like(tokens)
  types[:, 12:] = 1
  for head, seed in (("pretraining", 5), ("classification", 6), ("qa", 7)):
    model = bert_model(head, seed)
    directory = os.path.join(OUT, f"bert-{head}")
    model.save_pretrained(directory)
    if head == "pretraining":
      pytorch_model_bin_shards(model, directory + "-torch", shards=2)
    with torch.no_grad():
      out = model(
        input_ids=torch.tensor(tokens, dtype=torch.long),
        attention_mask=torch.tensor(tokens > 0, dtype=torch.long),
        token_type_ids=torch.tensor(types, dtype=torch.long),
      )
    if head == "pretraining":
      logits = {
        "mlm": out.prediction_logits.numpy(),
        "nsp": out.seq_relationship_logits.numpy(),
      }
    elif head == "classification":
      logits = {"scores": out.logits.numpy()}
    else:
      logits = {
        "scores": np.stack(
          [out.start_logits.numpy(), out.end_logits.numpy()], axis=-1
        )
      }
    np.savez(
      os.path.join(directory, "reference.npz"),
      tokens=tokens.astype(np.int32),
      types=types.astype(np.int32),
      **logits,
    )
  counts = {}
  for size, fields in (
    (
      "base",
      dict(
        hidden_size=768,
        num_hidden_layers=12,
        num_attention_heads=12,
        intermediate_size=3072,
      ),
    ),
    (
      "large",
      dict(
        hidden_size=1024,
        num_hidden_layers=24,
        num_attention_heads=16,
        intermediate_size=4096,
      ),
    ),
  ):
    with torch.device("meta"):  # Shapes only.
      full = transformers.BertForPreTraining(transformers.BertConfig(**fields))
    counts[f"bert-{size}-pretraining"] = full.num_parameters()
  with open(os.path.join(OUT, "bert_counts.json"), "w") as f:
    json.dump(counts, f)
  offsets = np.arange(-300, 300)[None, :]
  np.savez(
    os.path.join(OUT, "t5_buckets.npz"),
    offsets=offsets,
    **{
      f"bidirectional_{b}": T5Attention._relative_position_bucket(
        torch.tensor(offsets), b, 32, 128
      ).numpy()
      for b in (True, False)
    },
  )
  torch_dtypes({"zip.pt": False, "legacy.pt": True})
  with open(os.path.join(OUT, "versions.json"), "w") as f:
    json.dump(
      {"torch": torch.__version__, "transformers": transformers.__version__},
      f,
    )
  print("wrote", OUT)


if __name__ == "__main__":
  main()
