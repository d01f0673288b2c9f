"""Small Flax linen models that exercise the partitioner's hard cases."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax


class Mlp(nn.Module):
  """Dense layers: the easy, sequential case."""

  widths: tuple[int, ...] = (16, 16, 16, 16, 16, 16, 16, 10)

  @nn.compact
  def __call__(self, x):
    for i, w in enumerate(self.widths[:-1]):
      x = nn.relu(nn.Dense(w, name=f"dense_{i}")(x))
    return nn.Dense(self.widths[-1], name="head")(x)


class ResidualBlock(nn.Module):
  features: int
  bn_axis_name: str | None = None

  @nn.compact
  def __call__(self, x, train: bool):
    y = nn.Conv(self.features, (3, 3), use_bias=False)(x)
    y = nn.BatchNorm(
      use_running_average=not train, axis_name=self.bn_axis_name
    )(y)
    return nn.relu(x + y)


class ResNet(nn.Module):
  """Convolutions with BatchNorm (mutable statistics) and residuals."""

  num_blocks: int = 6
  bn_axis_name: str | None = None  # Cross-replica BatchNorm (pmap style).

  @nn.compact
  def __call__(self, x, train: bool = True):
    x = nn.Conv(8, (3, 3), name="stem")(x)
    for i in range(self.num_blocks):
      x = ResidualBlock(8, self.bn_axis_name, name=f"block_{i}")(x, train)
    x = jnp.mean(x, axis=(1, 2))
    return nn.Dense(10, name="head")(x)


class DecoderLayer(nn.Module):
  width: int

  @nn.compact
  def __call__(self, x, memory):
    x = x + nn.Dense(self.width)(nn.LayerNorm()(x))
    context = jnp.mean(memory, axis=1, keepdims=True)  # Cross "attention".
    return x + nn.Dense(self.width)(x * context)


class Gpt(nn.Module):
  """Token embedding reused as the output head (tied weights)."""

  vocab: int = 32
  width: int = 16
  num_layers: int = 6

  @nn.compact
  def __call__(self, tokens):
    embed = nn.Embed(self.vocab, self.width, name="embed")
    x = embed(tokens)
    for i in range(self.num_layers):
      h = nn.LayerNorm(name=f"ln_{i}")(x)
      x = x + nn.Dense(self.width, name=f"mlp_{i}")(jax.nn.gelu(h))
    return embed.attend(nn.LayerNorm(name="ln_f")(x))


class EncoderDecoder(nn.Module):
  """The encoder's output is read by every decoder layer (long skips)."""

  width: int = 16
  num_layers: int = 4

  @nn.compact
  def __call__(self, src, tgt):
    memory = nn.Dense(self.width, name="enc_in")(src)
    for i in range(self.num_layers):
      memory = memory + nn.Dense(self.width, name=f"enc_{i}")(jnp.tanh(memory))
    x = nn.Dense(self.width, name="dec_in")(tgt)
    for i in range(self.num_layers):
      x = DecoderLayer(self.width, name=f"dec_{i}")(x, memory)
    return nn.Dense(5, name="head")(x)


def _classification_case(model, features, examples=8):
  """``model`` on ``examples`` random examples of ``features`` and 10
  classes, with a softmax cross-entropy loss: (loss_fn, params, batch,
  False)."""
  x = jax.random.normal(jax.random.key(0), (examples, features))
  y = jax.random.randint(jax.random.key(1), (examples,), 0, 10)
  params = model.init(jax.random.key(2), x)

  def loss_fn(params, batch):
    logits = model.apply(params, batch["x"])
    return optax.softmax_cross_entropy_with_integer_labels(
      logits, batch["y"]
    ).mean()

  return loss_fn, params, {"x": x, "y": y}, False


def mlp_case():
  return _classification_case(Mlp(), 12)


def resnet_state_case(num_blocks=6, batch_size=4):
  """ResNet with BatchNorm as ``loss(params, stats, batch) -> (loss,
  new_stats)``; returns (loss_fn, params, stats, batch)."""
  model = ResNet(num_blocks=num_blocks)
  x = jax.random.normal(jax.random.key(0), (batch_size, 6, 6, 3))
  y = jax.random.randint(jax.random.key(1), (batch_size,), 0, 10)
  variables = model.init(jax.random.key(2), x)

  def loss_fn(params, stats, batch):
    logits, updates = model.apply(
      {"params": params, "batch_stats": stats},
      batch["x"],
      mutable=["batch_stats"],
    )
    loss = optax.softmax_cross_entropy_with_integer_labels(
      logits, batch["y"]
    ).mean()
    return loss, updates["batch_stats"]

  return (
    loss_fn,
    variables["params"],
    variables["batch_stats"],
    {"x": x, "y": y},
  )


def vmapped_batchnorm_case(num_blocks=4, batch_size=8, replicas=2):
  """A BatchNorm model written for ``pmap`` (``axis_name`` in its
  BatchNorm) run under ``jax.vmap(axis_name=...)``: its new statistics
  come back batched (one equal copy per replica) and the loss takes
  ``[0]`` of them after the model -- on the last stage. Returns
  (loss_fn, params, stats, batch) as ``resnet_state_case``."""
  model = ResNet(num_blocks=num_blocks, bn_axis_name="replica")
  x = jax.random.normal(jax.random.key(0), (batch_size, 6, 6, 3))
  y = jax.random.randint(jax.random.key(1), (batch_size,), 0, 10)
  variables = jax.vmap(model.init, (None, 0), axis_name="replica")(
    jax.random.key(2), x.reshape(replicas, -1, *x.shape[1:])
  )
  params, stats = jax.tree.map(
    lambda v: v[0], (variables["params"], variables["batch_stats"])
  )

  def loss_fn(params, stats, batch):
    def replica_loss(x, y):
      logits, updates = model.apply(
        {"params": params, "batch_stats": stats}, x, mutable=["batch_stats"]
      )
      loss = optax.softmax_cross_entropy_with_integer_labels(logits, y)
      return loss.mean(), updates["batch_stats"]

    xs = batch["x"].reshape(replicas, -1, *batch["x"].shape[1:])
    ys = batch["y"].reshape(replicas, -1)
    losses, new_stats = jax.vmap(replica_loss, axis_name="replica")(xs, ys)
    return losses.mean(), jax.tree.map(lambda s: s[0], new_stats)

  return loss_fn, params, stats, {"x": x, "y": y}


def resnet_case():
  """The statistics travel inside the batch, the loss returns them as aux."""
  state_loss, params, stats, batch = resnet_state_case()

  def loss_fn(params, batch):
    return state_loss(params, batch["stats"], batch)

  return loss_fn, params, {**batch, "stats": stats}, True


def gpt_case():
  model = Gpt()
  tokens = jax.random.randint(jax.random.key(0), (4, 9), 0, 32)
  params = model.init(jax.random.key(2), tokens[:, :-1])

  def loss_fn(params, batch):
    logits = model.apply(params, batch["tokens"][:, :-1])
    return optax.softmax_cross_entropy_with_integer_labels(
      logits, batch["tokens"][:, 1:]
    ).mean()

  return loss_fn, params, {"tokens": tokens}, False


def encoder_decoder_case():
  model = EncoderDecoder()
  src = jax.random.normal(jax.random.key(0), (4, 7, 6))
  tgt = jax.random.normal(jax.random.key(1), (4, 5, 6))
  y = jax.random.randint(jax.random.key(3), (4, 5), 0, 5)
  params = model.init(jax.random.key(2), src, tgt)

  def loss_fn(params, batch):
    logits = model.apply(params, batch["src"], batch["tgt"])
    return optax.softmax_cross_entropy_with_integer_labels(
      logits, batch["y"]
    ).mean()

  return loss_fn, params, {"src": src, "tgt": tgt, "y": y}, False


def nnx_case(remat: bool = False):
  """An NNX model used the functional way: nnx.split, then nnx.merge.
  ``remat``: each block called through ``nnx.remat`` (which rebuilds a
  copy of the block inside)."""
  from flax import nnx

  class Block(nnx.Module):
    def __init__(self, width, rngs):
      self.linear = nnx.Linear(width, width, rngs=rngs)
      self.norm = nnx.LayerNorm(width, rngs=rngs)

    def __call__(self, x):
      return x + nnx.relu(self.linear(self.norm(x)))

  class Net(nnx.Module):
    def __init__(self, rngs):
      self.stem = nnx.Linear(12, 16, rngs=rngs)
      self.blocks = nnx.List([Block(16, rngs) for _ in range(4)])
      self.head = nnx.Linear(16, 10, rngs=rngs)

    def __call__(self, x):
      x = self.stem(x)
      for block in self.blocks:
        x = nnx.remat(lambda b, y: b(y))(block, x) if remat else block(x)
      return self.head(x)

  graphdef, params = nnx.split(Net(nnx.Rngs(0)))
  x = jax.random.normal(jax.random.key(0), (8, 12))
  y = jax.random.randint(jax.random.key(1), (8,), 0, 10)

  def loss_fn(params, batch):
    model = nnx.merge(graphdef, params)
    logits = model(batch["x"])
    return optax.softmax_cross_entropy_with_integer_labels(
      logits, batch["y"]
    ).mean()

  return loss_fn, params, {"x": x, "y": y}, False


class Cell(nn.Module):
  @nn.compact
  def __call__(self, carry, _):
    carry = jnp.tanh(nn.Dense(carry.shape[-1])(carry))
    return carry, carry


class DropoutScanNet(nn.Module):
  """Dropout (RNG from the batch) and a scanned block (one node)."""

  @nn.compact
  def __call__(self, x, train: bool = True):
    x = nn.Dense(16, name="inp")(x)
    x = nn.Dropout(0.3, deterministic=not train, name="drop")(x)
    scanned = nn.scan(
      Cell, variable_axes={"params": 0}, split_rngs={"params": True}, length=3
    )
    x, ys = scanned(name="scan")(x, None)  # ys: [3, B, 16]
    x = nn.relu(x + ys.sum(0))
    x = nn.Dropout(0.3, deterministic=not train, name="drop2")(x)
    return nn.Dense(10, name="head")(x)


def dropout_scan_case():
  model = DropoutScanNet()
  x = jax.random.normal(jax.random.key(0), (8, 12))
  y = jax.random.randint(jax.random.key(1), (8,), 0, 10)
  params = model.init(jax.random.key(2), x, train=False)

  def loss_fn(params, batch):
    logits = model.apply(params, batch["x"], rngs={"dropout": batch["rng"]})
    return optax.softmax_cross_entropy_with_integer_labels(
      logits, batch["y"]
    ).mean()

  return loss_fn, params, {"x": x, "y": y, "rng": jax.random.key(5)}, False


class DropoutMlp(nn.Module):
  """Dense layers, each followed by dropout (four nodes, each drawing)."""

  @nn.compact
  def __call__(self, x):
    for i in range(4):
      x = nn.relu(nn.Dense(16, name=f"dense_{i}")(x))
      x = nn.Dropout(0.3, deterministic=False, name=f"drop_{i}")(x)
    return nn.Dense(10, name="head")(x)


def dropout_key_case():
  """Dropout keyed as the CLI keys it: raw key data per example in the
  batch, wrapped into a typed key at the root -- a typed key that the
  first stage makes and later stages read."""
  model = DropoutMlp()
  x = jax.random.normal(jax.random.key(0), (8, 12))
  y = jax.random.randint(jax.random.key(1), (8,), 0, 10)
  keys = jax.random.key_data(jax.random.split(jax.random.key(5), 8))
  params = model.init(jax.random.key(2), x)

  def loss_fn(params, batch):
    key = jax.random.wrap_key_data(batch["dropout_key"][0])
    logits = model.apply(params, batch["x"], rngs={"dropout": key})
    return optax.softmax_cross_entropy_with_integer_labels(
      logits, batch["y"]
    ).mean()

  return loss_fn, params, {"x": x, "y": y, "dropout_key": keys}, False


def nnx_dropout_case():
  """An NNX MLP whose Dropouts keep their own RNG streams, through
  ``jpipe.nnx_loss``: typed keys (and counts) as each stage's model
  state. Returns (loss_fn, params, model_state, batch)."""
  from flax import nnx

  import jpipe

  class Net(nnx.Module):
    def __init__(self, rngs):
      self.layers = nnx.List(
        [nnx.Linear(12 if i == 0 else 16, 16, rngs=rngs) for i in range(4)]
      )
      self.drops = nnx.List([nnx.Dropout(0.3, rngs=rngs) for _ in range(4)])
      self.head = nnx.Linear(16, 10, rngs=rngs)

    def __call__(self, x):
      for layer, drop in zip(self.layers, self.drops, strict=True):
        x = drop(nnx.relu(layer(x)))
      return self.head(x)

  def loss(model, batch):
    return optax.softmax_cross_entropy_with_integer_labels(
      model(batch["x"]), batch["y"]
    ).mean()

  x = jax.random.normal(jax.random.key(0), (8, 12))
  y = jax.random.randint(jax.random.key(1), (8,), 0, 10)
  nl = jpipe.nnx_loss(Net(nnx.Rngs(0, dropout=3)), loss)
  return nl.loss_fn, nl.params, nl.model_state, {"x": x, "y": y}


def nnx_lora_lm(examples=8):
  """Tied embeddings around blocks of ``nnx.LoRALinear`` (LoRA
  fine-tuning's shape: the embedding read on the first and last stage):
  (model, ``loss(model, batch)``, batch of ``examples`` sequences)."""
  from flax import nnx

  class LoraLm(nnx.Module):
    def __init__(self, rngs):
      self.embed = nnx.Embed(24, 16, rngs=rngs)
      self.blocks = nnx.List(
        [nnx.LoRALinear(16, 16, lora_rank=2, rngs=rngs) for _ in range(4)]
      )
      for k, block in enumerate(self.blocks):  # (B starts at zero.)
        b = block.lora.lora_b
        b[...] = 0.1 * jax.random.normal(jax.random.key(k), b.shape)

    def __call__(self, tokens):
      x = self.embed(tokens)
      for block in self.blocks:
        x = x + jnp.tanh(block(x))
      return self.embed.attend(x)

  def loss(model, batch):
    logits = model(batch["t"])
    return optax.softmax_cross_entropy_with_integer_labels(
      logits[:, :-1], batch["t"][:, 1:]
    ).mean()

  tokens = jax.random.randint(jax.random.key(5), (examples, 6), 0, 24)
  return LoraLm(nnx.Rngs(0)), loss, {"t": tokens}


def nnx_lora_case():
  """``nnx_lora_lm`` through ``jpipe.nnx_loss(..., wrt=nnx.LoRAParam)``:
  the LoRA factors as params, the frozen base weights as model state the
  loss returns unchanged. Returns (loss_fn, params, model_state, batch)."""
  from flax import nnx

  import jpipe

  model, loss, batch = nnx_lora_lm()
  nl = jpipe.nnx_loss(model, loss, wrt=nnx.LoRAParam)
  return nl.loss_fn, nl.params, nl.model_state, batch


CASES = {
  "mlp": mlp_case,
  "resnet_bn": resnet_case,
  "gpt_tied": gpt_case,
  "encoder_decoder": encoder_decoder_case,
  "nnx": nnx_case,
  "dropout_scan": dropout_scan_case,
}


class Residual(nn.Module):
  """x + Dense(tanh(Dense(x))): a block of two nodes at depth 2."""

  width: int = 16

  @nn.compact
  def __call__(self, x):
    return x + nn.Dense(self.width, name="out")(
      jnp.tanh(nn.Dense(self.width, name="inp")(x))
    )


class Stack(nn.Module):
  """Blocks inside one submodule: one node at depth 1."""

  num_blocks: int = 4

  @nn.compact
  def __call__(self, x):
    for i in range(self.num_blocks):
      x = Residual(name=f"block_{i}")(x)
    return x


class MethodsEncoderDecoder(nn.Module):
  """Like the Flax examples' seq2seq model: ``__call__`` calls ``encode``
  and ``decode``, each a stack inside one submodule, sharing an
  embedding (3 nodes at depth 1)."""

  def setup(self):
    self.embed = nn.Embed(32, 16)
    self.encoder = Stack()
    self.decoder = Stack()

  def encode(self, tokens):
    return self.encoder(self.embed(tokens))

  def decode(self, memory, tokens):
    return self.decoder(self.embed(tokens) + memory.mean(1, keepdims=True))

  def __call__(self, source, target):
    return self.embed.attend(self.decode(self.encode(source), target))


def methods_encoder_decoder_case():
  model = MethodsEncoderDecoder()
  source = jax.random.randint(jax.random.key(0), (8, 6), 0, 32)
  target = jax.random.randint(jax.random.key(1), (8, 5), 0, 32)
  params = model.init(jax.random.key(2), source, target[:, :-1])["params"]

  def loss_fn(params, batch):
    logits = model.apply(
      {"params": params}, batch["source"], batch["target"][:, :-1]
    )
    return optax.softmax_cross_entropy_with_integer_labels(
      logits, batch["target"][:, 1:]
    ).mean()

  return loss_fn, params, {"source": source, "target": target}, False


class StackedClassifier(nn.Module):
  """A decoder stack inside one submodule between a stem and a head."""

  @nn.compact
  def __call__(self, x):
    x = nn.Dense(16, name="stem")(x)
    x = Stack(num_blocks=8, name="decoder")(x)
    return nn.Dense(10, name="head")(x)


def stack_in_submodule_case():
  model = StackedClassifier()
  x = jax.random.normal(jax.random.key(0), (8, 12))
  y = jax.random.randint(jax.random.key(1), (8,), 0, 10)
  params = model.init(jax.random.key(2), x)["params"]

  def loss_fn(params, batch):
    logits = model.apply({"params": params}, batch["x"])
    return optax.softmax_cross_entropy_with_integer_labels(
      logits, batch["y"]
    ).mean()

  return loss_fn, params, {"x": x, "y": y}, False


class TwoTowers(nn.Module):
  """A wide and a narrow tower of Dense layers whose layers interleave in
  program order (a0, b0, a1, b1, ...), joined by the head: a branchy DAG
  whose balanced stages are not runs of that order."""

  widths: tuple[int, int] = (64, 8)
  depth: int = 3

  @nn.compact
  def __call__(self, x):
    a = b = x
    for i in range(self.depth):
      a = jnp.tanh(nn.Dense(self.widths[0], name=f"a{i}")(a))
      b = jnp.tanh(nn.Dense(self.widths[1], name=f"b{i}")(b))
    return nn.Dense(10, name="head")(jnp.concatenate([a, b], -1))


def two_towers_case():
  return _classification_case(TwoTowers(), 32)
