"""Generation with Flax's own decoding cache, as the Flax examples' LMs
(lm1b, wmt) decode: ``nn.MultiHeadDotProductAttention(decode=True)``
keeps cached keys and values [b, L, heads, dim] and a scalar
``cache_index`` in the "cache" collection and takes one position per
call, so the decoding function feeds a prompt position by position.

Against greedy decoding that recomputes the whole sequence without a
cache; and the trace property that lets the position loop split: the
token a position slices from the batch is work of the module call after
it, not of the last layer before it (``_scopes.inputs_glue_joins_next``).
"""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jpipe
from jpipe import partition
from tests import tiers
from tests.runtime.test_generate import greedy_at_one_length

VOCAB, WIDTH, LAYERS = 16, 16, 3


class Lm(nn.Module):
  """A decoder LM in the Flax examples' decoding style."""

  decode: bool = False

  @nn.compact
  def __call__(self, tokens):
    x = nn.Embed(VOCAB, WIDTH, name="embed")(tokens)
    pos = self.param("pos", nn.initializers.normal(0.1), (32, WIDTH))
    if self.decode:  # One position per call, its index in the cache.
      ready = self.has_variable("cache", "position")
      index = self.variable("cache", "position", lambda: jnp.array(0))
      if ready:
        x = x + jax.lax.dynamic_slice_in_dim(pos, index.value, 1)[None]
        index.value = index.value + 1
      else:
        x = x + pos[None, : tokens.shape[1]]
      mask = None
    else:
      x = x + pos[None, : tokens.shape[1]]
      mask = nn.make_causal_mask(tokens)
    for i in range(LAYERS):
      attention = nn.MultiHeadDotProductAttention(
        num_heads=2, decode=self.decode, name=f"attn_{i}"
      )
      x = x + attention(nn.LayerNorm(name=f"ln_{i}")(x), mask=mask)
      x = x + nn.Dense(WIDTH, name=f"mlp_{i}")(nn.gelu(x))
    return nn.Dense(VOCAB, name="head")(nn.LayerNorm(name="ln_f")(x))


TRAIN, DECODE = Lm(), Lm(decode=True)


def _next_token_loss(model):
  def loss_fn(params, batch):
    logits = model.apply({"params": params}, batch["x"][:, :-1])
    return optax.softmax_cross_entropy_with_integer_labels(
      logits, batch["x"][:, 1:]
    ).mean()

  return loss_fn


def _empty_cache_of(decode):
  def empty_cache(b, length):
    ones = jnp.ones((b, length), jnp.int32)
    return decode.init(jax.random.key(0), ones)["cache"]

  return empty_cache


def _looping_decode_fn(decode):
  """Flax's decode mode takes one position per call: a decoding function
  that feeds the prompt in position by position (the prefill), a new
  token alone."""

  def decode_fn(params, batch):
    cache = batch["cache"]
    for t in range(batch["tokens"].shape[1]):
      logits, variables = decode.apply(
        {"params": params, "cache": cache},
        batch["tokens"][:, t : t + 1],
        mutable=["cache"],
      )
      cache = variables["cache"]
    return logits[:, -1], cache

  return decode_fn


def _one_position_decode_fn(decode):
  """The same for one position per call (``one_position=True``)."""

  def decode_fn(params, batch):
    logits, variables = decode.apply(
      {"params": params, "cache": batch["cache"]},
      batch["tokens"],
      mutable=["cache"],
    )
    return logits[:, -1], variables["cache"]

  return decode_fn


_loss_fn = _next_token_loss(TRAIN)
_empty_cache = _empty_cache_of(DECODE)
_decode_fn = _looping_decode_fn(DECODE)
_one_position_fn = _one_position_decode_fn(DECODE)


def _greedy_recomputing(params, prompts, steps, model=TRAIN):
  forward = jax.jit(lambda p, x: model.apply({"params": p}, x))
  return greedy_at_one_length(forward, params, prompts, steps)


def _params_and_batch():
  x = jax.random.randint(jax.random.key(1), (4, 9), 0, VOCAB)
  params = TRAIN.init(jax.random.key(0), x[:, :-1])["params"]
  return params, {"x": x}


@pytest.mark.parametrize("stages, one_position", [(2, 0), (3, 0), (3, 1)])
def test_flax_attention_cache_decodes_as_recomputing_greedy(
  stages, one_position
):
  """The prompt through a prefill that loops over its positions, or
  through the one-position step, position by position."""
  params, batch = _params_and_batch()
  pipe = jpipe.Pipeline(
    _loss_fn,
    params,
    batch,
    num_stages=stages,
    devices=jax.devices()[:stages],
    num_microbatches=2,
    optimizer=optax.sgd(0.1),
    depth=1,
  )
  prompts = np.asarray(jax.random.randint(jax.random.key(7), (4, 4), 0, VOCAB))
  got = pipe.generate(
    pipe.init(params),
    prompts,
    _one_position_fn if one_position else _decode_fn,
    _empty_cache,
    max_new_tokens=5,
    one_position=bool(one_position),
  )
  np.testing.assert_array_equal(
    np.asarray(got), _greedy_recomputing(params, prompts, 5)
  )


def test_a_positions_token_is_work_of_the_call_after_it():
  """In the prefill's trace, each position's token slice (glue reading
  only the batch) sits in the node of that position's embedding; glue
  reading a module's results (the residual adds) stays before."""
  params, _ = _params_and_batch()
  cache = jax.eval_shape(lambda: _empty_cache(2, 8))
  example = {"cache": cache, "tokens": jax.ShapeDtypeStruct((2, 3), jnp.int32)}
  traced = partition.trace(_decode_fn, params, example, returns_loss=False)
  slices = [
    traced.node_names[n]
    for eqn, n in zip(traced.jaxpr.eqns, traced.eqn_node, strict=True)
    if eqn.primitive.name == "slice" and eqn.invars[0] in traced.jaxpr.invars
  ]
  assert slices == ["embed", "embed#2", "embed#3"]


class EncoderDecoder(nn.Module):
  """Every decoder block attends to the encoder's outputs, which the
  decoding functions keep in the cache (the Flax examples' WMT model
  decodes so): a cache leaf read on every decoder stage."""

  decode: bool = False

  def setup(self):
    self.embed = nn.Embed(VOCAB, WIDTH)
    self.encoder = [nn.Dense(WIDTH) for _ in range(2)]
    self.own = [
      nn.MultiHeadDotProductAttention(num_heads=2, decode=self.decode)
      for _ in range(LAYERS)
    ]
    self.cross = [
      nn.MultiHeadDotProductAttention(num_heads=2) for _ in range(LAYERS)
    ]
    self.head = nn.Dense(VOCAB)

  def encode(self, inputs):
    x = self.embed(inputs)
    for dense in self.encoder:
      x = x + jnp.tanh(dense(x))
    return x

  def decode_targets(self, encoded, targets):
    y = self.embed(targets)
    mask = None if self.decode else nn.make_causal_mask(targets)
    for own, cross in zip(self.own, self.cross, strict=True):
      y = y + own(y, mask=mask)
      y = y + cross(y, encoded)
    return self.head(y)

  def __call__(self, inputs, targets):
    return self.decode_targets(self.encode(inputs), targets)


SEQ2SEQ, SEQ2SEQ_DECODE = EncoderDecoder(), EncoderDecoder(decode=True)
SOURCE = 5


def _seq2seq_step(params, cache, tokens):
  logits, variables = SEQ2SEQ_DECODE.apply(
    {"params": params, "cache": cache["attention"]},
    cache["encoded"],
    tokens,
    mutable=["cache"],
    method=EncoderDecoder.decode_targets,
  )
  return logits[:, -1], {
    "attention": variables["cache"],
    "encoded": cache["encoded"],
  }


def _seq2seq_prefill(params, batch):
  encoded = SEQ2SEQ_DECODE.apply(
    {"params": params}, batch["inputs"], method=EncoderDecoder.encode
  )
  cache = {"attention": batch["cache"]["attention"], "encoded": encoded}
  return _seq2seq_step(params, cache, batch["tokens"])


def _seq2seq_empty_cache(b, length):
  ones = jnp.ones((b, SOURCE), jnp.int32), jnp.ones((b, length), jnp.int32)
  return {
    "attention": SEQ2SEQ_DECODE.init(jax.random.key(0), *ones)["cache"],
    "encoded": jnp.zeros((b, SOURCE, WIDTH)),
  }


def test_an_encoder_output_every_decoder_stage_reads_is_copied_to_each():
  sources = jax.random.randint(jax.random.key(1), (4, SOURCE), 0, VOCAB)
  targets = jax.random.randint(jax.random.key(2), (4, 6), 0, VOCAB)
  params = SEQ2SEQ.init(jax.random.key(0), sources, targets)["params"]

  def loss_fn(params, batch):
    logits = SEQ2SEQ.apply({"params": params}, batch["x"], batch["y"])
    return optax.softmax_cross_entropy_with_integer_labels(
      logits, batch["y"]
    ).mean()

  pipe = jpipe.Pipeline(
    loss_fn,
    params,
    {"x": sources, "y": targets},
    num_stages=3,
    devices=jax.devices()[:3],
    num_microbatches=2,
    optimizer=optax.sgd(0.1),
  )
  cross_stages = {
    s
    for s, spec in enumerate(pipe.stages.specs)
    for i in spec.param_leaves
    if pipe.leaf_names[i].startswith("cross_")
  }
  assert len(cross_stages) > 1  # Read on several stages.
  got = pipe.generate(
    pipe.init(params),
    np.asarray(sources),
    _seq2seq_step_fn,
    _seq2seq_empty_cache,
    max_new_tokens=4,
    prefill_fn=_seq2seq_prefill,
  )
  # Greedy from start token 0, recomputing the decoder without a cache.
  tokens = jnp.zeros((4, 1), jnp.int32)
  for _ in range(4):
    logits = SEQ2SEQ.apply({"params": params}, sources, tokens)
    tokens = jnp.concatenate([tokens, jnp.argmax(logits[:, -1:], -1)], 1)
  np.testing.assert_array_equal(np.asarray(got), np.asarray(tokens[:, 1:]))


def _seq2seq_step_fn(params, batch):
  return _seq2seq_step(params, batch["cache"], batch["tokens"])


class ScannedBlock(nn.Module):
  decode: bool

  @nn.compact
  def __call__(self, x, _):
    mask = None if self.decode else nn.make_causal_mask(jnp.ones(x.shape[:2]))
    attention = nn.MultiHeadDotProductAttention(num_heads=2, decode=self.decode)
    return x + attention(nn.LayerNorm()(x), mask=mask), None


class ScannedLm(nn.Module):
  """Blocks under nn.scan, their caches stacked like their params (the
  params on axis ``axis``)."""

  decode: bool = False
  axis: int = 0

  @nn.compact
  def __call__(self, tokens):
    x = nn.Embed(VOCAB, WIDTH)(tokens)
    blocks = nn.scan(
      ScannedBlock,
      # (Not the cache on axis 1: its scalar index per layer has none.)
      variable_axes={"params": self.axis, "cache": 0},
      split_rngs={"params": True},
      length=4,
    )
    x, _ = blocks(self.decode, name="blocks")(x, None)
    return nn.Dense(VOCAB, name="head")(x)


SCANNED, SCANNED_DECODE = ScannedLm(), ScannedLm(decode=True)


@pytest.mark.parametrize("axis", [0, tiers.slow(1)])
def test_scanned_layers_decode_one_position_per_call(axis):
  """A scanned model's prompt position by position through its one-call
  step as recomputing greedy, its stacked cache (cached keys, values and
  index: [4 layers, ...] each; the params stacked on axis 0 or 1) on
  the stages as rows, each row read and written only by its layer's
  stage; a prefill looping over positions calls the scan several times,
  whose stacked params are not split by layer: refused naming
  one_position."""
  scanned, scanned_decode = ScannedLm(axis=axis), ScannedLm(True, axis)
  x = jax.random.randint(jax.random.key(1), (4, 6), 0, VOCAB)
  params = scanned.init(jax.random.key(0), x)["params"]
  loss_fn = _next_token_loss(scanned)
  empty_cache = _empty_cache_of(scanned_decode)

  pipe = jpipe.Pipeline(
    loss_fn,
    params,
    {"x": x},
    num_stages=2,
    devices=jax.devices()[:2],
    num_microbatches=2,
    optimizer=optax.sgd(0.1),
  )
  assert pipe.traced.param_layout is not None  # Training split the scan.
  state, prompts = pipe.init(params), np.asarray(x[:, :3])
  got = pipe.generate(
    state,
    prompts,
    _one_position_decode_fn(scanned_decode),
    empty_cache,
    max_new_tokens=3,
    one_position=True,
  )
  np.testing.assert_array_equal(
    np.asarray(got), _greedy_recomputing(params, prompts, 3, scanned)
  )
  programs = [p for k, p in pipe.forward_programs.items() if k[0] != "written"]
  by_rows = max(programs, key=lambda p: p.num_batch_leaves)
  assert by_rows.num_batch_leaves == 3 * 4 + 3  # Rows; index, pad, tokens.
  read = [i for wanted in by_rows.batch_leaves.values() for i in wanted]
  assert len(read) == len(set(read))  # Each on one stage.
  looping = _looping_decode_fn(scanned_decode)
  with pytest.raises(ValueError, match="one_position=True"):
    pipe.generate(state, prompts, looping, empty_cache, max_new_tokens=2)
