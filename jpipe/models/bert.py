"""BERT as published (Devlin et al. 2019), base and large, with its
pre-training, classification and span (SQuAD) heads.

The architecture of HuggingFace's ``BertForPreTraining`` /
``BertForSequenceClassification`` / ``BertForQuestionAnswering``, so its
checkpoints load by a name map (``hf_names``): word + position + token
type embeddings and a layer norm, post-norm blocks (attention scaled by
1/sqrt(head width) with padding masked, erf GELU MLP), a tanh pooler on
the first token.

Tokens int [B, L] (0 is [PAD], masked out of attention), optional token
types int [B, L] (default 0) -> by ``head``:
"pretraining": (masked-LM logits [B, L, vocab] with the decoder tied to
the word embedding, next-sentence logits [B, 2]); "classification":
[B, num_classes] of the pooled first token; "qa": span start/end scores
[B, L, 2].
"""

from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from jpipe.models.attention import dot_product_attention

# HuggingFace's configs of Google's checkpoints (bert-base-uncased,
# bert-large-uncased).
SIZES = {
  "base": dict(d_model=768, num_layers=12, num_heads=12, d_ff=3072),
  "large": dict(d_model=1024, num_layers=24, num_heads=16, d_ff=4096),
}
HEADS = ("pretraining", "classification", "qa")


class Block(nn.Module):
  """Post-norm: LN(x + attention(x)), then LN(h + MLP(h))."""

  num_heads: int
  d_ff: int
  dropout: float
  eps: float
  dtype: Any = None
  fused_attention: bool = True  # False: the explicit softmax (a reference).

  @nn.compact
  def __call__(self, x, mask_bias, train: bool):
    d = x.shape[-1]
    width = d // self.num_heads
    drop = nn.Dropout(self.dropout, deterministic=not train)
    dense = lambda n, name: nn.Dense(n, dtype=self.dtype, name=name)  # noqa: E731
    norm = lambda name: nn.LayerNorm(  # noqa: E731
      epsilon=self.eps, dtype=self.dtype, name=name
    )

    def heads(y):
      return y.reshape(*y.shape[:2], self.num_heads, width)

    q, k, v = (heads(dense(d, n)(x)) for n in ("query", "key", "value"))
    attended = dot_product_attention(
      q,
      k,
      v,
      bias=mask_bias,
      dropout=drop if train and self.dropout else None,
      fused=self.fused_attention,
    ).reshape(x.shape)
    h = norm("attention_norm")(x + drop(dense(d, "attention_out")(attended)))
    inner = jax.nn.gelu(dense(self.d_ff, "intermediate")(h), approximate=False)
    return norm("output_norm")(h + drop(dense(d, "output")(inner)))


class Model(nn.Module):
  """BERT (see the module docstring); sizes by name in ``SIZES``."""

  vocab_size: int = 30522
  max_position: int = 512
  type_vocab_size: int = 2
  d_model: int = 768
  num_layers: int = 12
  num_heads: int = 12
  d_ff: int = 3072
  dropout: float = 0.1
  layer_norm_eps: float = 1e-12
  head: str = "pretraining"
  num_classes: int = 2  # The classification head's classes.
  dtype: Any = None  # Compute dtype (params stay float32).
  # False: the explicit softmax (a reference); True: jax.nn's attention.
  fused_attention: bool = True

  @nn.compact
  def __call__(self, tokens, token_types=None, train: bool = True):
    if self.head not in HEADS:
      raise ValueError(f"BERT head {self.head!r}: use one of {HEADS}")
    drop = nn.Dropout(self.dropout, deterministic=not train)
    norm = lambda name: nn.LayerNorm(  # noqa: E731
      epsilon=self.layer_norm_eps, dtype=self.dtype, name=name
    )
    init = nn.initializers.normal(0.02)
    words = nn.Embed(
      self.vocab_size,
      self.d_model,
      embedding_init=init,
      dtype=self.dtype,
      name="word_embeddings",
    )
    if token_types is None:
      token_types = jnp.zeros_like(tokens)
    x = self._embeddings(words, tokens, token_types, init)
    x = drop(norm("embeddings_norm")(x))
    keep = tokens > 0
    mask_bias = jnp.where(
      keep[:, None, None, :], 0.0, jnp.finfo(jnp.float32).min
    )
    for i in range(self.num_layers):
      x = Block(
        self.num_heads,
        self.d_ff,
        self.dropout,
        self.layer_norm_eps,
        self.dtype,
        self.fused_attention,
        name=f"layer_{i}",
      )(x, mask_bias, train)
    if self.head == "qa":
      return nn.Dense(2, dtype=self.dtype, name="qa_outputs")(x).astype(
        jnp.float32
      )
    pooled = jnp.tanh(
      nn.Dense(self.d_model, dtype=self.dtype, name="pooler")(x[:, 0])
    )
    if self.head == "classification":
      scores = nn.Dense(self.num_classes, dtype=self.dtype, name="classifier")(
        drop(pooled)
      )
      return scores.astype(jnp.float32)
    h = nn.Dense(self.d_model, dtype=self.dtype, name="mlm_transform")(x)
    h = norm("mlm_norm")(jax.nn.gelu(h, approximate=False))
    bias = self.param("mlm_bias", nn.initializers.zeros, (self.vocab_size,))
    mlm = words.attend(h) + bias.reshape(1, 1, -1)
    nsp = nn.Dense(2, dtype=self.dtype, name="seq_relationship")(pooled)
    return mlm.astype(jnp.float32), nsp.astype(jnp.float32)

  def _embeddings(self, words, tokens, token_types, init):
    positions = self.param(
      "position_embeddings", init, (self.max_position, self.d_model)
    )
    types = self.param(
      "token_type_embeddings", init, (self.type_vocab_size, self.d_model)
    )
    x = words(tokens) + positions[None, : tokens.shape[1]] + types[token_types]
    return x if self.dtype is None else x.astype(self.dtype)


def hf_names(model: Model) -> dict:
  """Our param path -> (HuggingFace names to try, transposed): torch
  Linear weights are [out, in]; old checkpoints name layer norms
  gamma / beta."""

  def linear(ours, theirs):
    return {
      f"{ours}/kernel": ((f"{theirs}.weight",), True),
      f"{ours}/bias": ((f"{theirs}.bias",), False),
    }

  def layer_norm(ours, theirs):
    return {
      f"{ours}/scale": ((f"{theirs}.weight", f"{theirs}.gamma"), False),
      f"{ours}/bias": ((f"{theirs}.bias", f"{theirs}.beta"), False),
    }

  e = "bert.embeddings"
  names = {
    "word_embeddings/embedding": ((f"{e}.word_embeddings.weight",), False),
    "position_embeddings": ((f"{e}.position_embeddings.weight",), False),
    "token_type_embeddings": ((f"{e}.token_type_embeddings.weight",), False),
    **layer_norm("embeddings_norm", f"{e}.LayerNorm"),
  }
  for i in range(model.num_layers):
    ours, theirs = f"layer_{i}", f"bert.encoder.layer.{i}"
    for part in ("query", "key", "value"):
      names.update(linear(f"{ours}/{part}", f"{theirs}.attention.self.{part}"))
    names.update(
      linear(f"{ours}/attention_out", f"{theirs}.attention.output.dense")
    )
    names.update(
      layer_norm(
        f"{ours}/attention_norm", f"{theirs}.attention.output.LayerNorm"
      )
    )
    names.update(linear(f"{ours}/intermediate", f"{theirs}.intermediate.dense"))
    names.update(linear(f"{ours}/output", f"{theirs}.output.dense"))
    names.update(
      layer_norm(f"{ours}/output_norm", f"{theirs}.output.LayerNorm")
    )
  if model.head == "qa":
    names.update(linear("qa_outputs", "qa_outputs"))
    return names
  names.update(linear("pooler", "bert.pooler.dense"))
  if model.head == "classification":
    names.update(linear("classifier", "classifier"))
    return names
  names.update(linear("mlm_transform", "cls.predictions.transform.dense"))
  names.update(layer_norm("mlm_norm", "cls.predictions.transform.LayerNorm"))
  names["mlm_bias"] = (("cls.predictions.bias",), False)
  names.update(linear("seq_relationship", "cls.seq_relationship"))
  return names
