"""GNMT: a tiny model's logits against a NumPy restatement (LSTM gates,
bidirectional first layer -- the backward LSTM from each source's last
token --, residuals from the third layer, normalised
Bahdanau attention with padding masked), its size against MLPerf's, and
each LSTM one partitioner node."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jpipe import partition
from jpipe.models import gnmt


def _sigmoid(x):
  return 1.0 / (1.0 + np.exp(-x))


def _lstm(x, p, reverse=False):
  """x [B, L, D] -> h [B, L, H]; Flax's gate names (input kernels i*,
  hidden kernels h* with the bias)."""
  b, length, _ = x.shape
  hidden = p["hi"]["kernel"].shape[0]
  h, c = np.zeros((b, hidden)), np.zeros((b, hidden))
  out = np.zeros((b, length, hidden))
  steps = range(length - 1, -1, -1) if reverse else range(length)
  for t in steps:
    gate = {
      g: x[:, t] @ p[f"i{g}"]["kernel"]
      + h @ p[f"h{g}"]["kernel"]
      + p[f"h{g}"]["bias"]
      for g in "ifgo"
    }
    i, f = _sigmoid(gate["i"]), _sigmoid(gate["f"])
    g, o = np.tanh(gate["g"]), _sigmoid(gate["o"])
    c = f * c + i * g
    h = o * np.tanh(c)
    out[:, t] = h
  return out


def _backward(x, p, lengths):
  """The backward LSTM of each row from its last token (padding after
  it: zeros, masked out of the attention)."""
  out = np.zeros(x.shape[:2] + (p["hi"]["kernel"].shape[0],))
  for b, n in enumerate(lengths):
    out[b, :n] = _lstm(x[b : b + 1, :n], p, reverse=True)[0]
  return out


def _attention(query, keys, mask, p):
  v = p["g"] * p["v"] / np.linalg.norm(p["v"])
  q = query @ p["query"]["kernel"]
  k = keys @ p["key"]["kernel"]
  hidden = np.tanh(q[:, :, None] + k[:, None] + p["bias"])
  scores = hidden @ v
  scores = np.where(mask[:, None, :], scores, -np.inf)
  weights = np.exp(scores - scores.max(-1, keepdims=True))
  weights /= weights.sum(-1, keepdims=True)
  return weights @ keys


def _reference(p, inputs, targets, layers):
  emb = p["embedding"]["embedding"]
  x = emb[inputs]
  x = np.concatenate(
    [
      _lstm(x, p["encoder_0"]["forward"]),
      _backward(x, p["encoder_0"]["backward"], (inputs > 0).sum(1)),
    ],
    -1,
  )
  for i in range(1, layers):
    y = _lstm(x, p[f"encoder_{i}"]["cell"])
    x = y + x if i >= 2 else y
  shifted = np.pad(targets, ((0, 0), (1, 0)))[:, :-1]
  y = _lstm(emb[shifted], p["decoder_0"]["cell"])
  context = _attention(y, x, inputs > 0, p["attention"])
  for i in range(1, layers):
    z = _lstm(np.concatenate([y, context], -1), p[f"decoder_{i}"]["cell"])
    y = z + y if i >= 2 else z
  return y @ p["classifier"]["kernel"] + p["classifier"]["bias"]


@pytest.mark.slow
def test_logits_equal_a_numpy_restatement():
  model = gnmt.Model(vocab_size=13, hidden=8, num_layers=3, dropout=0.0)
  rng = np.random.default_rng(0)
  inputs = rng.integers(1, 13, (2, 6)).astype(np.int32)
  inputs[1, 4:] = 0  # Padding: masked out of the attention.
  targets = rng.integers(1, 13, (2, 5)).astype(np.int32)
  params = model.init(jax.random.key(0), inputs, targets, train=False)["params"]
  params = jax.tree.map(
    lambda x: x + rng.normal(0, 0.3, x.shape).astype(np.float32), params
  )
  got = model.apply({"params": params}, inputs, targets, train=False)
  want = _reference(
    jax.tree.map(lambda x: np.asarray(x, np.float64), params),
    inputs,
    targets,
    3,
  )
  np.testing.assert_allclose(np.asarray(got), want, rtol=1e-4, atol=1e-5)
  assert got.shape == (2, 5, 13)


def test_sizes_match_mlperf_gnmt():
  """GNMT-8 at MLPerf's size: 160,671,297 parameters in PyTorch (two
  biases per LSTM gate); Flax keeps one, 4 x 1024 fewer for each of the
  9 LSTMs (4 encoder layers, the first bidirectional, and 4 decoder)."""

  def count(size):
    model = gnmt.Model(**gnmt.SIZES[size])
    shapes = jax.eval_shape(
      lambda: model.init(
        jax.random.key(0),
        jnp.ones((1, 3), jnp.int32),
        jnp.ones((1, 2), jnp.int32),
        train=False,
      )
    )
    return sum(x.size for x in jax.tree.leaves(shapes))

  assert count("8") + 9 * 4 * 1024 == 160_671_297
  # GNMT-16: 8 more LSTMs of 2 x 1024 (decoder: 3 x 1024) inputs.
  lstm = lambda d_in: 4 * (d_in * 1024 + 1024 * 1024 + 1024)  # noqa: E731
  assert count("16") - count("8") == 4 * lstm(1024) + 4 * lstm(2048)


def test_each_lstm_is_one_partitioner_node():
  model = gnmt.Model(vocab_size=13, hidden=8, num_layers=3, dropout=0.0)
  inputs = jnp.ones((2, 6), jnp.int32)
  targets = jnp.ones((2, 5), jnp.int32)
  params = model.init(jax.random.key(0), inputs, targets, train=False)["params"]

  def loss_fn(params, batch):
    logits = model.apply(
      {"params": params}, batch["inputs"], batch["targets"], train=False
    )
    return jnp.mean(logits**2)

  traced = partition.trace(
    loss_fn, params, {"inputs": inputs, "targets": targets}
  )
  names = traced.node_names
  for layer in ("encoder_0", "encoder_1", "decoder_0", "decoder_2"):
    assert sum(n.split("#")[0] == layer for n in names) == 1, names
  with pytest.raises(ValueError, match="num_layers >= 2"):
    gnmt.Model(num_layers=1).init(
      jax.random.key(0), inputs, targets, train=False
    )
