"""``jpipe.runtime.opt_state_to_optax`` / ``opt_state_from_optax``: a
state dict's optimizer state continues a plain optax loop on one device,
and a plain optax run's state continues in a pipeline, step for step."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jpipe
from jpipe.models import gpt2
from jpipe.runtime import opt_state_from_optax, opt_state_to_optax
from tests.partition import flax_models
from tests.runtime.test_pipeline_sync import _assert_tree_close, _microbatch
from tests.tiers import slow

M = 2  # Microbatches per step.


def _adamw():
  """AdamW decaying only matrices (a mask over the params' structure):
  moments keyed by path, a masked state with its own structure."""
  return optax.adamw(
    1e-2, weight_decay=0.1, mask=lambda p: jax.tree.map(lambda x: x.ndim > 1, p)
  )


def _optax_step(loss_fn, tx):
  """One device: the mean of M microbatch gradients, then an optax step."""
  grad_fn = jax.jit(jax.grad(loss_fn))

  def step(params, opt_state, batch):
    grads = [grad_fn(params, _microbatch(batch, k, M)) for k in range(M)]
    mean = jax.tree.map(lambda *g: sum(g) / M, *grads)
    updates, opt_state = tx.update(mean, opt_state, params)
    return optax.apply_updates(params, updates), opt_state

  return step


def _gpt_scanned():
  """jpipe's GPT-2 with its blocks scanned (stacked leaves), cut between
  layers: the stages hold rows of each stacked leaf."""
  model = gpt2.Model(
    vocab_size=32, n_positions=16, d_model=8, num_layers=4, num_heads=2,
    dropout=0.0, scan_layers=True,
  )  # fmt: skip
  tokens = np.random.RandomState(0).randint(0, 32, (4, 9)).astype(np.int32)
  params = model.init(jax.random.key(0), tokens, train=False)["params"]

  def loss_fn(params, batch):
    logits = model.apply({"params": params}, batch["x"][:, :-1], train=False)
    return optax.softmax_cross_entropy_with_integer_labels(
      logits, batch["x"][:, 1:]
    ).mean()

  return loss_fn, params, {"x": tokens}


def _case(name):
  if name == "gpt_scanned":
    return _gpt_scanned()
  loss_fn, params, batch, _ = flax_models.CASES[name]()
  return loss_fn, params, batch


@pytest.mark.parametrize(
  "case, stages", [("mlp", 2), slow("gpt_scanned", 2, id="gpt_scanned")]
)
def test_a_pipeline_state_continues_in_plain_optax_and_back(case, stages):
  loss_fn, params, batch = _case(case)
  tx = _adamw()
  pipe = jpipe.Pipeline(
    loss_fn,
    params,
    batch,
    num_stages=stages,
    devices=jax.devices()[:stages],
    num_microbatches=M,
    optimizer=tx,
  )
  state = pipe.init(params)
  for _ in range(2):
    state, _ = pipe.step(state, batch)
  saved = pipe.state_dict(state)
  optax_state = opt_state_to_optax(saved["opt_state"], tx, saved["params"])
  # The layout optax itself makes, and a plain optax step from it is the
  # pipeline's third step.
  assert jax.tree.structure(optax_state) == jax.tree.structure(tx.init(params))
  step = _optax_step(loss_fn, tx)
  want, want_state = step(saved["params"], optax_state, batch)
  state, _ = pipe.step(state, batch)
  _assert_tree_close(pipe.gather_params(state), want)
  # Back: the plain optax state loads into the pipeline, which steps as
  # optax does (a fourth step on both sides).
  back = opt_state_from_optax(want_state, want)
  _assert_tree_close(back, pipe.state_dict(state)["opt_state"])
  loaded = pipe.load_state_dict({"params": want, "opt_state": back, "step": 3})
  loaded, _ = pipe.step(loaded, batch)
  want, _ = step(want, want_state, batch)
  _assert_tree_close(pipe.gather_params(loaded), want)


def test_another_optimizers_state_is_named():
  loss_fn, params, batch = _case("mlp")
  pipe = jpipe.Pipeline(
    loss_fn,
    params,
    batch,
    num_stages=2,
    devices=jax.devices()[:2],
    num_microbatches=M,
    optimizer=optax.sgd(0.1, momentum=0.9),
  )
  saved = pipe.state_dict(pipe.init(params))
  with pytest.raises(ValueError, match="another optimizer"):
    opt_state_to_optax(saved["opt_state"], _adamw(), params)
  with pytest.raises(ValueError, match="GradientTransformation"):
    opt_state_to_optax(saved["opt_state"], optax.sgd, params)
  # Momentum's trace, keyed and back, unchanged (zeros are not a test:
  # a random state).
  tx = optax.sgd(0.1, momentum=0.9)
  rng = np.random.RandomState(0)
  state = jax.tree.map(
    lambda x: jnp.asarray(rng.normal(size=x.shape), x.dtype),
    tx.init(params),
  )
  keyed = opt_state_from_optax(state, params)
  assert set(keyed[0].trace) == set(saved["opt_state"][0].trace)
  _assert_tree_close(opt_state_to_optax(keyed, tx, params), state)
