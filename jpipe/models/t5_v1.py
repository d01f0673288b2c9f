"""T5 as published (Raffel et al. 2020), v1.0 and v1.1, at every size.

The architecture of HuggingFace's ``T5ForConditionalGeneration`` (and
the original Mesh TensorFlow T5), so its checkpoints load by a name map
(``hf_names``): RMS layer norms without bias or mean, attention without
biases and without 1/sqrt(d) scaling (folded into the init), relative
position buckets shared by every layer of a stack (bidirectional in the
encoder, causal in the decoder), ReLU feed-forward (v1.0) or gated GELU
(v1.1), the LM head tied to the embedding and scaled by d_model^-0.5
(v1.0) or untied (v1.1).

(inputs int [B, Ls], targets int [B, Lt]) -> logits float32 [B, Lt,
vocab]; token 0 is padding (masked out of attention) and the decoder
start; the decoder reads the targets shifted right.

For the pipeline, the modules a partitioner splits at are the embedding,
each stack's position bias, every block and each stack's final norm; the
position bias [1, heads, Lq, Lk] travels with the activations.
"""

import math
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from jpipe.models import decoding
from jpipe.models.attention import dot_product_attention

# HuggingFace's configs of Google's checkpoints: t5-small ... t5-11b
# (v1.0) and google/t5-v1_1-small ... -xxl (v1.1).
SIZES = {
  "small": dict(d_model=512, d_kv=64, d_ff=2048, num_layers=6, num_heads=8),
  "base": dict(d_model=768, d_kv=64, d_ff=3072, num_layers=12, num_heads=12),
  "large": dict(d_model=1024, d_kv=64, d_ff=4096, num_layers=24, num_heads=16),
  "3b": dict(d_model=1024, d_kv=128, d_ff=16384, num_layers=24, num_heads=32),
  "11b": dict(d_model=1024, d_kv=128, d_ff=65536, num_layers=24, num_heads=128),
  "v1_1-small": dict(
    d_model=512, d_kv=64, d_ff=1024, num_layers=8, num_heads=6, version="1.1"
  ),
  "v1_1-base": dict(
    d_model=768, d_kv=64, d_ff=2048, num_layers=12, num_heads=12, version="1.1"
  ),
  "v1_1-large": dict(
    d_model=1024, d_kv=64, d_ff=2816, num_layers=24, num_heads=16, version="1.1"
  ),
  "v1_1-xl": dict(
    d_model=2048, d_kv=64, d_ff=5120, num_layers=24, num_heads=32, version="1.1"
  ),
  "v1_1-xxl": dict(
    d_model=4096,
    d_kv=64,
    d_ff=10240,
    num_layers=24,
    num_heads=64,
    version="1.1",
  ),
}


def relative_position_bucket(
  relative_position, bidirectional: bool, num_buckets: int, max_distance: int
):
  """T5's bucket of each (key - query) offset: exact for small offsets,
  logarithmic up to ``max_distance``; in a bidirectional stack half the
  buckets are for keys after the query."""
  buckets = 0
  if bidirectional:
    num_buckets //= 2
    buckets += (relative_position > 0).astype(jnp.int32) * num_buckets
    distance = jnp.abs(relative_position)
  else:
    distance = -jnp.minimum(relative_position, 0)
  max_exact = num_buckets // 2
  is_small = distance < max_exact
  # (log of 0 for the small ones is discarded by the where below.)
  large = max_exact + (
    jnp.log(jnp.maximum(distance, 1).astype(jnp.float32) / max_exact)
    / math.log(max_distance / max_exact)
    * (num_buckets - max_exact)
  ).astype(jnp.int32)
  large = jnp.minimum(large, num_buckets - 1)
  return buckets + jnp.where(is_small, distance, large)


class RMSNorm(nn.Module):
  """T5's layer norm: x / rms(x) * weight (no mean, no bias), in float32."""

  eps: float = 1e-6

  @nn.compact
  def __call__(self, x):
    weight = self.param("weight", nn.initializers.ones, (x.shape[-1],))
    x32 = x.astype(jnp.float32)
    variance = jnp.mean(jnp.square(x32), axis=-1, keepdims=True)
    scale = weight.reshape((1,) * (x.ndim - 1) + (-1,))
    return (x32 * jax.lax.rsqrt(variance + self.eps) * scale).astype(x.dtype)


class PositionBias(nn.Module):
  """[1, heads, Lq, Lk] additive attention bias of a stack's relative
  positions (``relative_attention_bias``: [buckets, heads])."""

  num_heads: int
  bidirectional: bool
  num_buckets: int = 32
  max_distance: int = 128

  @nn.compact
  def __call__(self, query_length: int, key_length: int, query_offset=0):
    """The bias of queries at ``query_offset ..`` over keys at ``0 ..``."""
    table = self.param(
      "relative_attention_bias",
      nn.initializers.normal(1.0),
      (self.num_buckets, self.num_heads),
    )
    queries = query_offset + jnp.arange(query_length)
    offsets = jnp.arange(key_length)[None, :] - queries[:, None]
    buckets = relative_position_bucket(
      offsets, self.bidirectional, self.num_buckets, self.max_distance
    )
    return jnp.transpose(table[buckets], (2, 0, 1))[None]


class Attention(nn.Module):
  """Multi-head attention without biases or score scaling."""

  num_heads: int
  d_kv: int
  dtype: Any = None
  fused_attention: bool = True

  @nn.compact
  def __call__(self, x, memory, bias, cache=None, index=None):
    """x [B, Lq, d] attends to memory [B, Lk, d]. With ``cache``
    (``{"k", "v"}`` [B, T, heads, d_kv]), ``(out, new cache)``: self-
    attention (``index`` given) writes this call's keys and values at
    ``index``; cross-attention computes them from ``memory`` when given,
    else reads them from the cache."""
    inner = self.num_heads * self.d_kv
    d_model = x.shape[-1]
    dense = lambda n, name: nn.Dense(  # noqa: E731
      n, use_bias=False, dtype=self.dtype, name=name
    )

    def heads(y):
      return y.reshape(*y.shape[:2], self.num_heads, self.d_kv)

    q = heads(dense(inner, "q")(x))
    if cache is None or memory is not None:
      k = heads(dense(inner, "k")(memory))
      v = heads(dense(inner, "v")(memory))
    if cache is not None:
      if index is not None:  # Self-attention: this call's positions.
        k, v = (
          jax.lax.dynamic_update_slice(c, y.astype(c.dtype), (0, index, 0, 0))
          for c, y in ((cache["k"], k), (cache["v"], v))
        )
      elif memory is not None:  # Cross-attention's first call.
        k, v = k.astype(cache["k"].dtype), v.astype(cache["v"].dtype)
      else:
        k, v = cache["k"], cache["v"]
      cache = {"k": k, "v": v}
      k, v = k.astype(q.dtype), v.astype(q.dtype)
    # T5 does not scale the scores (its init does).
    out = dot_product_attention(
      q, k, v, bias=bias, scale=1.0, fused=self.fused_attention
    )
    out = dense(d_model, "o")(out.reshape(*out.shape[:2], inner))
    return out if cache is None else (out, cache)


class FeedForward(nn.Module):
  """ReLU (v1.0: wi, wo) or gated GELU (v1.1: gelu(wi_0 x) * wi_1 x, wo)."""

  d_ff: int
  gated: bool
  dropout: float
  dtype: Any = None

  @nn.compact
  def __call__(self, x, train: bool):
    dense = lambda n, name: nn.Dense(  # noqa: E731
      n, use_bias=False, dtype=self.dtype, name=name
    )
    if self.gated:
      h = jax.nn.gelu(dense(self.d_ff, "wi_0")(x), approximate=True)
      h = h * dense(self.d_ff, "wi_1")(x)
    else:
      h = jax.nn.relu(dense(self.d_ff, "wi")(x))
    h = nn.Dropout(self.dropout)(h, deterministic=not train)
    return dense(x.shape[-1], "wo")(h)


class Block(nn.Module):
  """A pre-norm block: self-attention, (decoder: cross-attention), feed-
  forward, each added back after dropout."""

  num_heads: int
  d_kv: int
  d_ff: int
  gated: bool
  dropout: float
  decoder: bool
  dtype: Any = None
  fused_attention: bool = True

  @nn.compact
  def __call__(
    self,
    x,
    self_bias,
    memory=None,
    cross_bias=None,
    train=True,
    cache=None,
    index=None,
  ):
    """With ``cache`` (``{"self", "cross"}``, ``Attention``'s each; a
    decoder's) and ``index``: ``(x, the new cache)``."""
    drop = nn.Dropout(self.dropout, deterministic=not train)
    attend = lambda name: Attention(  # noqa: E731
      self.num_heads, self.d_kv, self.dtype, self.fused_attention, name=name
    )
    new = {}

    def attention(name, y, memory, bias, index=None):
      if cache is None:
        return attend(name)(y, memory, bias)
      out, new[name.split("_")[0]] = attend(name)(
        y, memory, bias, cache[name.split("_")[0]], index
      )
      return out

    h = RMSNorm(name="self_attention_norm")(x)
    x = x + drop(attention("self_attention", h, h, self_bias, index))
    if self.decoder:
      h = RMSNorm(name="cross_attention_norm")(x)
      x = x + drop(attention("cross_attention", h, memory, cross_bias))
    h = RMSNorm(name="feed_forward_norm")(x)
    ff = FeedForward(
      self.d_ff, self.gated, self.dropout, self.dtype, name="feed_forward"
    )
    x = x + drop(ff(h, train))
    return x if cache is None else (x, new)


def _mask_bias(keep):
  """[B, 1, 1|Lq, Lk] 0 where attention may look, a large negative
  elsewhere (``keep`` bool [B, 1|Lq, Lk])."""
  return jnp.where(keep[:, None], 0.0, jnp.finfo(jnp.float32).min)


class Model(nn.Module):
  """T5 (see the module docstring). ``version`` "1.0" or "1.1"; sizes by
  name in ``SIZES`` (``Model(**SIZES["3b"])``)."""

  vocab_size: int = 32128
  d_model: int = 512
  d_kv: int = 64
  d_ff: int = 2048
  num_layers: int = 6
  num_decoder_layers: int | None = None  # None: num_layers.
  num_heads: int = 8
  relative_attention_num_buckets: int = 32
  relative_attention_max_distance: int = 128
  dropout: float = 0.1
  version: str = "1.0"
  dtype: Any = None  # Compute dtype (params stay float32).
  # False: the explicit softmax (a reference); True: jax.nn's attention.
  fused_attention: bool = True

  def _block(self, decoder, name):
    return Block(
      self.num_heads,
      self.d_kv,
      self.d_ff,
      gated=self.version == "1.1",
      dropout=self.dropout,
      decoder=decoder,
      dtype=self.dtype,
      fused_attention=self.fused_attention,
      name=name,
    )

  def _bias(self, bidirectional, name):
    return PositionBias(
      self.num_heads,
      bidirectional,
      self.relative_attention_num_buckets,
      self.relative_attention_max_distance,
      name=name,
    )

  @nn.compact
  def __call__(
    self,
    inputs,
    targets,
    train: bool = True,
    cache=None,
    index=None,
    encode: bool = True,
  ):
    """(inputs int [B, Ls], targets int [B, Lt]) -> logits float32 [B,
    Lt, vocab]. With ``cache`` (``empty_cache``'s layout) and ``index``
    (int scalar): incremental decoding -- ``targets`` are the decoder's
    input tokens at positions ``index ..`` (not shifted; the first is
    the start token 0), the encoder runs only when ``encode`` (the first
    call: each decoder block's cross-attention keys and values go into
    the cache, read by later calls), and ``(logits, the new cache)`` is
    returned."""
    if self.version not in ("1.0", "1.1"):
      raise ValueError(f"T5 version {self.version!r}: use '1.0' or '1.1'")
    drop = nn.Dropout(self.dropout, deterministic=not train)
    embed = nn.Embed(
      self.vocab_size,
      self.d_model,
      embedding_init=nn.initializers.normal(1.0),
      dtype=self.dtype,
      name="shared",
    )
    source_keep = inputs > 0
    memory = None
    if cache is None or encode:
      x = drop(embed(inputs))
      bias = self._bias(True, "encoder_position_bias")(
        inputs.shape[1], inputs.shape[1]
      )
      bias = bias + _mask_bias(source_keep[:, None, :])
      for i in range(self.num_layers):
        x = self._block(False, f"encoder_block_{i}")(x, bias, train=train)
      memory = drop(RMSNorm(name="encoder_norm")(x))

    length = targets.shape[1]
    if cache is None:
      y = drop(embed(jnp.pad(targets, ((0, 0), (1, 0)))[:, :-1]))
      keys, queries = jnp.arange(length), jnp.arange(length)
    else:
      y = drop(embed(targets))
      keys = jnp.arange(cache["decoder_block_0"]["self"]["k"].shape[1])
      queries = index + jnp.arange(length)
    causal = keys[None, :] <= queries[:, None]
    self_bias = self._bias(False, "decoder_position_bias")(
      length, len(keys), 0 if cache is None else index
    )
    self_bias = self_bias + _mask_bias(causal[None])
    cross_bias = _mask_bias(source_keep[:, None, :])
    new_cache = {}
    for i in range(self.num_decoder_layers or self.num_layers):
      name = f"decoder_block_{i}"
      block = self._block(True, name)
      if cache is None:
        y = block(y, self_bias, memory, cross_bias, train=train)
      else:
        y, new_cache[name] = block(
          y, self_bias, memory, cross_bias, train, cache[name], index
        )
    y = drop(RMSNorm(name="decoder_norm")(y))
    if self.version == "1.0":  # Tied, rescaled (Mesh TF's convention).
      logits = embed.attend(y * self.d_model**-0.5)
    else:
      logits = nn.Dense(
        self.vocab_size, use_bias=False, dtype=self.dtype, name="lm_head"
      )(y)
    logits = logits.astype(jnp.float32)
    return logits if cache is None else (logits, new_cache)


def empty_cache(
  model: Model, batch_size: int, length: int, source_length: int
) -> dict:
  """Each decoder block's cache for ``batch_size`` sequences of up to
  ``length`` decoder positions over sources of ``source_length`` tokens:
  ``{"decoder_block_i": {"self": {"k", "v"}, "cross": {"k", "v"}}}``,
  zeros [batch, length or source_length, heads, d_kv] in the compute
  dtype (float32 by default)."""
  dtype = model.dtype or jnp.float32

  def zeros(n):
    shape = (batch_size, n, model.num_heads, model.d_kv)
    return {"k": jnp.zeros(shape, dtype), "v": jnp.zeros(shape, dtype)}

  return {
    f"decoder_block_{i}": {"self": zeros(length), "cross": zeros(source_length)}
    for i in range(model.num_decoder_layers or model.num_layers)
  }


def decode_fns(model: Model):
  """The model's ``(prefill_fn, decode_fn)`` for ``Pipeline.generate``
  (``decoding.encoder_decoder_fns``: "inputs" the sources, "tokens" the
  decoder's input, at positions "index", "cache" ``empty_cache``'s
  layout; the prefill runs the encoder too)."""
  return decoding.encoder_decoder_fns(model, with_index=True)


def hf_names(model: Model) -> dict[str, tuple[str | tuple[str, ...], bool]]:
  """Our param path ("a/b/c") -> (HuggingFace's PyTorch state-dict name,
  or names to try in order; whether the array is transposed: torch
  Linear weights are [out, in], Flax kernels [in, out])."""
  names = {"shared/embedding": ("shared.weight", False)}
  if model.version == "1.1":
    # Google's v1.1 checkpoints have their own head; transformers >= 5
    # ties it to the embedding and saves only "shared.weight".
    names["lm_head/kernel"] = (("lm_head.weight", "shared.weight"), True)
  for stack, prefix, count in (
    ("encoder", "encoder", model.num_layers),
    ("decoder", "decoder", model.num_decoder_layers or model.num_layers),
  ):
    names[f"{stack}_position_bias/relative_attention_bias"] = (
      f"{prefix}.block.0.layer.0.SelfAttention.relative_attention_bias.weight",
      False,
    )
    names[f"{stack}_norm/weight"] = (f"{prefix}.final_layer_norm.weight", False)
    for i in range(count):
      ours, theirs = f"{stack}_block_{i}", f"{prefix}.block.{i}.layer"
      parts = [("self_attention", "0.SelfAttention")]
      norms = [("self_attention_norm", "0.layer_norm")]
      ff = "1"
      if stack == "decoder":
        parts.append(("cross_attention", "1.EncDecAttention"))
        norms.append(("cross_attention_norm", "1.layer_norm"))
        ff = "2"
      for part, hf in parts:
        for w in "qkvo":
          names[f"{ours}/{part}/{w}/kernel"] = (
            f"{theirs}.{hf}.{w}.weight",
            True,
          )
      norms.append(("feed_forward_norm", f"{ff}.layer_norm"))
      for norm, hf in norms:
        names[f"{ours}/{norm}/weight"] = (f"{theirs}.{hf}.weight", False)
      dense = ("wi_0", "wi_1", "wo") if model.version == "1.1" else ("wi", "wo")
      for w in dense:
        names[f"{ours}/feed_forward/{w}/kernel"] = (
          f"{theirs}.{ff}.DenseReluDense.{w}.weight",
          True,
        )
  return names
