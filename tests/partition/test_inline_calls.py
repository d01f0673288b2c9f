"""Nested ``jax.jit`` calls opened for the partitioner (``_inline_calls``):
a jitted loss splits as the plain one does and trains as one device; the
opened jaxpr computes what the original does (``jax.core.eval_jaxpr`` of
both); whatever no cut can enter is named when too few nodes remain."""

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jpipe
from jpipe import partition
from jpipe.partition._inline_calls import inline_module_calls
from tests.partition import flax_models, scan_models
from tests.runtime.test_replicated_stages import _trains_like_one_device


def _params():
  k = jax.random.split(jax.random.key(0), 3)
  return {
    "a": jax.random.normal(k[0], (6, 6)),
    "b": jax.random.normal(k[1], (6, 6)),
    "c": jax.random.normal(k[2], (6, 3)),
  }


@jax.jit
def _two_blocks(p, x):
  """Two scoped blocks; also returns its input and a constant (results
  that no equation of the body makes)."""
  with jax.named_scope("a"):
    h = jnp.tanh(x @ p["a"])
  with jax.named_scope("b"):
    h = jnp.tanh(h @ p["b"])
  return h, x, 2.0


@functools.partial(jax.jit, static_argnames="scale")
def _loss(p, batch, scale):
  h, x, two = _two_blocks(p, batch["x"])
  _, _, unused = _two_blocks(p, x)  # (Results dropped.)
  with jax.named_scope("head"):
    y = jnp.clip(h @ p["c"], -1.0, 1.0)  # A jit inside one scope.
  return scale * two * jnp.mean(y) + 0.0 * unused


def _batch(n=8):
  return {"x": jax.random.normal(jax.random.key(1), (n, 6))}


def _jits(jaxpr):
  return [e for e in jaxpr.eqns if e.primitive.name in ("jit", "pjit")]


def test_the_opened_jaxpr_computes_the_same():
  params, batch = _params(), _batch()
  closed = jax.make_jaxpr(functools.partial(_loss, scale=3.0))(params, batch)
  assert len(closed.jaxpr.eqns) == 1  # One call holding everything.
  opened = inline_module_calls(closed)
  args = jax.tree.leaves((params, batch))
  want = jax.core.eval_jaxpr(closed.jaxpr, closed.consts, *args)
  got = jax.core.eval_jaxpr(opened.jaxpr, opened.consts, *args)
  np.testing.assert_allclose(got[0], want[0], rtol=1e-6)
  np.testing.assert_allclose(got[0], _loss(params, batch, 3.0), rtol=1e-6)
  # No jit spanning two scopes remains; jnp.clip's own (in "head") does.
  scopes = {str(e.source_info.name_stack) for e in opened.jaxpr.eqns}
  assert {"a", "b", "head"} <= scopes
  assert [str(e.source_info.name_stack) for e in _jits(opened.jaxpr)] == [
    "head"
  ]
  # Nothing to open: the very same jaxpr back.
  plain = jax.make_jaxpr(lambda p, b: jnp.sum(b["x"] @ p["a"]))(params, batch)
  assert inline_module_calls(plain) is plain


def test_a_jitted_loss_splits_like_the_plain_one():
  params, batch = _params(), _batch()
  traced = partition.trace(
    functools.partial(_loss, scale=1.0), params, batch, depth=1
  )
  assert traced.node_names == ("a", "b", "a#2", "b#2", "head")
  loss_fn, params, batch = scan_models.linen_case()
  plain = partition.trace(loss_fn, params, batch, depth=1)
  jitted = partition.trace(jax.jit(loss_fn), params, batch, depth=1)
  assert jitted.node_names == plain.node_names
  assert jitted.leaf_paths == plain.leaf_paths  # Scanned rows split too.


def test_a_jitted_loss_trains_as_one_device():
  loss_fn, params, batch, _ = flax_models.CASES["mlp"]()
  tx = optax.sgd(0.1, momentum=0.9)
  pipe = jpipe.Pipeline(
    jax.jit(loss_fn),
    params,
    batch,
    num_stages=3,
    devices=jax.devices()[:3],
    num_microbatches=2,
    optimizer=tx,
  )
  _trains_like_one_device(pipe, loss_fn, params, batch, tx, steps=2)


def test_module_calls_no_cut_enters_are_named():
  loss_fn, params, batch, _ = flax_models.CASES["mlp"]()

  def in_a_cond(params, batch):
    return jax.lax.cond(
      jnp.all(jnp.isfinite(batch["x"])), loss_fn, loss_fn, params, batch
    )

  with pytest.raises(
    partition.TooFewNodes, match="one jax.lax.cond / switch holds \\(9 module"
  ):
    jpipe.Pipeline(
      in_a_cond,
      params,
      batch,
      num_stages=2,
      devices=jax.devices()[:2],
      optimizer=optax.sgd(0.1),
    )


def test_an_nnx_jit_forward_splits_like_the_plain_one():
  """``@nnx.jit`` on the forward an NNX loss calls: a jit spanning the
  model's modules, opened."""
  from flax import nnx

  class Net(nnx.Module):
    def __init__(self, rngs):
      self.layers = nnx.List([nnx.Linear(6, 6, rngs=rngs) for _ in range(3)])
      self.head = nnx.Linear(6, 3, rngs=rngs)

    def __call__(self, x):
      for layer in self.layers:
        x = nnx.relu(layer(x))
      return self.head(x)

  def names(forward):
    def loss(model, batch):
      return jnp.mean(forward(model, batch["x"]) ** 2)

    nl = jpipe.nnx_loss(Net(nnx.Rngs(0)), loss)
    return jpipe.Pipeline(
      nl.loss_fn,
      nl.params,
      _batch(),
      model_state=nl.model_state,
      num_stages=2,
      devices=jax.devices()[:2],
      optimizer=optax.sgd(0.1),
    ).traced.node_names

  plain = names(lambda model, x: model(x))
  assert plain == ("layers[0]", "layers[1]", "layers[2]", "head")
  assert names(nnx.jit(lambda model, x: model(x))) == plain


def test_a_reversed_layer_scan_is_named_as_reversed():
  """nn.scan(reverse=True) over two Dense layers, cut into 3 stages: the
  layer split runs forward scans only, and the message says so (it named
  a plain scan)."""

  class Layer(nn.Module):
    @nn.compact
    def __call__(self, h, _):
      return jnp.tanh(nn.Dense(4, name="inp")(h) + nn.Dense(4)(h)), None

  model = nn.scan(
    Layer,
    variable_axes={"params": 0},
    split_rngs={"params": True},
    length=2,
    reverse=True,
  )()
  x = jnp.ones((4, 4))
  params = model.init(jax.random.key(0), x, None)

  def loss_fn(params, batch):
    return model.apply(params, batch["x"], None)[0].sum()

  with pytest.raises(partition.TooFewNodes, match="reverse=True"):
    jpipe.Pipeline(
      loss_fn,
      params,
      {"x": x},
      num_stages=3,
      devices=jax.devices()[:3],
      optimizer=optax.sgd(0.1),
    )
