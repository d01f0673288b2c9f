"""The Flax examples' models (``tests/flax_examples/*_models.py``, as
Flax ships them) through a pipeline: a 1F1B step on three stages equals
one device's microbatch loop (params, and BatchNorm's statistics where
the model has them), each with what makes it its own -- lm1b's and
wmt's Transformers with dropout, padding masks and a right shift inside
the model, imagenet's ResNet with BatchNorm reduced over a named axis,
sst2's bidirectional LSTM (a scan over time: one node, not layers) with
word dropout, seq2seq's ``nn.RNN`` of a cell drawing from an RNG stream
of its own, vae's key passed as an argument -- and lm1b's decoding
cache (``decode=True``) gives, through the stages, the tokens the same
decoding gives on one device."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jpipe
from tests.flax_examples import (
  imagenet_models,
  lm1b_models,
  sst2_models,
  vae_models,
  wmt_models,
)
from tests.flax_examples import seq2seq_models as seq2seq_lib

pytestmark = pytest.mark.slow  # (~3-8 worker-seconds each.)

B, M, LR, STAGES = 8, 4, 0.1, 3
_rng = np.random.RandomState(0)


def _keys():
  """A dropout key per example (the loss takes its microbatch's first)."""
  return np.asarray(jax.random.key_data(jax.random.split(jax.random.key(1), B)))


def _key(batch):
  return jax.random.wrap_key_data(batch["key"][0])


def _transformer_config(module, num_layers=4, **kw):
  return module.TransformerConfig(
    vocab_size=32,
    output_vocab_size=32,
    emb_dim=16,
    num_heads=2,
    num_layers=num_layers,
    qkv_dim=16,
    mlp_dim=32,
    max_len=16,
    **kw,
  )


def lm1b():
  cfg = _transformer_config(
    lm1b_models,
    dropout_rate=0.1,
    attention_dropout_rate=0.1,
    deterministic=False,
  )
  model = lm1b_models.TransformerLM(cfg)
  ids = _rng.randint(1, 32, (B, 16)).astype(np.int32)
  ids[:, 12:] = 0  # (Padding, masked by the model.)
  init = {"params": jax.random.key(0), "dropout": jax.random.key(1)}
  params = model.init(init, ids[:2])["params"]

  def loss_fn(params, batch):
    logits = model.apply(
      {"params": params}, batch["ids"], rngs={"dropout": _key(batch)}
    )
    return optax.softmax_cross_entropy_with_integer_labels(
      logits, batch["ids"]
    ).mean()

  return loss_fn, params, None, {"ids": ids, "key": _keys()}


def wmt():
  cfg = _transformer_config(
    wmt_models,
    num_layers=2,  # (Encoder and decoder: 13 module calls each.)
    dropout_rate=0.1,
    attention_dropout_rate=0.1,
    deterministic=False,
  )
  model = wmt_models.Transformer(cfg)
  src = _rng.randint(1, 32, (B, 12)).astype(np.int32)
  tgt = _rng.randint(1, 32, (B, 10)).astype(np.int32)
  init = {"params": jax.random.key(0), "dropout": jax.random.key(1)}
  params = model.init(init, src[:2], tgt[:2])["params"]

  def loss_fn(params, batch):
    logits = model.apply(
      {"params": params},
      batch["src"],
      batch["tgt"],
      rngs={"dropout": _key(batch)},
    )
    return optax.softmax_cross_entropy_with_integer_labels(
      logits, batch["tgt"]
    ).mean()

  return loss_fn, params, None, {"src": src, "tgt": tgt, "key": _keys()}


def imagenet():
  """BatchNorm with ``axis_name="batch"`` (the example trains under
  ``pmap``): the loss runs the model in a one-element ``vmap`` of that
  name."""
  model = imagenet_models.ResNet(
    stage_sizes=[1, 1, 1],
    block_cls=imagenet_models.ResNetBlock,
    num_classes=10,
    num_filters=4,
  )
  x = _rng.randn(B, 32, 32, 3).astype(np.float32)
  y = _rng.randint(0, 10, (B,)).astype(np.int32)

  def named(fn, *args):
    out = jax.vmap(fn, axis_name="batch", axis_size=1)(*(a[None] for a in args))
    return jax.tree.map(lambda a: a[0], out)

  variables = named(lambda x: model.init(jax.random.key(0), x, train=False), x)

  def loss_fn(params, state, batch):
    def apply(x):
      return model.apply(
        {"params": params, "batch_stats": state},
        x,
        train=True,
        mutable=["batch_stats"],
      )

    logits, new = named(apply, batch["x"])
    loss = optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"])
    return loss.mean(), new["batch_stats"]

  return (
    loss_fn,
    variables["params"],
    variables["batch_stats"],
    {
      "x": x,
      "y": y,
    },
  )


def sst2():
  model = sst2_models.TextClassifier(
    embedding_size=16,
    hidden_size=16,
    vocab_size=40,
    output_size=2,
    dropout_rate=0.1,
    word_dropout_rate=0.1,
  )
  ids = _rng.randint(2, 40, (B, 10)).astype(np.int32)
  lengths = _rng.randint(3, 11, (B,)).astype(np.int32)
  y = _rng.randint(0, 2, (B,)).astype(np.int32)
  params = model.init(
    jax.random.key(0), ids[:2], lengths[:2], deterministic=True
  )["params"]

  def loss_fn(params, batch):
    logits = model.apply(
      {"params": params},
      batch["ids"],
      batch["lengths"],
      deterministic=False,
      rngs={"dropout": _key(batch)},
    )
    return optax.softmax_cross_entropy_with_integer_labels(
      logits, batch["y"]
    ).mean()

  batch = {"ids": ids, "lengths": lengths, "y": y, "key": _keys()}
  return loss_fn, params, None, batch


def seq2seq():
  vocab = 12
  model = seq2seq_lib.Seq2seq(
    teacher_force=True, hidden_size=16, vocab_size=vocab
  )
  enc = np.eye(vocab, dtype=np.float32)[_rng.randint(0, vocab, (B, 7))]
  dec = np.eye(vocab, dtype=np.float32)[_rng.randint(0, vocab, (B, 6))]
  init = {"params": jax.random.key(0), "lstm": jax.random.key(1)}
  params = model.init(init, enc[:2], dec[:2])["params"]

  def loss_fn(params, batch):
    logits, _ = model.apply(
      {"params": params},
      batch["enc"],
      batch["dec"],
      rngs={"lstm": _key(batch)},
    )
    return optax.softmax_cross_entropy(logits, batch["dec"][:, 1:]).mean()

  return loss_fn, params, None, {"enc": enc, "dec": dec, "key": _keys()}


def vae():
  model = vae_models.model(8)
  x = _rng.rand(B, 784).astype(np.float32)
  params = model.init(jax.random.key(0), x[:2], jax.random.key(2))["params"]

  def loss_fn(params, batch):
    recon, mean, logvar = model.apply(
      {"params": params}, batch["x"], _key(batch)
    )
    bce = optax.sigmoid_binary_cross_entropy(recon, batch["x"]).sum(-1)
    kld = -0.5 * jnp.sum(1 + logvar - mean**2 - jnp.exp(logvar), -1)
    return (bce + kld).mean()

  return loss_fn, params, None, {"x": x, "key": _keys()}


def _microbatch_loop(loss_fn, params, state, batch):
  """One device: the microbatches in order (model state threaded), an
  SGD step on their mean gradient; (params, state)."""
  size, grads = B // M, []
  grad_fn = jax.jit(jax.grad(loss_fn, has_aux=state is not None))  # (Once.)
  for k in range(M):
    mb = jax.tree.map(lambda a, k=k: a[k * size : (k + 1) * size], batch)
    if state is None:
      grads.append(grad_fn(params, mb))
    else:
      g, state = grad_fn(params, state, mb)
      grads.append(g)
  mean = jax.tree.map(lambda *g: sum(g) / M, *grads)
  return jax.tree.map(lambda p, g: p - LR * g, params, mean), state


def _close(got, want):
  assert jax.tree.structure(got) == jax.tree.structure(want)
  for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-5)


@pytest.mark.parametrize(
  "case", [lm1b, wmt, imagenet, sst2, seq2seq, vae], ids=lambda f: f.__name__
)
def test_a_1f1b_step_through_three_stages_equals_one_device(case):
  loss_fn, params, state, batch = case()
  kw = {} if state is None else {"model_state": state}
  pipe = jpipe.Pipeline(
    loss_fn,
    params,
    batch,
    num_stages=STAGES,
    devices=jax.devices()[:STAGES],
    schedule="1f1b",
    num_microbatches=M,
    optimizer=optax.sgd(LR),
    **kw,
  )
  # Every stage runs part of the model.
  assert set(pipe.plan.stage_of_node) == set(range(STAGES))
  start = pipe.init(params) if state is None else pipe.init(params, state)
  done, _ = pipe.step(start, batch)
  want_params, want_state = _microbatch_loop(loss_fn, params, state, batch)
  _close(pipe.gather_params(done), want_params)
  if state is not None:
    _close(pipe.gather_model_state(done), want_state)


def test_lm1b_decodes_through_the_stages_as_on_one_device():
  """lm1b's ``decode=True`` model (its attention's cache and the
  position embedding's ``cache_index``), one position per call: greedy
  tokens through three stages, each layer's cache on its stage, equal
  the same decoding function looped on one device."""
  cfg = _transformer_config(lm1b_models, deterministic=True)
  train = lm1b_models.TransformerLM(cfg)
  decode = lm1b_models.TransformerLM(cfg.replace(decode=True))
  ids = _rng.randint(1, 32, (4, 12)).astype(np.int32)
  params = train.init(jax.random.key(0), ids)["params"]

  def loss_fn(params, batch):
    logits = train.apply({"params": params}, batch["x"])
    return optax.softmax_cross_entropy_with_integer_labels(
      logits, batch["x"]
    ).mean()

  def empty_cache(b, length):
    ones = jnp.ones((b, length), jnp.int32)
    return decode.init(jax.random.key(0), ones)["cache"]

  def decode_fn(params, batch):
    logits, variables = decode.apply(
      {"params": params, "cache": batch["cache"]},
      batch["tokens"],
      mutable=["cache"],
    )
    return logits[:, -1], variables["cache"]

  pipe = jpipe.Pipeline(
    loss_fn,
    params,
    {"x": ids},
    num_stages=STAGES,
    devices=jax.devices()[:STAGES],
    num_microbatches=2,
    optimizer=optax.sgd(LR),
  )
  # (Token 0 begins a sequence: lm1b shifts its inputs right so.)
  prompts = np.concatenate([np.zeros((4, 1), np.int32), ids[:, :3]], 1)
  new = 6
  got = pipe.generate(
    pipe.init(params),
    prompts,
    decode_fn,
    empty_cache,
    max_new_tokens=new,
    one_position=True,
  )
  step = jax.jit(decode_fn)
  cache = empty_cache(4, prompts.shape[1] + new)
  for t in range(prompts.shape[1]):
    logits, cache = step(
      params, {"tokens": prompts[:, t : t + 1], "cache": cache}
    )
  want = []
  for _ in range(new):
    want.append(np.asarray(jnp.argmax(logits, -1), np.int32))
    logits, cache = step(params, {"tokens": want[-1][:, None], "cache": cache})
  np.testing.assert_array_equal(np.asarray(got), np.stack(want, 1))
