"""Models and callers written for SPMD: a ``jax.set_mesh`` around the
pipeline (``build/user_mesh.py``) and sharding constraints in the model
(``partition/_plain_types.py``) -- each trains as one device,
and the caller's mesh is theirs again after every call."""

import contextlib

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jpipe
from jpipe.partition._plain_types import plain_types
from tests.runtime.test_pipeline_sync import (
  _assert_tree_close,
  _reference_steps,
)
from tests.tiers import slow

RULES = (("batch", "data"), ("embed", None), ("mlp", None), ("layers", None))


def _mesh():
  return jax.make_mesh(
    (8,), ("data",), axis_types=(jax.sharding.AxisType.Auto,)
  )


class Block(nn.Module):
  """MaxText's shape: logical constraints on activations and params."""

  @nn.compact
  def __call__(self, x, _):
    x = nn.with_logical_constraint(x, ("batch", "embed"))
    kernel = nn.with_logical_partitioning(
      nn.initializers.lecun_normal(), ("embed", "mlp")
    )
    h = nn.Dense(16, kernel_init=kernel)(x)
    h = nn.with_logical_constraint(h, ("batch", "mlp"))
    return x + nn.Dense(8)(nn.relu(h)), None


class ScannedNet(nn.Module):
  """Remat-ed blocks scanned over layers."""

  @nn.compact
  def __call__(self, x):
    x = nn.Dense(8, name="embed")(x)
    blocks = nn.scan(
      nn.remat(Block),
      variable_axes={"params": 0},
      split_rngs={"params": True},
      length=4,
      metadata_params={nn.PARTITION_NAME: "layers"},
    )
    x, _ = blocks(name="blocks")(x, None)
    return nn.Dense(10, name="head")(x)


class PinnedNet(nn.Module):
  """Constraints over a mesh the model holds (no context needed)."""

  mesh: jax.sharding.Mesh

  @nn.compact
  def __call__(self, x):
    for i in range(4):
      x = nn.relu(nn.Dense(8, name=f"dense_{i}")(x))
      x = jax.lax.with_sharding_constraint(
        x, NamedSharding(self.mesh, P("data"))
      )
    return nn.Dense(10, name="head")(x)


def _case(model, context):
  x = jax.random.normal(jax.random.key(0), (16, 6))
  batch = {"x": x, "y": jnp.arange(16) % 10}
  with context():
    params = nn.meta.unbox(model.init(jax.random.key(1), x))

  def loss_fn(params, batch):
    logits = model.apply(params, batch["x"])
    return optax.softmax_cross_entropy_with_integer_labels(
      logits, batch["y"]
    ).mean()

  return loss_fn, params, batch


@pytest.mark.parametrize("model", [slow("scanned_logical"), "pinned"])
def test_a_pipeline_under_the_callers_mesh_trains_as_one_device(model):
  mesh = _mesh()

  @contextlib.contextmanager
  def context():
    with nn.logical_axis_rules(RULES), jax.set_mesh(mesh):
      yield

  net = ScannedNet() if model == "scanned_logical" else PinnedNet(mesh)
  loss_fn, params, batch = _case(net, context)
  tx = optax.sgd(0.1, momentum=0.9)
  with context():
    # The model's constraints over all 8 devices are in its trace.
    traced = jax.make_jaxpr(loss_fn)(params, batch)
    assert "sharding_constraint" in str(traced)
    pipe = jpipe.Pipeline(
      loss_fn,
      params,
      batch,
      num_stages=3,
      devices=jax.devices()[:3],
      num_microbatches=2,
      optimizer=tx,
    )
    state = pipe.init(params)
    for _ in range(2):
      state, _ = pipe.step(state, batch)
      assert jax.sharding.get_mesh() is mesh  # The caller's, back.
    got = pipe.gather_params(state)
  expected, _ = _reference_steps(loss_fn, params, batch, 2, tx, 2)
  _assert_tree_close(got, expected)


def test_constraints_are_dropped_in_every_body():
  """Top level, a scan's body, a remat's and both branches of a cond:
  none is left, and the function's values are the same."""
  sharding = NamedSharding(_mesh(), P())

  def f(x):
    x = jax.lax.with_sharding_constraint(x, sharding)

    def body(c, _):
      c = jax.checkpoint(
        lambda c: jax.lax.with_sharding_constraint(jnp.sin(c), sharding)
      )(c)
      return c, None

    x, _ = jax.lax.scan(body, x, None, length=3)
    return jax.lax.cond(
      x.sum() > 0,
      lambda x: jax.lax.with_sharding_constraint(x * 2, sharding),
      lambda x: x - 1,
      x,
    )

  x = jnp.arange(4.0)
  closed = jax.make_jaxpr(f)(x)
  assert str(closed).count("sharding_constraint") == 3
  dropped = plain_types(closed)
  assert "sharding_constraint" not in str(dropped)
  got = jax.core.eval_jaxpr(dropped.jaxpr, dropped.consts, x)[0]
  _assert_tree_close(got, f(x))
  assert plain_types(dropped) is dropped  # None: as it is.
