"""``jpipe.nnx_loss``: an NNX model and a loss written the NNX way
(``loss_fn(model, batch)``) through a Pipeline, against NNX's own
microbatch loop (``nnx.value_and_grad`` on the model, its BatchNorm
statistics and RNG streams advancing call by call)."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import jpipe
from tests.partition import flax_models
from tests.runtime.test_pipeline_sync import _assert_tree_close

B, M, LR = 32, 4, 0.1  # Microbatches of 8: BatchNorm's statistics settle.


class _Block(nnx.Module):
  def __init__(self, width, rngs, norm=True):
    self.linear = nnx.Linear(width, width, rngs=rngs)
    self.norm = nnx.BatchNorm(width, rngs=rngs) if norm else None
    self.dropout = nnx.Dropout(0.3, rngs=rngs)  # Its own stream.

  def __call__(self, x):
    h = self.linear(x)
    h = self.norm(h) if self.norm is not None else h
    return x + self.dropout(nnx.relu(h))


class _Net(nnx.Module):
  def __init__(self, rngs, norm=True, dropout=True):
    self.stem = nnx.Linear(6, 16, rngs=rngs)
    self.blocks = nnx.List([_Block(16, rngs, norm) for _ in range(4)])
    self.head = nnx.Linear(16, 3, rngs=rngs)
    if not dropout:
      for block in self.blocks:
        block.dropout = nnx.Dropout(0.0)

  def __call__(self, x):
    x = self.stem(x)
    for block in self.blocks:
      x = block(x)
    return self.head(x)


def _batch():
  x = jax.random.normal(jax.random.key(0), (B, 6))
  y = jax.random.randint(jax.random.key(1), (B,), 0, 3)
  return {"x": x, "y": y}


def _loss(model, batch):
  logits = model(batch["x"])
  return optax.softmax_cross_entropy_with_integer_labels(
    logits, batch["y"]
  ).mean()


def _nnx_loop(model, loss_fn, batch, has_aux=False):
  """NNX's own step on a clone: value_and_grad per microbatch (state
  advancing), the mean gradient, SGD; (params, other state, losses)."""
  model = nnx.clone(model)
  grads, losses, size = None, [], B // M
  # (nnx.jit: the same step, its state updates kept; op by op it cost
  # more than the pipelines it checks.)
  step = nnx.jit(nnx.value_and_grad(loss_fn, has_aux=has_aux))
  for k in range(M):
    mb = jax.tree.map(lambda a, k=k: a[k * size : (k + 1) * size], batch)
    out, g = step(model, mb)
    losses.append(out[0] if has_aux else out)
    grads = g if grads is None else jax.tree.map(jnp.add, grads, g)
  params = jax.tree.map(
    lambda p, g: p - LR * g / M, nnx.state(model, nnx.Param), grads
  )
  _, _, state = nnx.split(model, nnx.Param, ...)
  return params, state, losses


def _assert_state_close(got, want):
  def values(tree):
    return [
      jax.random.key_data(x)
      if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key)
      else x
      for x in jax.tree.leaves(tree)
    ]

  _assert_tree_close(values(got), values(want))


def _pipeline(nl, batch, stages, schedule, **options):
  return jpipe.Pipeline(
    nl.loss_fn,
    nl.params,
    batch,
    model_state=nl.model_state,
    num_stages=stages,
    devices=jax.devices()[:stages],
    schedule=schedule,
    num_microbatches=M,
    **{"optimizer": optax.sgd(LR), **options},
  )


@pytest.mark.parametrize("stages, schedule", [(2, "1f1b"), (3, "zbh1")])
def test_a_step_equals_nnx_own_microbatch_loop(stages, schedule):
  """BatchNorm statistics and each Dropout's RNG stream are model state:
  params, statistics, keys and counts after a step equal NNX's loop."""
  model = _Net(nnx.Rngs(0, dropout=1))
  batch = _batch()
  nl = jpipe.nnx_loss(model, _loss)
  assert nl.model_state is not None
  pipe = _pipeline(nl, batch, stages, schedule)
  state, metrics = pipe.step(pipe.init(nl.params, nl.model_state), batch)
  params, other, losses = _nnx_loop(model, _loss, batch)
  _assert_tree_close(pipe.gather_params(state), params)
  _assert_state_close(pipe.gather_model_state(state), other)
  assert float(metrics["loss"]) == pytest.approx(np.mean(losses), rel=1e-5)
  # The model is untouched until written back; then it is NNX's after
  # the same step.
  _assert_tree_close(nnx.state(model, nnx.Param), nl.params)
  nl.write_back(model, pipe, state)
  _assert_tree_close(nnx.state(model, nnx.Param), params)


@pytest.mark.parametrize("kind", ["hijax", "ref"])
def test_hijax_and_ref_variables_train_as_ordinary_ones(kind):
  """A model made with ``nnx.var_defaults(hijax=True)`` (variables as
  JAX types of their own) or ``ref=True`` (mutable array references)
  trains as NNX's own loop trains the same model made with ordinary
  variables (NNX 0.12's ``value_and_grad`` cannot differentiate the
  former's), and the results write back into it."""
  with nnx.var_defaults(**{kind: True}):
    model = _Net(nnx.Rngs(0, dropout=1))
  assert getattr(model.stem.kernel, kind)
  batch = _batch()
  nl = jpipe.nnx_loss(model, _loss)
  pipe = _pipeline(nl, batch, 2, "1f1b")
  state, metrics = pipe.step(pipe.init(nl.params, nl.model_state), batch)
  ordinary = _Net(nnx.Rngs(0, dropout=1))
  params, other, losses = _nnx_loop(ordinary, _loss, batch)
  _assert_tree_close(pipe.gather_params(state), params)
  _assert_state_close(pipe.gather_model_state(state), other)
  assert float(metrics["loss"]) == pytest.approx(np.mean(losses), rel=1e-5)
  nl.write_back(model, pipe, state)
  assert getattr(model.stem.kernel, kind)  # Still the caller's kind.
  _assert_tree_close(nnx.state(model, nnx.Param), params)


def test_hijax_variables_split_by_hand_are_named_with_the_fix():
  """``nnx.split`` of a hijax model gives variables that are no arrays:
  refused before tracing, naming the leaf and ``nnx_loss``."""
  with nnx.var_defaults(hijax=True):
    model = _Net(nnx.Rngs(0), norm=False, dropout=False)
  graphdef, params = nnx.split(model, nnx.Param)[:2]

  def loss_fn(params, batch):
    return _loss(nnx.merge(graphdef, params), batch)

  with pytest.raises(
    ValueError, match=r"params leaf \['blocks'\]\[0\].*nnx_loss"
  ):
    _pipeline(jpipe.runtime.NnxLoss(loss_fn, params, None), _batch(), 2, "1f1b")


def test_a_model_of_params_only_and_aux_outputs():
  """No other variables: ``loss_fn(params, batch)``, no model state;
  ``has_aux`` passes the loss's aux through; the trained params write
  back."""
  model = _Net(nnx.Rngs(0), norm=False, dropout=False)
  batch = _batch()

  def with_aux(model, batch):
    logits = model(batch["x"])
    loss = optax.softmax_cross_entropy_with_integer_labels(
      logits, batch["y"]
    ).mean()
    return loss, {"accuracy": jnp.mean(jnp.argmax(logits, -1) == batch["y"])}

  nl = jpipe.nnx_loss(model, with_aux, has_aux=True)
  assert nl.model_state is None
  pipe = _pipeline(nl, batch, 2, "1f1b", has_aux=True)
  state, metrics = pipe.step(pipe.init(nl.params), batch)
  params, _, losses = _nnx_loop(model, with_aux, batch, has_aux=True)
  _assert_tree_close(pipe.gather_params(state), params)
  assert float(metrics["loss"]) == pytest.approx(np.mean(losses), rel=1e-5)
  assert 0.0 <= float(metrics["aux"]["accuracy"]) <= 1.0
  nl.write_back(model, pipe, state)  # (No model state to write.)
  _assert_tree_close(nnx.state(model, nnx.Param), params)


def test_a_stream_shared_across_stages_is_refused_naming_the_fix():
  """One ``nnx.Rngs`` passed to the calls of modules on two stages
  advances on both: refused, saying to give each module its stream."""

  class Shared(nnx.Module):
    def __init__(self, rngs):
      self.rngs = rngs
      self.layers = nnx.List([nnx.Linear(6, 6, rngs=rngs) for _ in range(4)])
      self.dropout = nnx.Dropout(0.3)
      self.head = nnx.Linear(6, 3, rngs=rngs)

    def __call__(self, x):
      for layer in self.layers:
        x = self.dropout(nnx.relu(layer(x)), rngs=self.rngs)
      return self.head(x)

  nl = jpipe.nnx_loss(Shared(nnx.Rngs(0, dropout=1)), _loss)
  with pytest.raises(ValueError, match="NNX RNG stream.*its own stream"):
    _pipeline(nl, _batch(), 2, "1f1b")


def test_only_nnx_modules():
  with pytest.raises(TypeError, match="takes an nnx.Module"):
    jpipe.nnx_loss({"w": jnp.ones(3)}, _loss)


def test_the_nnx_loss_itself_as_loss_fn_names_its_parts():
  """``Pipeline(jpipe.nnx_loss(...), ...)``: one line naming the parts to
  pass, before any tracing; any other object that is no function too."""
  tx = optax.sgd(LR)
  nl = jpipe.nnx_loss(_Net(nnx.Rngs(0)), _loss)
  with pytest.raises(TypeError, match=r"NnxLoss, not a function.*nl\.loss_fn"):
    jpipe.Pipeline(nl, nl.params, _batch(), num_stages=2, optimizer=tx)
  with pytest.raises(TypeError, match="loss_fn must be a function, got dict"):
    jpipe.Pipeline(
      {"f": _loss}, nl.params, _batch(), num_stages=2, optimizer=tx
    )


@pytest.mark.parametrize("stages, schedule", [(2, "1f1b"), (3, "zbh1")])
def test_lora_wrt_trains_as_nnx_own_lora_loop(stages, schedule):
  """``wrt=nnx.LoRAParam``: the LoRA factors train as NNX's own loop
  (``nnx.DiffState``, ``nnx.Optimizer(wrt=...)``) trains them; the base
  weights are model state, unchanged, each read where its layer runs
  (none gathered on the last stage to be returned unchanged)."""
  model, lm_loss, batch = flax_models.nnx_lora_lm(examples=B)
  nl = jpipe.nnx_loss(model, lm_loss, wrt=nnx.LoRAParam)
  assert all(
    "lora" in jax.tree_util.keystr(p)
    for p, _ in jax.tree_util.tree_flatten_with_path(nl.params)[0]
  )
  tx = optax.adam(0.01)
  pipe = _pipeline(nl, batch, stages, schedule, optimizer=tx)
  nb = pipe.num_batch_leaves
  last = pipe.stages.specs[-1]
  frozen_read = {i - nb for i in last.batch_leaves if i >= nb}
  # The embedding, and the two kernel-and-bias pairs of its own blocks.
  assert len(frozen_read) <= 5 and not last.results[1:]
  state = pipe.init(nl.params, nl.model_state)
  for _ in range(2):
    state, _ = pipe.step(state, batch)

  ref = nnx.clone(model)
  opt = nnx.Optimizer(ref, tx, wrt=nnx.LoRAParam)
  grad = nnx.jit(nnx.grad(lm_loss, argnums=nnx.DiffState(0, nnx.LoRAParam)))
  size = B // M
  for _ in range(2):
    grads = [
      grad(
        ref, jax.tree.map(lambda a, k=k: a[k * size : (k + 1) * size], batch)
      )
      for k in range(M)
    ]
    opt.update(ref, jax.tree.map(lambda *g: sum(g) / M, *grads))
  _assert_tree_close(pipe.gather_params(state), nnx.state(ref, nnx.LoRAParam))
  _assert_tree_close(pipe.gather_model_state(state), nl.model_state)


def test_a_wrt_that_selects_nothing_is_refused():
  with pytest.raises(ValueError, match="selects none of the model's"):
    jpipe.nnx_loss(_Net(nnx.Rngs(0)), _loss, wrt=nnx.LoRAParam)
