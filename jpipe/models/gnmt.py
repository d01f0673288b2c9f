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

from jpipe.models import decoding

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
  def __call__(self, x, carry=None):
    """With ``carry`` (the cell's (c, h), each [B, hidden]): from that
    state, and ``(outputs, the last carry)`` returned."""
    rnn = nn.RNN(
      nn.OptimizedLSTMCell(self.hidden, name="cell"),
      return_carry=carry is not None,
    )
    if carry is None:
      return rnn(x)
    carry, y = rnn(x, initial_carry=tuple(carry))
    return y, carry


class BidirectionalLstm(nn.Module):
  """Forward and backward LSTMs, outputs concatenated: [B, L, 2 hidden].
  The backward one starts at each row's last token (``lengths`` int [B]),
  as MLPerf's packed sequences do: a source's outputs do not depend on
  its trailing padding (the forward one's never do)."""

  hidden: int

  @nn.compact
  def __call__(self, x, lengths):
    forward = nn.RNN(nn.OptimizedLSTMCell(self.hidden, name="forward"))(x)
    backward = nn.RNN(
      nn.OptimizedLSTMCell(self.hidden, name="backward"),
      reverse=True,
      keep_order=True,
    )(x, seq_lengths=lengths)
    return jnp.concatenate([forward, backward], axis=-1)


class BahdanauAttention(nn.Module):
  """Normalised additive attention (MLPerf GNMT's): score(q, k) =
  g * v / |v| . tanh(W_q q + W_k k + b); keys where ``mask`` is False
  get no weight. query [B, T, H], keys [B, S, H] -> context [B, T, H]."""

  hidden: int

  @nn.compact
  def __call__(self, query, keys, mask, cache=None):
    """With ``cache`` (``{"memory", "keys"}``: the keys and their
    projection, [B, S, hidden]): written from ``keys`` when given, else
    read; ``(context, the cache)`` returned."""
    q = nn.Dense(self.hidden, use_bias=False, name="query")(query)
    if cache is None or keys is not None:
      k = nn.Dense(self.hidden, use_bias=False, name="key")(keys)
    else:
      keys, k = cache["memory"], cache["keys"]
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
    context = jnp.einsum("bts,bsh->bth", weights, keys)
    return context if cache is None else (context, {"memory": keys, "keys": k})


def _lengths(inputs):
  """int32 [B]: each source's tokens up to its last non-padding one."""
  at = jnp.arange(1, inputs.shape[1] + 1, dtype=jnp.int32)
  return jnp.max(jnp.where(inputs > 0, at, 0), axis=1)


class Model(nn.Module):
  """GNMT (see the module docstring); sizes by name in ``SIZES``."""

  vocab_size: int = 32320
  hidden: int = 1024
  num_layers: int = 4  # LSTM layers of the encoder, and of the decoder.
  dropout: float = 0.2

  @nn.compact
  def __call__(
    self, inputs, targets, train: bool = True, cache=None, encode=True
  ):
    """With ``cache`` (``empty_cache``'s layout): incremental decoding --
    ``targets`` are the decoder's next input tokens (not shifted; the
    first is the start token 0), the encoder runs only when ``encode``
    (its outputs go into the attention's cache), and ``(logits, the new
    cache: each decoder LSTM's last state)`` is returned."""
    if self.num_layers < 2:
      raise ValueError(f"GNMT needs num_layers >= 2, got {self.num_layers}")
    drop = nn.Dropout(self.dropout, deterministic=not train)
    # One embedding for both sides (MLPerf's share_embedding).
    embed = nn.Embed(self.vocab_size, self.hidden, name="embedding")
    memory = None
    if cache is None or encode:
      x = drop(embed(inputs))
      x = BidirectionalLstm(self.hidden, name="encoder_0")(x, _lengths(inputs))
      for i in range(1, self.num_layers):
        y = Lstm(self.hidden, name=f"encoder_{i}")(drop(x))
        x = y + x if i >= 2 else y
      memory = x
    if cache is None:
      y = drop(embed(jnp.pad(targets, ((0, 0), (1, 0)))[:, :-1]))
    else:
      y = drop(embed(targets))
    new = {}

    def run(module, name, *args):
      if cache is None:
        return module(*args)
      out, new[name] = module(*args, cache[name])
      return out

    y = run(Lstm(self.hidden, name="decoder_0"), "decoder_0", y)
    attention = BahdanauAttention(self.hidden, name="attention")
    context = run(attention, "attention", y, memory, inputs > 0)
    for i in range(1, self.num_layers):
      name = f"decoder_{i}"
      z = run(
        Lstm(self.hidden, name=name),
        name,
        drop(jnp.concatenate([y, context], axis=-1)),
      )
      y = z + y if i >= 2 else z
    logits = nn.Dense(self.vocab_size, name="classifier")(drop(y))
    logits = logits.astype(jnp.float32)
    return logits if cache is None else (logits, new)


def empty_cache(
  model: Model, batch_size: int, length: int, source_length: int
) -> dict:
  """The decoding state of ``batch_size`` sequences over sources of
  ``source_length`` tokens: each decoder LSTM's (c, h) [batch, hidden]
  and the attention's ``{"memory", "keys"}`` [batch, source_length,
  hidden], zeros (float32). ``length`` is not needed (an LSTM's state
  does not grow); taken for ``Pipeline.generate``'s signature."""
  del length
  state = jnp.zeros((batch_size, model.hidden), jnp.float32)
  keys = jnp.zeros((batch_size, source_length, model.hidden), jnp.float32)
  cache = {f"decoder_{i}": (state, state) for i in range(model.num_layers)}
  cache["attention"] = {"memory": keys, "keys": keys}
  return cache


def decode_fns(model: Model):
  """The model's ``(prefill_fn, decode_fn)`` for ``Pipeline.generate``
  (``decoding.encoder_decoder_fns``: "inputs" the sources, "tokens" the
  decoder's input, "index" unused -- the LSTMs carry the position --,
  "cache" ``empty_cache``'s layout; the prefill runs the encoder too)."""
  return decoding.encoder_decoder_fns(model, with_index=False)
