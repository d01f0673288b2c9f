"""GNMT (Wu et al. 2016) as PipeDream and MLPerf train it: an LSTM
encoder-decoder with attention.

The encoder: token embeddings, a bidirectional LSTM (the two directions'
outputs concatenated), then ``num_layers - 1`` LSTMs, a residual
connection around each from the third layer on. The decoder: target
embeddings (the targets shifted right), an LSTM whose outputs query a
normalised Bahdanau attention over the encoder's outputs (padding
masked) -- MLPerf's "recurrent attention", computed for all steps at
once under teacher forcing -- then ``num_layers - 1`` LSTMs each reading
[previous output; attention context], residual from the third layer on,
and a dense classifier; one embedding table serves both sides (MLPerf's
``share_embedding``). Dropout between layers. GNMT-8 (``SIZES["8"]``)
has 4 + 4 LSTM layers, GNMT-16 8 + 8 (PipeDream's ``gnmt`` and
``gnmt_large``), hidden width 1024, a shared 32,320-token vocabulary.

Each LSTM is a ``flax.linen.RNN`` -- a ``lax.scan`` over time -- and one
module, so the partitioner treats it as one node (it never cuts inside
a recurrence). Flax's LSTM cell has one bias per gate (PyTorch's two).

inputs int [B, S], targets int [B, T] (0 pads) -> logits float32 [B, T,
vocab].
"""

import flax.linen as nn
import jax
import jax.numpy as jnp

# PipeDream's gnmt (GNMT-8) and gnmt_large (GNMT-16): LSTM layers per
# side.
SIZES = {
  "8": dict(num_layers=4),
  "16": dict(num_layers=8),
}


class Lstm(nn.Module):
  """One LSTM layer over time (a scan): [B, L, D_in] -> [B, L, hidden]."""

  hidden: int

  @nn.compact
  def __call__(self, x):
    return nn.RNN(nn.OptimizedLSTMCell(self.hidden, name="cell"))(x)


class BidirectionalLstm(nn.Module):
  """Forward and backward LSTMs, outputs concatenated: [B, L, 2 hidden]."""

  hidden: int

  @nn.compact
  def __call__(self, x):
    forward = nn.RNN(nn.OptimizedLSTMCell(self.hidden, name="forward"))(x)
    backward = nn.RNN(
      nn.OptimizedLSTMCell(self.hidden, name="backward"),
      reverse=True,
      keep_order=True,
    )(x)
    return jnp.concatenate([forward, backward], axis=-1)


class BahdanauAttention(nn.Module):
  """Normalised additive attention (MLPerf GNMT's): score(q, k) =
  g * v / |v| . tanh(W_q q + W_k k + b); keys where ``mask`` is False
  get no weight. query [B, T, H], keys [B, S, H] -> context [B, T, H]."""

  hidden: int

  @nn.compact
  def __call__(self, query, keys, mask):
    q = nn.Dense(self.hidden, use_bias=False, name="query")(query)
    k = nn.Dense(self.hidden, use_bias=False, name="key")(keys)
    bias = self.param("bias", nn.initializers.zeros, (self.hidden,))
    v = self.param(
      "v", nn.initializers.uniform(0.1), (self.hidden,)
    )  # (MLPerf: uniform(-0.1, 0.1); the sign does not matter here.)
    g = self.param(
      "g",
      lambda key, shape: jnp.full(shape, jnp.sqrt(1.0 / self.hidden)),
      (),
    )
    v = g * v / jnp.linalg.norm(v)
    hidden = jnp.tanh(
      q[:, :, None, :] + k[:, None, :, :] + bias[None, None, None]
    )
    scores = jnp.einsum("btsh,h->bts", hidden, v)
    scores = jnp.where(mask[:, None, :], scores, jnp.finfo(scores.dtype).min)
    weights = jax.nn.softmax(scores, axis=-1)
    return jnp.einsum("bts,bsh->bth", weights, keys)


class Model(nn.Module):
  """GNMT (see the module docstring); sizes by name in ``SIZES``."""

  vocab_size: int = 32320
  hidden: int = 1024
  num_layers: int = 4  # LSTM layers of the encoder, and of the decoder.
  dropout: float = 0.2

  @nn.compact
  def __call__(self, inputs, targets, train: bool = True):
    if self.num_layers < 2:
      raise ValueError(f"GNMT needs num_layers >= 2, got {self.num_layers}")
    drop = nn.Dropout(self.dropout, deterministic=not train)
    # One embedding for both sides (MLPerf's share_embedding).
    embed = nn.Embed(self.vocab_size, self.hidden, name="embedding")
    x = drop(embed(inputs))
    x = BidirectionalLstm(self.hidden, name="encoder_0")(x)
    for i in range(1, self.num_layers):
      y = Lstm(self.hidden, name=f"encoder_{i}")(drop(x))
      x = y + x if i >= 2 else y
    memory = x
    shifted = jnp.pad(targets, ((0, 0), (1, 0)))[:, :-1]
    y = drop(embed(shifted))
    y = Lstm(self.hidden, name="decoder_0")(y)
    context = BahdanauAttention(self.hidden, name="attention")(
      y, memory, inputs > 0
    )
    for i in range(1, self.num_layers):
      z = Lstm(self.hidden, name=f"decoder_{i}")(
        drop(jnp.concatenate([y, context], axis=-1))
      )
      y = z + y if i >= 2 else z
    return nn.Dense(self.vocab_size, name="classifier")(drop(y)).astype(
      jnp.float32
    )
