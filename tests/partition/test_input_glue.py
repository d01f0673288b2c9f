"""Glue computed from the inputs alone sits with its reader
(``partition/_input_glue.py``): float32 master params cast to bfloat16
at the loss's top (jmp's ``cast_to_compute``, T5X) put every cast -- so
every param, its gradient and optimizer state -- on the first stage,
which then sent each later stage its weights every microbatch. Now each
cast joins its layer, and the pipeline trains as one device."""

import flax.linen as nn
import jax
import jax.extend.core as jcore
import jax.numpy as jnp
import numpy as np
import optax

import jpipe
from jpipe import partition
from jpipe.partition._input_glue import sink_input_glue
from jpipe.partition._scopes import eqn_scope
from tests.runtime.test_pipeline_sync import _reference_steps

LAYERS = 6


class _Mlp(nn.Module):
  @nn.compact
  def __call__(self, x):
    for i in range(LAYERS):
      x = jnp.tanh(nn.Dense(32, dtype=jnp.bfloat16, name=f"d{i}")(x))
    return nn.Dense(10, dtype=jnp.bfloat16, name="out")(x)


def _case():
  model = _Mlp()
  x = jax.random.normal(jax.random.key(0), (16, 32))
  batch = {"x": x, "y": jnp.arange(16) % 10}
  params = model.init(jax.random.key(1), x)["params"]  # float32

  def loss_fn(p32, batch):
    p16 = jax.tree.map(lambda w: w.astype(jnp.bfloat16), p32)
    logits = model.apply({"params": p16}, batch["x"]).astype(jnp.float32)
    # Labels one-hot encoded from the batch alone, read by the loss.
    onehot = jax.nn.one_hot(batch["y"], 10)
    return optax.softmax_cross_entropy(logits, onehot).mean()

  return loss_fn, params, batch


def test_each_cast_joins_its_layers_node():
  loss_fn, params, batch = _case()
  traced = partition.trace(loss_fn, params, batch)
  names = traced.node_names
  assert names == tuple(f"d{i}" for i in range(LAYERS)) + ("out",)
  paths = traced.leaf_paths
  for name, leaves in zip(names, traced.node_param_leaves(), strict=True):
    assert {paths[i].split("'")[1] for i in leaves} == {name}, name
  # The one-hot labels (of the batch alone, after the model in program
  # order): with the loss on the last node, as before.
  eqns = traced.jaxpr.eqns
  one_hot = [
    i for i, e in enumerate(eqns) if e.params.get("name") == "_one_hot"
  ]
  assert one_hot and all(traced.eqn_node[i] == len(names) - 1 for i in one_hot)


def test_a_master_weights_pipeline_spreads_its_params_and_trains_as_one_device():
  loss_fn, params, batch = _case()
  tx = optax.adam(1e-3)
  pipe = jpipe.Pipeline(
    loss_fn,
    params,
    batch,
    num_stages=2,
    devices=jax.devices()[:2],
    schedule="1f1b",
    num_microbatches=4,
    optimizer=tx,
  )
  held = [m.params for m in pipe.memory]
  assert min(held) > 0.3 * sum(held)  # (Was: everything on stage 0.)
  state = pipe.init(params)
  for _ in range(3):
    state, _ = pipe.step(state, batch)
  reference, _ = _reference_steps(loss_fn, params, batch, 4, tx, steps=3)
  for a, b in zip(
    jax.tree.leaves(pipe.gather_params(state)),
    jax.tree.leaves(reference),
    strict=True,
  ):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-6)


def test_a_value_read_early_and_by_glue_that_moves_later_comes_first():
  """``s`` (of a param) is read first by glue (``max``) that moves down to
  the end, and by the layer before that: ``s`` goes before the layer (CI
  found it following its first reader past its second). Glue of the
  batch alone (``v * 2``) stays where it was."""

  def f(w, v):
    s = jnp.squeeze(w, 1)
    m = jnp.max(s)
    u = v * 2.0
    with jax.named_scope("layer"):
      h = u * jnp.sum(s)
    return jnp.sum(h) + m

  w, v = jnp.arange(4.0).reshape(4, 1), jnp.ones(3)
  closed = jax.make_jaxpr(f)(w, v)
  scopes = [eqn_scope(e) for e in closed.jaxpr.eqns]
  moved, order = sink_input_glue(closed, scopes, [False] * len(scopes), 1)
  assert sorted(order) == list(range(len(scopes))) and order != sorted(order)
  names = [e.primitive.name for e in moved.jaxpr.eqns]
  assert names.index("mul") < names.index("squeeze")  # (v * 2 stayed.)
  defined = set(moved.jaxpr.invars)
  for eqn in moved.jaxpr.eqns:
    assert all(
      not isinstance(v, jcore.Var) or v in defined for v in eqn.invars
    ), eqn
    defined.update(eqn.outvars)
  (got,) = jax.core.eval_jaxpr(moved.jaxpr, moved.consts, w, v)
  np.testing.assert_allclose(got, f(w, v))
