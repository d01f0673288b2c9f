"""A T5-style encoder-decoder (pre-LN, relative attention omitted).

Every decoder layer cross-attends to the encoder's output, so in a pipeline
that output is sent to every decoder stage.
"""

import flax.linen as nn
import jax
import jax.numpy as jnp

from jpipe.models.attention import flax_attention_fn


def _attention(layer, name):
  return nn.MultiHeadDotProductAttention(
    layer.num_heads,
    attention_fn=(
      flax_attention_fn if layer.fused_attention else nn.dot_product_attention
    ),
    name=name,
  )


class EncoderLayer(nn.Module):
  num_heads: int
  fused_attention: bool = True

  @nn.compact
  def __call__(self, x, mask):
    h = nn.LayerNorm(name="ln_0")(x)
    x = x + _attention(self, "attn")(h, mask=mask)
    h = nn.LayerNorm(name="ln_1")(x)
    return x + nn.Dense(x.shape[-1], name="proj")(
      nn.relu(nn.Dense(4 * x.shape[-1], name="fc")(h))
    )


class DecoderLayer(nn.Module):
  num_heads: int
  fused_attention: bool = True

  @nn.compact
  def __call__(self, x, memory, self_mask, cross_mask):
    h = nn.LayerNorm(name="ln_0")(x)
    x = x + _attention(self, "self_attn")(h, mask=self_mask)
    h = nn.LayerNorm(name="ln_1")(x)
    x = x + _attention(self, "cross_attn")(h, memory, mask=cross_mask)
    h = nn.LayerNorm(name="ln_2")(x)
    return x + nn.Dense(x.shape[-1], name="proj")(
      nn.relu(nn.Dense(4 * x.shape[-1], name="fc")(h))
    )


class Model(nn.Module):
  """(inputs int [B, Ls], targets int [B, Lt]) -> logits [B, Lt, vocab].

  Token 0 is padding. Decoder inputs are the targets shifted right.
  """

  vocab_size: int = 256
  width: int = 128
  num_layers: int = 2
  num_heads: int = 4
  # False: flax's explicit softmax (a reference); True: jax.nn's attention.
  fused_attention: bool = True

  @nn.compact
  def __call__(
    self, inputs: jax.Array, targets: jax.Array, train: bool = True
  ) -> jax.Array:
    del train
    embed = nn.Embed(self.vocab_size, self.width, name="embed")
    src_mask = nn.make_attention_mask(inputs > 0, inputs > 0)
    memory = embed(inputs)
    for i in range(self.num_layers):
      memory = EncoderLayer(
        self.num_heads, self.fused_attention, name=f"encoder_{i}"
      )(memory, src_mask)
    memory = nn.LayerNorm(name="encoder_ln")(memory)
    shifted = jnp.pad(targets, ((0, 0), (1, 0)))[:, :-1]
    self_mask = nn.combine_masks(
      nn.make_attention_mask(shifted >= 0, shifted >= 0),
      nn.make_causal_mask(shifted),
    )
    cross_mask = nn.make_attention_mask(shifted >= 0, inputs > 0)
    x = embed(shifted)
    for i in range(self.num_layers):
      x = DecoderLayer(
        self.num_heads, self.fused_attention, name=f"decoder_{i}"
      )(x, memory, self_mask, cross_mask)
    return embed.attend(nn.LayerNorm(name="decoder_ln")(x))
