"""Models that call ``jax.shard_map`` (per-shard kernels with collectives:
an expert-parallel MoE's ``all_to_all``, a ring's ``ppermute`` and
``psum``) train through the pipeline as one device: each stage runs the
body vmapped over the mesh axes it maps
(``partition/_shard_map_emulation.py``)."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import PartitionSpec as P

import jpipe
from tests.runtime.test_explicit_mesh import _batch, _mesh, _reference
from tests.runtime.test_pipeline_sync import _assert_tree_close

EXPERTS, WIDTH = 4, 8


def _ring_layer(h, w):
  """A row-parallel matmul passed around a ring over "model" (activations
  [rows/data, cols/model], w [cols/model, 8]), reduced over it."""

  def step(c, _):
    c = jax.lax.ppermute(c, "model", [(j, (j + 1) % 4) for j in range(4)])
    i = jax.lax.axis_index("model").astype(jnp.float32)
    return c, jax.lax.psum((c @ w) * (1.0 + 0.1 * i), "model")

  _, ys = jax.lax.scan(step, h, None, length=3)
  return ys.sum(0)


def _ring_case():
  keys = jax.random.split(jax.random.key(1), 4)
  params = {
    f"l{i}": {"w": jax.random.normal(k, (8, 8)) * 0.3, "b": jnp.zeros(8)}
    for i, k in enumerate(keys)
  }
  ring = jax.shard_map(  # (The mesh from context: the caller's.)
    _ring_layer,
    in_specs=(P("data", "model"), P("model", None)),
    out_specs=P("data", None),
  )

  def loss_fn(params, batch):
    h = batch["x"]
    for i in range(4):
      with jax.named_scope(f"l{i}"):
        p = params[f"l{i}"]
        h = jax.sharding.reshard(h, P("data", "model"))
        h = ring(h, jax.sharding.reshard(p["w"], P("model", None)))
        h = jnp.tanh(h + p["b"][None])
    return optax.softmax_cross_entropy_with_integer_labels(h, batch["y"]).mean()

  return loss_fn, params


def _experts(x, w):
  """Expert parallel, one expert per device: ``x`` [experts, slots,
  width] this device's tokens dispatched to every expert, ``w`` [1,
  width, width] its own expert's weights."""
  x = jax.lax.all_to_all(x, "expert", 0, 0, tiled=True)  # Theirs, to it.
  y = jnp.einsum("scd,de->sce", x, w[0])
  return jax.lax.all_to_all(y, "expert", 0, 0, tiled=True)  # Back.


class MoE(nn.Module):
  """Top-1 routing; the experts run on ``mesh`` (a concrete one, passed
  to shard_map as older code does)."""

  mesh: jax.sharding.Mesh

  @nn.compact
  def __call__(self, x):  # [tokens, width]
    gate = nn.Dense(EXPERTS, name="gate")(x)
    choice = jax.nn.one_hot(jnp.argmax(gate, -1), EXPERTS)
    weight = (jax.nn.softmax(gate) * choice).sum(-1, keepdims=True)
    slots = jnp.einsum("te,td->etd", choice, x)  # [experts, tokens, width]
    w = self.param(
      "experts", nn.initializers.lecun_normal(), (EXPERTS, WIDTH, WIDTH)
    )
    run = jax.shard_map(
      _experts,
      mesh=self.mesh,
      in_specs=(P(None, "expert"), P("expert")),
      out_specs=P(None, "expert"),
    )
    return x + weight * jnp.einsum("etd,te->td", run(slots, w), choice)


class MoENet(nn.Module):
  mesh: jax.sharding.Mesh

  @nn.compact
  def __call__(self, x):
    for i in range(3):
      x = MoE(self.mesh, name=f"moe_{i}")(nn.LayerNorm(name=f"ln_{i}")(x))
    return nn.Dense(EXPERTS, name="head")(x)


def _train(loss_fn, params, batch, tx, **kwargs):
  pipe = jpipe.Pipeline(loss_fn, params, batch, optimizer=tx, **kwargs)
  state = pipe.init(params)
  for _ in range(2):
    state, _ = pipe.step(state, batch)
  return pipe, state


def test_a_ring_under_the_callers_explicit_mesh_trains_as_one_device():
  """ppermute and psum in a scan in the body; the mesh from context
  (Explicit, 2 x 4); 1F1B on 2 stages."""
  tx = optax.adam(1e-2)
  with jax.set_mesh(_mesh("explicit")):
    batch = _batch()
    loss_fn, params = _ring_case()
    pipe, state = _train(
      loss_fn,
      params,
      batch,
      tx,
      num_stages=2,
      devices=jax.devices()[:2],
      num_microbatches=2,
    )
    got = pipe.gather_params(state)
    evaluated = pipe.evaluate(state, batch)["loss"]
    expected = _reference(loss_fn, params, [[batch]] * 2, tx)
    after = loss_fn(expected, batch)
  _assert_tree_close(got, expected)
  np.testing.assert_allclose(evaluated, after, rtol=1e-5)


def test_an_expert_parallel_moe_on_its_own_mesh_trains_as_one_device():
  """all_to_all to the experts and back, on a 4-device mesh the module
  holds (no mesh set); GPipe on 3 stages of other devices."""
  mesh = jax.sharding.Mesh(np.array(jax.devices()[4:]), ("expert",))
  model = MoENet(mesh)
  batch = {
    "x": jax.random.normal(jax.random.key(0), (16, WIDTH)),
    "y": jnp.arange(16) % EXPERTS,
  }
  params = model.init(jax.random.key(1), batch["x"])

  def loss_fn(params, batch):
    logits = model.apply(params, batch["x"])
    return optax.softmax_cross_entropy_with_integer_labels(
      logits, batch["y"]
    ).mean()

  tx = optax.adam(1e-2)
  pipe, state = _train(
    loss_fn,
    params,
    batch,
    tx,
    num_stages=3,
    devices=jax.devices()[:3],
    num_microbatches=4,
    schedule="gpipe",
  )
  assert pipe.plan.stage_of_node == (0, 0, 1, 1, 2, 2, 2)  # (A MoE each.)
  # The reference: the whole batch's steps on the mesh (4 microbatches'
  # mean gradient is the batch's: the loss is a mean over rows).
  _assert_tree_close(
    pipe.gather_params(state), _reference(loss_fn, params, [[batch]] * 2, tx)
  )


def test_uneven_microbatches_with_a_shard_map_are_named():
  """One-row microbatches do not divide over "data" (2): traced on the
  axes at size 1, where a shard_map's collectives cannot trace."""
  with jax.set_mesh(_mesh("explicit")):
    batch = _batch()
    loss_fn, params = _ring_case()
    with pytest.raises(ValueError, match="shard_map's collectives"):
      jpipe.Pipeline(
        loss_fn,
        params,
        batch,
        num_stages=2,
        num_microbatches=16,
        optimizer=optax.sgd(0.1),
      )
