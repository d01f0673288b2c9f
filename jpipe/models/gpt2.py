"""GPT-2 as published (Radford et al. 2019), small to XL.

The architecture of HuggingFace's ``GPT2LMHeadModel``, so its checkpoints
load by a name map (``hf_names``): learned token and position
embeddings, pre-norm blocks (layer norm, causal attention scaled by
1/sqrt(head width), layer norm, a 4x MLP with tanh-approximated GELU),
a final layer norm and the head tied to the token embedding.

Tokens int [B, L] -> next-token logits float32 [B, L, vocab]. For the
pipeline the modules are the embeddings, every block, the final norm;
the tied head makes the first and last stages share ``wte``.
"""

import functools
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from jpipe.models.attention import dot_product_attention

# HuggingFace's configs of OpenAI's checkpoints (gpt2, -medium, -large,
# -xl): 124M, 355M, 774M, 1.56B parameters.
SIZES = {
  "small": dict(d_model=768, num_layers=12, num_heads=12),
  "medium": dict(d_model=1024, num_layers=24, num_heads=16),
  "large": dict(d_model=1280, num_layers=36, num_heads=20),
  "xl": dict(d_model=1600, num_layers=48, num_heads=25),
}


class Block(nn.Module):
  """Pre-norm causal self-attention and MLP, each added back."""

  num_heads: int
  dropout: float
  eps: float
  dtype: Any = None
  fused_attention: bool = True  # False: the explicit softmax (a reference).
  scanned: bool = False  # Return (x, None): the body of nn.scan.

  @nn.compact
  def __call__(self, x, train: bool, cache=None, index=None, pad=None):
    """x [B, L, d] -> [B, L, d]; with ``cache`` (``{"k", "v"}``, each
    [B, T, heads, width]) the keys and values of slots ``index .. index +
    L - 1`` written into it, attention over its first ``index + L`` slots
    less each row's first ``pad`` (int [B], or None: none), and ``(x, the
    new cache)`` returned."""
    d = x.shape[-1]
    width = d // self.num_heads
    drop = nn.Dropout(self.dropout, deterministic=not train)
    norm = lambda name: nn.LayerNorm(  # noqa: E731
      epsilon=self.eps, dtype=self.dtype, name=name
    )
    dense = lambda n, name: nn.Dense(n, dtype=self.dtype, name=name)  # noqa: E731
    q, k, v = jnp.split(dense(3 * d, "c_attn")(norm("ln_1")(x)), 3, axis=-1)

    def heads(y):
      return y.reshape(*y.shape[:2], self.num_heads, width)

    k, v = heads(k), heads(v)
    length, mask = x.shape[1], None
    if cache is not None:  # Query i is at index + i; the cache holds index + L.
      k, v = (
        jax.lax.dynamic_update_slice(c, y.astype(c.dtype), (0, index, 0, 0))
        for c, y in ((cache["k"], k), (cache["v"], v))
      )
      cache = {"k": k, "v": v}
      k, v = k.astype(q.dtype), v.astype(q.dtype)
      mask = _cache_mask(index + jnp.arange(length), k.shape[1], pad)
    attended = dot_product_attention(
      heads(q),
      k,
      v,
      mask=mask,
      causal=cache is None,
      dropout=drop if train and self.dropout else None,
      fused=self.fused_attention,
    )
    x = x + drop(dense(d, "attn_c_proj")(attended.reshape(x.shape)))
    h = jax.nn.gelu(dense(4 * d, "c_fc")(norm("ln_2")(x)), approximate=True)
    x = x + drop(dense(d, "mlp_c_proj")(h))
    if self.scanned:  # (ys: the layer's new cache, stacked by nn.scan.)
      return x, cache
    return x if cache is None else (x, cache)


def _cache_mask(at, slots: int, pad):
  """bool [B or 1, 1, L, slots]: query i (at slot ``at[i]``) attends the
  slots up to its own, less a row's ``pad`` first ones (a padding query
  attends only itself, so that no softmax row is empty)."""
  key = jnp.arange(slots)[None]
  keep = key <= at[:, None]
  if pad is None:
    return keep[None, None]
  real = (key[None] >= pad[:, None, None]) | (key == at[:, None])[None]
  return (keep[None] & real)[:, None]


class Model(nn.Module):
  """GPT-2 (see the module docstring); sizes by name in ``SIZES``."""

  vocab_size: int = 50257
  n_positions: int = 1024
  d_model: int = 768
  num_layers: int = 12
  num_heads: int = 12
  dropout: float = 0.1
  layer_norm_eps: float = 1e-5
  dtype: Any = None  # Compute dtype (params stay float32).
  # False: the explicit softmax (a reference); True: jax.nn's attention.
  fused_attention: bool = True
  # True: the blocks run under nn.scan, their params stacked on a leading
  # axis under "blocks" (MaxText's and T5X's scan_layers), and so is the KV
  # cache (``empty_cache``: {"blocks": {"k", "v"}} [layers, ...]).
  scan_layers: bool = False

  @nn.compact
  def __call__(
    self, tokens, train: bool = True, cache=None, index=None, pad=None
  ):
    """tokens int [B, L] -> logits float32 [B, L, vocab]. With ``cache``
    (``empty_cache``'s layout, T slots) and ``index`` (int scalar: the
    slot of ``tokens[:, 0]``; index + L <= T): the tokens continue the
    cached prefix, and ``(logits, the cache with their keys and values
    written)`` is returned (incremental decoding). ``pad`` (int [B];
    None: zeros): each row's left padding, slots never attended, the
    row's position 0 at slot ``pad`` (prompts of different lengths)."""
    wte = nn.Embed(
      self.vocab_size,
      self.d_model,
      embedding_init=nn.initializers.normal(0.02),
      dtype=self.dtype,
      name="wte",
    )
    wpe = self.param(
      "wpe", nn.initializers.normal(0.01), (self.n_positions, self.d_model)
    )
    if cache is None:
      positions = wpe[None, : tokens.shape[1]]
    elif pad is None:
      positions = jax.lax.dynamic_slice_in_dim(wpe, index, tokens.shape[1])[
        None
      ]
    else:  # A padding slot's position is clipped to 0 (never attended).
      slots = index + jnp.arange(tokens.shape[1])
      positions = wpe[jnp.maximum(slots[None] - pad[:, None], 0)]
    if self.dtype is not None:
      positions = positions.astype(self.dtype)
    x = nn.Dropout(self.dropout, deterministic=not train)(
      wte(tokens) + positions
    )
    if self.scan_layers:
      x, new_cache = _scanned_blocks(self, x, train, cache, index, pad)
    else:
      x, new_cache = _blocks(self, x, train, cache, index, pad)
    x = nn.LayerNorm(
      epsilon=self.layer_norm_eps, dtype=self.dtype, name="ln_f"
    )(x)
    logits = wte.attend(x).astype(jnp.float32)
    return logits if cache is None else (logits, new_cache)


def _blocks(model: Model, x, train: bool, cache, index, pad):
  """x [B, L, d] through the blocks ``block_0`` .. (each its own params),
  made inside ``Model.__call__`` (its children): (x, the new cache, {}
  without one); ``index``, ``pad`` as ``Block``'s."""
  new_cache = {}
  for i in range(model.num_layers):
    block = Block(
      model.num_heads,
      model.dropout,
      model.layer_norm_eps,
      model.dtype,
      model.fused_attention,
      name=f"block_{i}",
    )
    if cache is None:
      x = block(x, train)
    else:
      x, new_cache[f"block_{i}"] = block(
        x, train, cache[f"block_{i}"], index, pad
      )
  return x, new_cache


def _scanned_blocks(model: Model, x, train: bool, cache, index, pad):
  """x [B, L, d] through the model's blocks as one nn.scan (params
  stacked under "blocks"), made inside ``Model.__call__`` (its child):
  (x, None), or with ``cache`` ({"blocks": {"k", "v"}}, each [layers, B,
  T, heads, width]) each layer's slice scanned with it, (x, the new
  cache)."""
  extra = () if cache is None else (cache["blocks"], index, pad)
  blocks = nn.scan(
    Block,
    variable_axes={"params": 0},
    split_rngs={"params": True, "dropout": True},
    in_axes=(nn.broadcast, *(0, nn.broadcast, nn.broadcast)[: len(extra)]),
    length=model.num_layers,
  )
  x, new = blocks(
    model.num_heads,
    model.dropout,
    model.layer_norm_eps,
    model.dtype,
    model.fused_attention,
    scanned=True,
    name="blocks",
  )(x, train, *extra)
  return x, None if cache is None else {"blocks": new}


def empty_cache(model: Model, batch_size: int, length: int) -> dict:
  """The key/value cache of ``batch_size`` sequences of up to ``length``
  positions: ``{"block_i": {"k", "v"}}``, zeros [batch, length, heads,
  d_model / heads] in the compute dtype (float32 by default); with
  ``scan_layers`` ``{"blocks": {"k", "v"}}`` stacked [layers, ...]."""
  if length > model.n_positions:
    raise ValueError(
      f"a cache of {length} positions exceeds the model's n_positions="
      f"{model.n_positions}: generate fewer tokens or shorten the prompts"
    )
  shape = (
    batch_size,
    length,
    model.num_heads,
    model.d_model // model.num_heads,
  )
  dtype = model.dtype or jnp.float32
  if model.scan_layers:  # Stacked by layer, as the params.
    shape = (model.num_layers, *shape)
    return {
      "blocks": {"k": jnp.zeros(shape, dtype), "v": jnp.zeros(shape, dtype)}
    }
  return {
    f"block_{i}": {"k": jnp.zeros(shape, dtype), "v": jnp.zeros(shape, dtype)}
    for i in range(model.num_layers)
  }


# One function per model: the pipeline compiles its programs per function.
@functools.lru_cache(maxsize=16)
def decode_fn(model: Model):
  """The model's decoding step for ``Pipeline.generate``: ``(params,
  batch) -> (next-token logits float32 [B, vocab] after the last of
  batch["tokens"], the cache with the tokens' keys and values)``; batch:
  "tokens" int [B, L], "index" int [B] (the cache slot of ``tokens[:,
  0]``, the same for every example), "pad" int [B] (each row's left
  padding: its position 0 is at that slot), "cache" (``empty_cache``'s
  layout)."""

  def decode(params, batch):
    logits, cache = model.apply(
      {"params": params},
      batch["tokens"],
      train=False,
      cache=batch["cache"],
      index=batch["index"][0],
      pad=batch["pad"],
    )
    return logits[:, -1], cache

  return decode


def hf_names(model: Model) -> dict[str, tuple[tuple[str, ...], bool]]:
  """Our param path -> (HuggingFace names to try: ``GPT2LMHeadModel``'s
  "transformer.*", then ``GPT2Model``'s as OpenAI's checkpoints on the
  Hub have them; transposed: never -- GPT-2's Conv1D weights are already
  [in, out]). With ``scan_layers`` a stacked leaf maps to a list of such
  names, one per layer (``h.0...``, ``h.1...``), stacked on axis 0."""

  def both(name):
    return ((f"transformer.{name}", name), False)

  names = {
    "wte/embedding": both("wte.weight"),
    "wpe": both("wpe.weight"),
    "ln_f/scale": both("ln_f.weight"),
    "ln_f/bias": both("ln_f.bias"),
  }
  parts = {
    "ln_1": "ln_1",
    "ln_2": "ln_2",
    "c_attn": "attn.c_attn",
    "attn_c_proj": "attn.c_proj",
    "c_fc": "mlp.c_fc",
    "mlp_c_proj": "mlp.c_proj",
  }
  for ours, theirs in parts.items():
    weight = "scale" if ours.startswith("ln") else "kernel"
    for leaf, suffix in ((weight, "weight"), ("bias", "bias")):
      layers = [
        both(f"h.{i}.{theirs}.{suffix}") for i in range(model.num_layers)
      ]
      if model.scan_layers:  # One stacked leaf: a list, a row per layer.
        names[f"blocks/{ours}/{leaf}"] = ([n for n, _ in layers], False)
      else:
        for i, name in enumerate(layers):
          names[f"block_{i}/{ours}/{leaf}"] = name
  return names
