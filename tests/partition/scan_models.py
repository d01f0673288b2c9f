"""Attention LMs whose layers run under a scan, as production JAX code
writes them (linen ``nn.scan``, with and without ``nn.remat`` inside,
stacking on axis 0 or, as MaxText and flaxformer do, on axis 1;
``jax.lax.scan`` over stacked params), and the plain one unrolled; a
scanned net whose per-layer model state is stacked too."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax

D, V, T, LAYERS = 8, 16, 4, 8


class Block(nn.Module):
  """Pre-norm attention and MLP; ``(x, None) -> (x, None)`` for nn.scan.
  ``use_bias``: the attention's (its key bias's gradient is 0 up to float
  noise, which a normalising optimizer magnifies)."""

  use_bias: bool = True

  @nn.compact
  def __call__(self, x, _):
    h = nn.LayerNorm()(x)
    mask = nn.make_causal_mask(jnp.ones(x.shape[:2]))
    x = x + nn.MultiHeadDotProductAttention(
      num_heads=2, qkv_features=D, use_bias=self.use_bias
    )(h, mask=mask)
    x = x + nn.Dense(D)(nn.gelu(nn.Dense(2 * D)(nn.LayerNorm()(x))))
    return x, None


class CarryBlock(nn.Module):
  """``Block`` as ``x -> x``, the signature ``nn.remat_scan`` runs."""

  use_bias: bool = True

  @nn.compact
  def __call__(self, x):
    return Block(self.use_bias)(x, None)[0]


class ScannedLM(nn.Module):
  """Embedding, ``LAYERS`` blocks under ``nn.scan`` (stacked params),
  head. ``shared``: the blocks share one set of params (not stacked).
  ``scan_axis``: the params' axis the layers are stacked on (MaxText's
  ``param_scan_axis``, 1 by default there). ``remat_scan``: the blocks
  under ``nn.remat_scan`` with these lengths (their product ``LAYERS``):
  a scan in a scan, params stacked ``[a, b, ...]``."""

  remat: bool = False
  shared: bool = False
  scan_axis: int = 0
  attention_bias: bool = True
  remat_scan: tuple[int, ...] = ()  # nn.remat_scan's lengths.

  @nn.compact
  def __call__(self, tokens):
    x = nn.Embed(V, D)(tokens)
    if self.remat_scan:  # (A scan in a scan: params [a, b, ...].)
      stack = nn.remat_scan(CarryBlock, lengths=self.remat_scan)
      x = stack(self.attention_bias, name="blocks")(x)
      return nn.Dense(V)(nn.LayerNorm()(x))
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
        variable_axes={"params": self.scan_axis},
        split_rngs={"params": True},
        length=LAYERS,
      )
    x, _ = scan(self.attention_bias, name="blocks")(x, None)
    return nn.Dense(V)(nn.LayerNorm()(x))


def _tokens(batch_size, seed=0):
  tokens = np.random.RandomState(seed).randint(0, V, (batch_size, T))
  return {"x": jnp.asarray(tokens), "y": jnp.asarray((tokens + 1) % V)}


def _xent(logits, y):
  logp = jax.nn.log_softmax(logits)
  return -jnp.mean(jnp.take_along_axis(logp, y[..., None], -1))


def linen_case(batch_size=4, **options):
  """(loss_fn, params, batch) of ``ScannedLM(**options)``."""
  model = ScannedLM(**options)
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


EXPERTS, HEADS = 4, 2
# The checkpoint policy the body keeps in every stage's scan.
POLICY = jax.checkpoint_policies.dots_with_no_batch_dims_saveable


def body_params(moe=False, layers=LAYERS):
  """Stacked layer params of ``body_case``: attention (q, k, v, o), then
  an MLP or ``EXPERTS`` stacked experts and their router."""
  k = iter(jax.random.split(jax.random.key(2), 12))

  def w(*shape):
    return jax.random.normal(next(k), (layers, *shape)) * 0.3

  stack = {"g": 1.0 + 0.1 * w(D), **{n: w(D, D) for n in ("q", "k", "v", "o")}}
  if moe:
    stack.update(router=w(D, EXPERTS), up=w(EXPERTS, D, 2 * D))
    stack.update(down=w(EXPERTS, 2 * D, D))
  else:
    stack.update(w1=w(D, 2 * D), w2=w(2 * D, D))
  return {
    "emb": jax.random.normal(next(k), (V, D)) * 0.3,
    "layers": stack,
    "head": jax.random.normal(next(k), (D, V)) * 0.3,
  }


def _experts(x, p, moe):
  """x [B, T, D] through the layer's experts, mixed by the router: "soft"
  (softmax weights) or "top1" (the best expert, at its weight)."""
  gates = jax.nn.softmax(x @ p["router"], -1)  # [B, T, E]
  if moe == "top1":
    gates = gates * jax.nn.one_hot(jnp.argmax(gates, -1), EXPERTS)
  hidden = jax.nn.gelu(jnp.einsum("btd,edf->btef", x, p["up"]))
  out = jnp.einsum("btef,efd->bted", hidden, p["down"])
  return jnp.einsum("bte,bted->btd", gates, out)


def body_layer(moe=None, fused=False):
  """The scan body: causal attention (``jax.nn.dot_product_attention``
  when ``fused``, else the explicit softmax), then the MLP or experts."""

  def layer(x, p):
    h = x * p["g"][None, None]
    b, t, _ = h.shape
    q, k, v = (
      (h @ p[n]).reshape(b, t, HEADS, D // HEADS) for n in ("q", "k", "v")
    )
    if fused:
      att = jax.nn.dot_product_attention(q, k, v, is_causal=True)
    else:
      s = jnp.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(D // HEADS)
      s = jnp.where(jnp.tril(jnp.ones((t, t), bool)), s, -1e9)
      att = jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(s, -1), v)
    x = x + att.reshape(b, t, D) @ p["o"]
    if moe:
      return x + _experts(x, p, moe), None
    return x + jax.nn.gelu(x @ p["w1"]) @ p["w2"], None

  return layer


def body_case(moe=None, fused=False, policy=None, batch_size=4, layers=LAYERS):
  """A plain-JAX LM whose ``jax.lax.scan`` body holds attention (fused or
  not) and an MLP or a mixture of experts (``moe``: "soft" / "top1"),
  under ``jax.checkpoint(policy=policy)`` when a policy is given."""
  layer = body_layer(moe, fused)
  if policy is not None:
    layer = jax.checkpoint(layer, policy=policy)

  def loss_fn(params, batch):
    x = params["emb"][batch["x"]]
    x, _ = jax.lax.scan(layer, x, params["layers"])
    return _xent(x @ params["head"], batch["y"])

  return loss_fn, body_params(bool(moe), layers), _tokens(batch_size)


class ScannedBatchNormNet(nn.Module):
  """Linen: four residual blocks with BatchNorm (and ``noise_key``: noise
  from a key of their own), scanned with their statistics and keys stacked
  (``variable_axes={"params": 0, "batch_stats": 0}``; ``axes``: the
  params' and the statistics' stacking axes). [B, 6] -> logits [B, 3]."""

  noise_key: bool = True
  axes: tuple[int, int] = (0, 0)

  @nn.compact
  def __call__(self, x):
    noise_key = self.noise_key

    class ScanBlock(nn.Module):
      @nn.compact
      def __call__(self, x, _):
        # (No bias before BatchNorm: its gradient is rounding noise, which
        # Adam would scale up to a full step.)
        h = nn.Dense(8, use_bias=False)(x)
        h = nn.BatchNorm(use_running_average=False)(h)
        if noise_key:  # (A typed key, split at every call.)
          key = self.variable("batch_stats", "key", jax.random.key, 0)
          h = h + 0.01 * jax.random.normal(key.value, h.shape)
          key.value = jax.random.split(key.value)[0]
        return x + jnp.tanh(h), None

    x = nn.Dense(8)(x)
    x, _ = nn.scan(
      ScanBlock,
      variable_axes={"params": self.axes[0], "batch_stats": self.axes[1]},
      split_rngs={"params": True},
      length=4,
    )(name="layers")(x, None)
    return nn.Dense(3)(x)


def batch_stats_case(batch, noise_key=True, axes=(0, 0)):
  """(loss_fn(params, model_state, batch) -> (loss, new_model_state),
  params, model_state) of ``ScannedBatchNormNet`` on ``batch`` ({"x":
  [B, 6], "y": [B] classes of 3})."""
  model = ScannedBatchNormNet(noise_key=noise_key, axes=axes)
  variables = model.init(jax.random.key(1), batch["x"])

  def loss_fn(params, model_state, batch):
    logits, new = model.apply(
      {"params": params, **model_state}, batch["x"], mutable=["batch_stats"]
    )
    loss = optax.softmax_cross_entropy_with_integer_labels(
      logits, batch["y"]
    ).mean()
    return loss, new

  return loss_fn, variables["params"], {"batch_stats": variables["batch_stats"]}
