"""Attention through ``jax.nn.dot_product_attention``: cuDNN's fused
kernel on NVIDIA GPUs (no [B, H, Lq, Lk] scores in memory), XLA's
composition elsewhere (the same math as the explicit softmax on CPU).

Dropout on the attention weights needs the weights, which a fused kernel
never forms: where it is active (training with a rate above 0) the
explicit path runs instead, as the models always did. Both paths take
the softmax in float32.
"""

import flax.linen as nn
import jax
import jax.numpy as jnp


def dot_product_attention(
  q,
  k,
  v,
  *,
  bias=None,
  mask=None,
  causal: bool = False,
  scale: float | None = None,
  dropout=None,
  fused: bool = True,
):
  """Multi-head attention of ``q`` [B, Lq, H, D] over ``k``, ``v`` [B, Lk,
  H, D] -> [B, Lq, H, D].

  Args:
    bias: added to the scores, broadcastable to [B, H, Lq, Lk].
    mask: booleans broadcastable to [B, H, Lq, Lk]; False: not attended.
    causal: query i attends keys 0..i only.
    scale: the scores' factor; None: 1 / sqrt(D).
    dropout: applied to the weights (e.g. a bound ``nn.Dropout``); None
      where no dropout is active. With one, the explicit path.
    fused: False: the explicit path (a reference for tests).
  """
  if fused and dropout is None:
    if bias is not None:  # (The kernels take the inputs' dtype.)
      bias = bias.astype(q.dtype)
    return jax.nn.dot_product_attention(
      q, k, v, bias=bias, mask=mask, scale=scale, is_causal=causal
    )
  scale = q.shape[-1] ** -0.5 if scale is None else scale
  scores = jnp.einsum("bqhd,bkhd->bhqk", q, k).astype(jnp.float32) * scale
  if bias is not None:
    scores = scores + bias
  if causal:
    lq, lk = q.shape[1], k.shape[1]
    keep = jnp.tril(jnp.ones((lq, lk), bool), lk - lq)[None, None]
    mask = keep if mask is None else jnp.logical_and(mask, keep)
  if mask is not None:
    scores = jnp.where(mask, scores, jnp.finfo(jnp.float32).min)
  weights = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
  if dropout is not None:
    weights = dropout(weights)
  return jnp.einsum("bhqk,bkhd->bqhd", weights, v)


def flax_attention_fn(
  query,
  key,
  value,
  mask=None,
  dropout_rng=None,
  dropout_rate=0.0,
  broadcast_dropout=True,
  deterministic=False,
  dtype=None,
  precision=None,
  force_fp32_for_softmax=False,
):
  """``nn.MultiHeadDotProductAttention``'s ``attention_fn``: the fused
  path without active dropout, ``nn.dot_product_attention`` with it."""
  if deterministic or dropout_rate == 0.0:
    if mask is not None:  # (flax's masks are numbers: 1 attends.)
      mask = mask.astype(bool)
    return jax.nn.dot_product_attention(query, key, value, mask=mask)
  return nn.dot_product_attention(
    query,
    key,
    value,
    mask=mask,
    dropout_rng=dropout_rng,
    dropout_rate=dropout_rate,
    broadcast_dropout=broadcast_dropout,
    deterministic=deterministic,
    dtype=dtype,
    precision=precision,
    force_fp32_for_softmax=force_fp32_for_softmax,
  )
