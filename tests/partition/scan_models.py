"""Attention LMs whose layers run under a scan, as production JAX code
writes them (linen ``nn.scan``, with and without ``nn.remat`` inside;
``jax.lax.scan`` over stacked params), and the plain one unrolled."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

D, V, T, LAYERS = 8, 16, 4, 8


class Block(nn.Module):
  """Pre-norm attention and MLP; ``(x, None) -> (x, None)`` for nn.scan."""

  @nn.compact
  def __call__(self, x, _):
    h = nn.LayerNorm()(x)
    mask = nn.make_causal_mask(jnp.ones(x.shape[:2]))
    x = x + nn.MultiHeadDotProductAttention(num_heads=2, qkv_features=D)(
      h, mask=mask
    )
    x = x + nn.Dense(D)(nn.gelu(nn.Dense(2 * D)(nn.LayerNorm()(x))))
    return x, None


class ScannedLM(nn.Module):
  """Embedding, ``LAYERS`` blocks under ``nn.scan`` (stacked params),
  head. ``shared``: the blocks share one set of params (not stacked)."""

  remat: bool = False
  shared: bool = False

  @nn.compact
  def __call__(self, tokens):
    x = nn.Embed(V, D)(tokens)
    block = nn.remat(Block) if self.remat else Block
    if self.shared:
      scan = nn.scan(
        block,
        variable_broadcast="params",
        split_rngs={"params": False},
        length=LAYERS,
      )
    else:
      scan = nn.scan(
        block,
        variable_axes={"params": 0},
        split_rngs={"params": True},
        length=LAYERS,
      )
    x, _ = scan(name="blocks")(x, None)
    return nn.Dense(V)(nn.LayerNorm()(x))


def _tokens(batch_size, seed=0):
  tokens = np.random.RandomState(seed).randint(0, V, (batch_size, T))
  return {"x": jnp.asarray(tokens), "y": jnp.asarray((tokens + 1) % V)}


def _xent(logits, y):
  logp = jax.nn.log_softmax(logits)
  return -jnp.mean(jnp.take_along_axis(logp, y[..., None], -1))


def linen_case(remat=False, shared=False, batch_size=4):
  """(loss_fn, params, batch) of ``ScannedLM``."""
  model = ScannedLM(remat=remat, shared=shared)
  batch = _tokens(batch_size)
  params = model.init(jax.random.key(0), batch["x"])

  def loss_fn(params, batch):
    return _xent(model.apply(params, batch["x"]), batch["y"])

  return loss_fn, params, batch


def plain_params():
  k = jax.random.split(jax.random.key(1), 5)
  return {
    "emb": jax.random.normal(k[0], (V, D)) * 0.3,
    "layers": {
      "g": 1.0 + 0.1 * jax.random.normal(k[1], (LAYERS, D)),
      "wq": jax.random.normal(k[2], (LAYERS, D, D)) * 0.3,
      "w1": jax.random.normal(k[3], (LAYERS, D, 2 * D)) * 0.3,
      "w2": jax.random.normal(k[4], (LAYERS, 2 * D, D)) * 0.3,
    },
    "head": jax.random.normal(k[0], (D, V)) * 0.3,
  }


def _layer(x, p):
  h = x * p["g"][None, None]
  att = jax.nn.softmax(jnp.einsum("btd,bsd->bts", h @ p["wq"], h), -1)
  x = x + att @ h
  return x + jax.nn.gelu(x @ p["w1"]) @ p["w2"], None


def plain_case(batch_size=4):
  """A plain-JAX loss: ``jax.lax.scan`` over stacked layer params."""

  def loss_fn(params, batch):
    x = params["emb"][batch["x"]]
    x, _ = jax.lax.scan(_layer, x, params["layers"])
    return _xent(x @ params["head"], batch["y"])

  return loss_fn, plain_params(), _tokens(batch_size)


def unrolled_case(batch_size=4):
  """``plain_case``'s model unrolled: layer k's params are their own
  leaves, its ops under ``jax.named_scope("scan[k]")`` (the scanned
  trace's node names)."""
  stacked = plain_params()
  params = {
    "emb": stacked["emb"],
    "head": stacked["head"],
    "layers": [
      jax.tree.map(lambda x, k=k: x[k], stacked["layers"])
      for k in range(LAYERS)
    ],
  }

  def loss_fn(params, batch):
    x = params["emb"][batch["x"]]
    for k, p in enumerate(params["layers"]):
      with jax.named_scope(f"scan[{k}]"):
        x, _ = _layer(x, p)
    return _xent(x @ params["head"], batch["y"])

  return loss_fn, params, _tokens(batch_size)


def stack_unrolled(params):
  """``unrolled_case``'s params in ``plain_case``'s layout."""
  return {
    "emb": params["emb"],
    "head": params["head"],
    "layers": jax.tree.map(lambda *xs: jnp.stack(xs), *params["layers"]),
  }


def nnx_case(batch_size=4):
  """NNX: ``LAYERS`` blocks made by ``nnx.vmap`` (stacked params), run by
  ``nnx.scan``; used the functional way (``nnx.split``, ``nnx.merge``)."""
  from flax import nnx

  class NnxBlock(nnx.Module):
    def __init__(self, rngs):
      self.norm = nnx.LayerNorm(D, rngs=rngs)
      self.up = nnx.Linear(D, 2 * D, rngs=rngs)
      self.down = nnx.Linear(2 * D, D, rngs=rngs)

    def __call__(self, x):
      return x + self.down(nnx.gelu(self.up(self.norm(x))))

  class NnxLM(nnx.Module):
    def __init__(self, rngs):
      self.embed = nnx.Embed(V, D, rngs=rngs)

      @nnx.split_rngs(splits=LAYERS)
      @nnx.vmap(in_axes=(0,), out_axes=0)
      def make(rngs):
        return NnxBlock(rngs)

      self.blocks = make(rngs)
      self.head = nnx.Linear(D, V, rngs=rngs)

    def __call__(self, tokens):
      @nnx.scan(in_axes=(nnx.Carry, 0), out_axes=nnx.Carry)
      def run(x, block):
        return block(x)

      return self.head(run(self.embed(tokens), self.blocks))

  graphdef, params = nnx.split(NnxLM(nnx.Rngs(0)))

  def loss_fn(params, batch):
    return _xent(nnx.merge(graphdef, params)(batch["x"]), batch["y"])

  return loss_fn, params, _tokens(batch_size)
