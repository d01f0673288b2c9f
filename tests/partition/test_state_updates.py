"""Model state is updated in microbatch order, whichever stage computes the
new value, or refused at construction."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jpipe
from jpipe import partition
from tests import jitted
from tests.partition import flax_models
from tests.tiers import slow


def _sequential(loss_fn, params, stats, batch, m):
  """One device, microbatch after microbatch: (stats, mean grads, losses)."""
  size = jax.tree.leaves(batch)[0].shape[0] // m
  grads, losses = None, []
  for k in range(m):
    mb = jax.tree.map(lambda x, k=k: x[k * size : (k + 1) * size], batch)
    (loss, stats), g = jitted.value_and_grad(loss_fn, has_aux=True)(
      params, stats, mb
    )
    losses.append(float(loss))
    grads = g if grads is None else jax.tree.map(jnp.add, grads, g)
  return stats, jax.tree.map(lambda g: g / m, grads), losses


def _assert_tree_close(a, b):
  for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
    np.testing.assert_allclose(x, y, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize(
  ("num_stages", "schedule"),
  [(2, "gpipe"), slow(4, "1f1b"), slow(8, "1f1b")],
)
def test_vmapped_batchnorm_statistics_match_one_device(num_stages, schedule):
  """The statistics come out of the last stage (``[0]`` of a batched
  value); the stages that read them must still see every microbatch's
  update before the next one -- the failure lost microbatches 1 and 2."""
  loss_fn, params, stats, batch = flax_models.vmapped_batchnorm_case(4, 16)
  m, lr = 4, 0.1
  pipe = jpipe.Pipeline(
    loss_fn,
    params,
    batch,
    num_stages=num_stages,
    devices=jax.devices()[:num_stages],
    schedule=schedule,
    num_microbatches=m,
    optimizer=optax.sgd(lr),
    model_state=stats,
  )
  assert pipe.plan.num_stages == num_stages
  # The new statistics are computed where the old ones are read.
  for j in range(len(jax.tree.leaves(stats))):
    readers = [
      s
      for s, spec in enumerate(pipe.stages.specs)
      if pipe.num_batch_leaves + j in spec.batch_leaves
    ]
    (writer,) = [
      s for s, spec in enumerate(pipe.stages.specs) if j + 1 in spec.results
    ]
    assert readers == [writer]
  state = pipe.init(params, stats)
  for _ in range(2):  # The second step reads the first's statistics.
    state, metrics = pipe.step(state, batch)
    stats, grads, losses = _sequential(loss_fn, params, stats, batch, m)
    params = jax.tree.map(lambda p, g: p - lr * g, params, grads)
    assert float(metrics["loss"]) == pytest.approx(np.mean(losses), rel=1e-5)
  _assert_tree_close(pipe.gather_model_state(state), stats)
  _assert_tree_close(pipe.gather_params(state), params)


def _named(name, fn):
  with jax.named_scope(name):
    return fn()


def _two_layer_case(update):
  """Layers ``a`` then ``b`` over a model-state ``count``; ``update`` says
  what the loss returns as the new count. (loss_fn, params, inputs)."""
  params = {"a": jnp.ones((3,)), "b": jnp.ones((3,))}
  inputs = {"batch": jnp.arange(3.0), "state": {"count": jnp.zeros(())}}

  def loss_fn(params, inputs):
    x, count = inputs["batch"], inputs["state"]["count"]
    h = _named("a", lambda: jnp.tanh(x * params["a"] + count))
    y = _named("b", lambda: jnp.tanh(h * params["b"]))
    new, loss = update(count, h, y)
    return loss, {"count": new}

  return loss_fn, params, inputs


def _stages(case):
  loss_fn, params, inputs = case
  traced = partition.trace(loss_fn, params, inputs, has_aux=True)
  assert traced.node_names == ("a", "b")
  return partition.Stages(traced, [0, 1], carried=[(1, 1)])


def test_update_computed_on_a_later_stage_moves_to_the_reader():
  # count + mean(y): y is b's, so that cannot move; count + mean(h) can.
  stages = _stages(
    _two_layer_case(lambda c, h, y: (0.9 * c + h.mean(), y.sum()))
  )
  assert stages.specs[0].results == (1,)  # The new count, from stage 0.
  assert stages.specs[1].results == (0,)
  # Every equation of the new value's computation runs on stage 0.
  assert stages.eqn_stage.count(0) > stages.traced.eqn_node.count(0)


def test_update_the_loss_needs_on_another_stage_is_refused():
  # A fresh value each microbatch, from stage 1, that the loss uses.
  with pytest.raises(ValueError, match=r"\['count'\] is read on stage 0 b"):
    _stages(_two_layer_case(lambda c, h, y: ((new := y.mean()), y.sum() * new)))


def test_update_from_a_later_stage_value_is_refused():
  with pytest.raises(ValueError, match="computed on stage 1 from values of"):
    _stages(_two_layer_case(lambda c, h, y: (c + y.mean(), y.sum())))


def test_state_read_on_two_stages_is_refused():
  loss_fn, params, inputs = _two_layer_case(None)

  def read_twice(params, inputs):
    x, count = inputs["batch"], inputs["state"]["count"]
    h = _named("a", lambda: jnp.tanh(x * params["a"] + count))
    y = _named("b", lambda: jnp.tanh(h * params["b"] * count))
    return y.sum(), {"count": count + 1}

  with pytest.raises(ValueError, match="read on stages 0 and 1"):
    _stages((read_twice, params, inputs))
  # One stage reading it is exact: nothing to move, nothing refused.
  traced = partition.trace(read_twice, params, inputs, has_aux=True)
  partition.Stages(traced, [0, 0], carried=[(1, 1)])
