"""A GPT-style decoder-only language model with tied embeddings."""

from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from jpipe.models.attention import flax_attention_fn


class Block(nn.Module):
  """Pre-LN causal self-attention and MLP, both residual."""

  num_heads: int
  mlp_ratio: int = 4
  dropout: float = 0.0
  dtype: Any = None
  num_classes: int = 0  # > 0: a head of this many outputs, not the LM's.
  fused_attention: bool = True

  @nn.compact
  def __call__(self, x, train: bool):
    length = x.shape[1]
    mask = nn.make_causal_mask(jnp.ones((x.shape[0], length), jnp.int32))
    h = nn.LayerNorm(dtype=self.dtype, name="ln_0")(x)
    h = nn.MultiHeadDotProductAttention(
      self.num_heads,
      dtype=self.dtype,
      dropout_rate=self.dropout,
      deterministic=not train,
      attention_fn=(
        flax_attention_fn if self.fused_attention else nn.dot_product_attention
      ),
      name="attn",
    )(h, h, mask=mask)
    x = x + h
    h = nn.LayerNorm(dtype=self.dtype, name="ln_1")(x)
    h = nn.Dense(self.mlp_ratio * x.shape[-1], dtype=self.dtype, name="fc")(h)
    h = nn.Dense(x.shape[-1], dtype=self.dtype, name="proj")(nn.gelu(h))
    if self.dropout:
      h = nn.Dropout(self.dropout, deterministic=not train)(h)
    return x + h


class Model(nn.Module):
  """Tokens int [B, L] -> next-token logits [B, L, vocab], or with
  ``num_classes`` > 0 per-position scores [B, L, num_classes] of a head
  of its own (``head``: a Dense layer, as HuggingFace's
  GPT2ForSequenceClassification, which reads the last token's, and
  GPT2ForQuestionAnswering, num_classes = 2: span start and end).

  The token embedding is also the output projection (``embed.attend``),
  so the first and the last pipeline stage share it (not with a head).

  ``dtype`` is the compute dtype (e.g. ``jnp.bfloat16``: mixed precision
  with float32 params, which stay float32 whatever it is); None computes
  in the params' dtype. The logits are float32 either way, so the loss is.
  """

  vocab_size: int = 256
  width: int = 128
  num_layers: int = 4
  num_heads: int = 4
  max_length: int = 256
  dropout: float = 0.0
  dtype: Any = None
  num_classes: int = 0  # > 0: a head of this many outputs, not the LM's.
  # False: flax's explicit softmax (a reference); True: jax.nn's attention.
  fused_attention: bool = True

  @nn.compact
  def __call__(self, tokens: jax.Array, train: bool = True) -> jax.Array:
    embed = nn.Embed(
      self.vocab_size, self.width, dtype=self.dtype, name="embed"
    )
    positions = self.param(
      "pos_embed", nn.initializers.normal(0.02), (self.max_length, self.width)
    )
    positions = positions[None, : tokens.shape[1]]
    if self.dtype is not None:
      positions = positions.astype(self.dtype)
    x = embed(tokens) + positions
    for i in range(self.num_layers):
      x = Block(
        self.num_heads,
        dropout=self.dropout,
        dtype=self.dtype,
        fused_attention=self.fused_attention,
        name=f"block_{i}",
      )(x, train)
    x = nn.LayerNorm(dtype=self.dtype, name="ln_f")(x)
    if self.num_classes:
      logits = nn.Dense(self.num_classes, dtype=self.dtype, name="head")(x)
    else:
      logits = embed.attend(x)
    return logits if self.dtype is None else logits.astype(jnp.float32)
