"""Code written for an ``Explicit`` mesh (``jax.make_mesh``'s default):
arrays whose types carry their shardings, ``out_sharding=``, ``reshard``
and constraints that assert their input's type -- and bare
``PartitionSpec`` constraints under any mesh. Each trains through the
pipeline as one device (``partition/_caller_axes.py``,
``partition/_plain_types.py``, ``runtime/build/user_mesh.py``)."""

import flax.linen as nn
import jax
import jax.extend.core as jcore
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import jpipe
from jpipe import dynamic, parallel, partition
from jpipe.partition._plain_types import plain_types
from jpipe.runtime.build import user_mesh
from tests import jitted
from tests.runtime.test_generate import (
  _generate,
  _greedy_recomputing,
  _pipeline,
  _tiny,
)
from tests.runtime.test_pipeline_sync import _assert_tree_close


def _mesh(kind):
  types = (AxisType.Explicit if kind == "explicit" else AxisType.Auto,) * 2
  return jax.make_mesh((2, 4), ("data", "model"), axis_types=types)


def _batch(seed=0, explicit=True):
  x = jax.random.normal(jax.random.key(seed), (16, 8))
  y = jnp.arange(16) % 8
  if explicit:  # (Sharded over "data", typed so.)
    x, y = jax.device_put(x, P("data")), jax.device_put(y, P("data"))
  return {"x": x, "y": y}


class ConstrainedNet(nn.Module):
  """Activations constrained with bare specs (the mesh from context)."""

  @nn.compact
  def __call__(self, x):
    for i in range(4):
      x = nn.relu(nn.Dense(8, name=f"dense_{i}")(x))
      x = jax.lax.with_sharding_constraint(x, P("data", None))
    return x


def _linen_case(mesh, batch):
  model = ConstrainedNet()
  params = jax.jit(model.init)(jax.random.key(1), batch["x"])

  def loss_fn(params, batch):
    logits = model.apply(params, batch["x"])
    return optax.softmax_cross_entropy_with_integer_labels(
      logits, batch["y"]
    ).mean()

  return loss_fn, params


def _jnp_case(mesh, batch):
  """Plain JAX: ``out_sharding``, ``reshard``, a custom_jvp (gelu) and a
  constant it closes over, made under the mesh (typed on it)."""
  scale = jnp.linspace(0.5, 1.5, 8)[None]
  keys = jax.random.split(jax.random.key(1), 4)
  params = {
    f"l{i}": {"w": jax.random.normal(k, (8, 8)) * 0.3, "b": jnp.zeros(8)}
    for i, k in enumerate(keys)
  }

  def loss_fn(params, batch):
    h = batch["x"]
    for i in range(4):
      with jax.named_scope(f"l{i}"):
        p = params[f"l{i}"]
        h = jnp.dot(h, p["w"], out_sharding=P("data", None)) + p["b"][None]
        h = jax.sharding.reshard(jax.nn.gelu(h) * scale, P("data", None))
    return optax.softmax_cross_entropy_with_integer_labels(h, batch["y"]).mean()

  return loss_fn, params


class TensorParallelMLP(nnx.Module):
  """NNX, Megatron-style: kernels sharded over "model" by column then
  row, activations typed with ``out_sharding``."""

  def __init__(self, rngs):
    init = nnx.initializers.lecun_normal()
    self.layers = nnx.List(
      [
        nnx.Linear(
          8 if i % 2 == 0 else 16,
          16 if i % 2 == 0 else 8,
          kernel_init=nnx.with_partitioning(
            init, (None, "model") if i % 2 == 0 else ("model", None)
          ),
          rngs=rngs,
        )
        for i in range(4)
      ]
    )

  def __call__(self, x):
    for i, layer in enumerate(self.layers):
      spec = P("data", "model") if i % 2 == 0 else P("data", None)
      x = nnx.relu(layer(x, out_sharding=spec))
    return x


def _nnx_case(mesh, batch):
  graphdef, params = nnx.split(TensorParallelMLP(nnx.Rngs(0)), nnx.Param)

  def loss_fn(params, batch):
    logits = nnx.merge(graphdef, params)(batch["x"])
    return optax.softmax_cross_entropy_with_integer_labels(
      logits, batch["y"]
    ).mean()

  return loss_fn, params


def _reference(loss_fn, params, batches, tx):
  """One device's steps under the caller's mesh: the mean gradient of
  ``batches`` per step (so one batch: the whole batch's)."""
  state = tx.init(params)
  grad = jax.jit(jax.grad(loss_fn))
  for group in batches:
    grads = [grad(params, b) for b in group]
    g = jax.tree.map(lambda *g: sum(g) / len(g), *grads)
    updates, state = tx.update(g, state, params)
    params = optax.apply_updates(params, updates)
  return jax.tree.map(np.asarray, params)


CASES = {"linen": _linen_case, "jnp": _jnp_case, "nnx": _nnx_case}


@pytest.mark.parametrize(
  "case, kind, microbatches",
  [
    ("linen", "auto", 2),  # Bare-spec constraints: no mesh typing.
    ("linen", "explicit", 2),  # The constraints assert the batch's type.
    # Microbatches of 1 row: not divisible over "data" (2 devices).
    ("linen", "explicit", 16),
    ("jnp", "explicit", 2),
    ("nnx", "explicit", 2),
  ],
)
def test_a_model_written_for_the_mesh_trains_as_one_device(
  case, kind, microbatches
):
  mesh = _mesh(kind)
  tx = optax.adam(1e-2)
  with jax.set_mesh(mesh):
    batch = _batch(explicit=kind == "explicit")
    loss_fn, params = CASES[case](mesh, batch)
    pipe = jpipe.Pipeline(
      loss_fn,
      params,
      batch,
      num_stages=2,
      devices=jax.devices()[:2],
      num_microbatches=microbatches,
      optimizer=tx,
    )
    state = pipe.init(params)
    for _ in range(2):
      state, _ = pipe.step(state, batch)
    got = pipe.gather_params(state)
    evaluated = pipe.evaluate(state, batch)["loss"]
    expected = _reference(loss_fn, params, [[batch]] * 2, tx)
    after = loss_fn(expected, batch)
    # The caller's arrays are as they were, and so is their mesh.
    assert jax.sharding.get_mesh() is mesh
    if kind == "explicit":
      assert jax.typeof(batch["x"]).sharding.spec == P("data", None)
  _assert_tree_close(got, expected)
  np.testing.assert_allclose(evaluated, after, rtol=1e-5)


def test_a_closed_over_typed_array_with_uneven_microbatches_is_named():
  """Rows that do not divide over "data" trace on its axes at size 1,
  where an array typed on the whole mesh cannot be used: one error naming
  both and the fixes."""
  with jax.set_mesh(_mesh("explicit")):
    batch = _batch()
    loss_fn, params = _jnp_case(None, batch)
    with pytest.raises(ValueError, match="closes over an array typed"):
      jpipe.Pipeline(
        loss_fn,
        params,
        batch,
        num_stages=2,
        num_microbatches=16,
        optimizer=optax.sgd(0.1),
      )


def test_data_parallel_pipelines_of_arrays_typed_on_the_mesh():
  """A builder holding the caller's typed arrays: each pipeline's copy
  comes in plain, and allreduce steps equal one device's on both
  batches' mean gradient."""
  tx = optax.sgd(0.1)
  with jax.set_mesh(_mesh("explicit")):
    batches = [_batch(1), _batch(2)]
    loss_fn, params = _jnp_case(None, batches[0])
    dp = parallel.DataParallelPipelines(
      jpipe.PipelineBuilder.of(
        loss_fn, params, batches[0], num_stages=2, num_microbatches=2
      ).with_options(optimizer=tx),
      pipelines=2,
      sync="allreduce",
      devices=jax.devices()[:4],
    )
    states = dp.init(params)
    states, _ = dp.step(states, batches)
    states, _ = dp.flush(states)
    expected = _reference(loss_fn, params, [batches], tx)
  for pipe, state in zip(dp.pipelines, states, strict=True):
    _assert_tree_close(pipe.gather_params(state), expected)


def test_a_calls_mesh_check_reads_the_batch_not_the_state():
  """``user_mesh._plain`` (each public call's look for the caller's
  arrays) passes a ``PipelineState`` through whole -- its leaves are the
  pipeline's own, and looking into a state's hundreds of leaves cost ~300
  us a call -- and still makes the batch's typed arrays plain.
  ``typed_on_mesh`` is the type's own definition on arrays of every
  kind."""
  mesh = _mesh("explicit")
  with jax.set_mesh(mesh):
    batch = _batch()
    loss_fn, params = _jnp_case(None, batch)
    pipe = jpipe.Pipeline(
      loss_fn,
      params,
      batch,
      num_stages=2,
      devices=jax.devices()[:2],
      num_microbatches=2,
      optimizer=optax.sgd(0.1),
    )
    state = pipe.init(params)
    (got_state, got_batch), _ = user_mesh._plain(((state, batch), {}), mesh)
    auto = jax.device_put(batch["x"], NamedSharding(_mesh("auto"), P()))
  assert got_state is state
  for name in batch:
    assert partition.typed_on_mesh(batch[name])
    assert not partition.typed_on_mesh(got_batch[name])
    np.testing.assert_array_equal(got_batch[name], batch[name])
  for x in [*jax.tree.leaves(state), *batch.values(), auto, np.ones(3)]:
    expected = isinstance(x, jax.Array) and (
      AxisType.Explicit in jax.typeof(x).sharding.mesh.axis_types
    )
    assert partition.typed_on_mesh(x) == expected


def _typed_avals(jaxpr):
  """Every aval in ``jaxpr`` typed on a mesh (bodies included)."""
  found = [
    v.aval
    for v in (*jaxpr.invars, *(o for e in jaxpr.eqns for o in e.outvars))
    if not v.aval.sharding.mesh.empty
  ]
  for e in jaxpr.eqns:
    for j in jcore.jaxprs_in_params(e.params):
      found += _typed_avals(j)
  return found


def test_plain_types_is_the_same_function_on_plain_arrays():
  """Against the function itself: values and gradients (through a
  custom_jvp and a scan) equal; no typed value left; an untyped jaxpr is
  returned as it is."""
  one = jax.sharding.Mesh(
    np.array(jax.devices()[:1]).reshape(1, 1),
    ("data", "model"),
    axis_types=(AxisType.Explicit,) * 2,
  )

  def f(w, x):
    h = jnp.dot(x, w, out_sharding=P("data", None))
    h = jax.sharding.reshard(jax.nn.relu(h), P("data", None))

    def body(c, _):
      return jnp.tanh(c) + jnp.zeros(
        c.shape, out_sharding=P("data", None)
      ), None

    h, _ = jax.lax.scan(body, h, None, length=2)
    return (h * jnp.arange(8.0)[None]).sum()

  w = jax.random.normal(jax.random.key(0), (8, 8))
  x = jax.random.normal(jax.random.key(1), (16, 8))
  typed = [
    jax.ShapeDtypeStruct(
      w.shape, w.dtype, sharding=jax.NamedSharding(one, P())
    ),
    jax.ShapeDtypeStruct(
      x.shape, x.dtype, sharding=jax.NamedSharding(one, P("data"))
    ),
  ]
  with jax.sharding.use_abstract_mesh(one.abstract_mesh):
    closed = jax.make_jaxpr(f)(*typed)
  assert _typed_avals(closed.jaxpr)
  plain = plain_types(closed)
  assert not _typed_avals(plain.jaxpr)
  assert "reshard" not in str(plain)

  def run(w, x):
    return jax.core.eval_jaxpr(plain.jaxpr, plain.consts, w, x)[0]

  with jax.set_mesh(one):
    want, want_grads = jitted.value_and_grad(f, argnums=(0, 1))(w, x)
  got, grads = jax.jit(jax.value_and_grad(run, argnums=(0, 1)))(w, x)
  _assert_tree_close((got, grads), (want, want_grads))
  untyped = jax.make_jaxpr(jnp.sin)(x)
  assert plain_types(untyped) is untyped


def test_generate_under_an_explicit_mesh_equals_recomputing_greedy():
  """Params and prompts typed on the mesh (replicated: linen's Embed
  cannot gather with "data"-sharded indices under an Explicit mesh, on
  one device alike); the decoding functions traced on the mesh with
  their unrecorded inputs (cache, tokens) replicated, as in the caller's
  own jit."""
  model, params, prompts = _tiny()
  want = _greedy_recomputing(model, params, prompts, 3)
  with jax.set_mesh(_mesh("explicit")):
    params, prompts = jax.device_put((params, prompts), P())
    pipe, state = _pipeline(model, params, prompts, 2)
    got = _generate(pipe, state, model, prompts, 3)
  np.testing.assert_array_equal(got, want)


def test_a_dynamic_pipelines_next_plan_traces_the_callers_types():
  """DynamicPipeline converts its builder's typed arrays once; a plan it
  moves to later (another call) traces them as the caller typed them --
  the model's constraints assert the batch's "data" sharding -- and the
  run equals one device's."""
  tx = optax.sgd(0.1)
  with jax.set_mesh(_mesh("explicit")):
    batch = _batch()
    loss_fn, params = _linen_case(None, batch)
    dp = dynamic.DynamicPipeline(
      jpipe.PipelineBuilder.of(
        loss_fn,
        params,
        batch,
        num_stages=2,
        devices=jax.devices()[:2],
        num_microbatches=2,
        optimizer=tx,
      )
    )
    first = dp.pipeline
    bounds = dynamic.boundaries_of(first.plan.stage_of_node)
    costs = partition.profile_nodes(
      first.traced,
      jax.tree.map(np.asarray, params),
      jax.tree.map(lambda x: np.asarray(x)[:8], batch),
      method="analytic",
    )
    moved = partition.plan_from_boundaries(
      first.traced, costs, (0, bounds[1] + 1, bounds[-1])
    )
    state = dp.init(params)
    state, _ = dp.step(state, batch)
    state = dp.switch.switch(state, moved)
    assert dp.pipeline is not first
    state, _ = dp.step(state, batch)
    got = dp.pipeline.gather_params(state)
    expected = _reference(loss_fn, params, [[batch]] * 2, tx)
  _assert_tree_close(got, expected)
