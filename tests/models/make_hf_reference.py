"""Writes the HuggingFace reference the model tests compare against:
tiny random T5 v1.0 / v1.1 checkpoints (``save_pretrained``: safetensors,
v1.1 in shards with an index), GPT-2's and BERT's (its three heads),
their logits, T5's relative position buckets and BERT's parameter
counts at full size, from HuggingFace's PyTorch implementation.

The tests read these files, so they need neither torch nor transformers.
Regenerate (after a change of the reference library) with

  pip install -e ".[reference]"   # torch (its CPU build) and transformers
  python -m tests.models.make_hf_reference

Written with torch 2.13.0+cpu and transformers 5.24.0.
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
  tokens = rng.integers(1, BERT_TINY["vocab_size"], size=(2, 24))
  tokens[1, 17:] = 0  # [PAD], masked out.
  types = np.zeros_like(tokens)
  types[:, 12:] = 1
  for head, seed in (("pretraining", 5), ("classification", 6), ("qa", 7)):
    model = bert_model(head, seed)
    directory = os.path.join(OUT, f"bert-{head}")
    model.save_pretrained(directory)
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
  with open(os.path.join(OUT, "versions.json"), "w") as f:
    json.dump(
      {"torch": torch.__version__, "transformers": transformers.__version__},
      f,
    )
  print("wrote", OUT)


if __name__ == "__main__":
  main()
