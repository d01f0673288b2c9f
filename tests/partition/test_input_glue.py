"""Glue computed from the inputs alone sits with its reader
(``partition/_input_glue.py``): float32 master params cast to bfloat16
at the loss's top (jmp's ``cast_to_compute``, T5X) put every cast -- so
every param, its gradient and optimizer state -- on the first stage,
which then sent each later stage its weights every microbatch. Now each
cast joins its layer, and the pipeline trains as one device."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax

import jpipe
from jpipe import partition
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
  # The one-hot labels: made where the loss reads them (the last node),
  # not on the first and sent along.
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
