"""Replicated stages (a stage on several devices, data parallel inside the
pipeline): the same math as the unreplicated pipeline, on every replica."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jpipe
from jpipe import partition
from jpipe.runtime.build.batches import place_microbatches
from jpipe.runtime.build.placement import device_name
from tests import jitted
from tests.partition import flax_models
from tests.runtime import test_pipeline_async as async_tests
from tests.runtime.test_pipeline_sync import (
  _assert_tree_close,
  _reference_steps,
)
from tests.tiers import slow

# Stage 0 on devices 0-1, stage 1 on 2, stage 2 on 3-4; and a mixed pipe
# whose replica group 0-1 holds stages 0 and 2.
LAYOUTS = {
  "disjoint": ((0, 1), (2,), (3, 4)),
  "mixed": ((0, 1), (2,), (0, 1)),
}


def _replicated(layout, loss_fn, params, batch, **kwargs):
  """A 3-stage Pipeline whose plan puts its stages on ``layout``."""
  devices = jax.devices()[:6]
  plain = jpipe.Pipeline(
    loss_fn, params, batch, num_stages=3, devices=devices, **kwargs
  )
  plan = dataclasses.replace(plain.plan, stage_devices=layout)
  return jpipe.Pipeline(
    loss_fn,
    params,
    batch,
    num_stages=3,
    devices=devices,
    partition=plan,
    **kwargs,
  )


def _trains_like_one_device(pipe, loss_fn, params, batch, tx, steps=1):
  """Runs ``steps`` pipeline steps; checks the params and the last loss
  against single-device accumulation; returns the state."""
  state = pipe.init(params)
  for _ in range(steps):
    state, metrics = pipe.step(state, batch)
  m = pipe.num_microbatches
  expected, loss = _reference_steps(loss_fn, params, batch, m, tx, steps)
  _assert_tree_close(pipe.gather_params(state), expected)
  assert float(metrics["loss"]) == pytest.approx(loss, rel=1e-5)
  return state


@pytest.mark.parametrize("layout", LAYOUTS, ids=str)
@pytest.mark.parametrize(
  "case, schedule",
  [
    ("mlp", "gpipe"),
    slow("gpt_tied", "1f1b"),
    slow("encoder_decoder", "gpipe"),
  ],
)
def test_two_steps_equal_single_device(case, schedule, layout):
  loss_fn, params, batch, _ = flax_models.CASES[case]()
  tx = optax.sgd(0.1, momentum=0.9)
  pipe = _replicated(
    LAYOUTS[layout],
    loss_fn,
    params,
    batch,
    schedule=schedule,
    num_microbatches=2,
    optimizer=tx,
  )
  state = _trains_like_one_device(pipe, loss_fn, params, batch, tx, 2)
  # Every replica holds the stage's params and optimizer state.
  devices = jax.devices()
  for s, group in enumerate(LAYOUTS[layout]):
    want = {devices[i] for i in group}
    for x in jax.tree.leaves((state.stage_params[s], state.opt_states[s])):
      assert x.sharding.device_set == want
      assert x.sharding.is_fully_replicated


def test_a_replica_group_splits_each_microbatch():
  loss_fn, params, batch, _ = flax_models.mlp_case()
  pipe = _replicated(
    LAYOUTS["disjoint"],
    loss_fn,
    params,
    batch,
    num_microbatches=2,
    optimizer=optax.sgd(0.1),
  )
  place = pipe.placement[0]
  micro = place_microbatches(jax.tree.leaves(batch), pipe.batch_leaves, 2, 0)[
    place
  ]
  x = micro[0][jax.tree.leaves(batch).index(batch["x"])]
  assert x.shape == (4, 12)
  shards = sorted(
    (shard.device.id, shard.index[0].start) for shard in x.addressable_shards
  )
  assert shards == [(0, 0), (1, 2)]  # Two examples on each replica.
  np.testing.assert_array_equal(x, batch["x"][:4])
  assert len(pipe.device_names) == 3  # One per device group.
  assert pipe.device_names == ("devices 0-1", "device 2", "devices 3-4")


@pytest.mark.slow
def test_batchnorm_statistics_are_the_whole_microbatch_s():
  """BatchNorm on a replica group normalises over the whole microbatch
  (XLA reduces across the replicas), as one device would."""
  loss_fn, params, stats, batch = flax_models.resnet_state_case(3, 8)
  m, tx = 2, optax.sgd(0.1)
  pipe = _replicated(
    ((0, 1), (2, 3), (4, 5)),
    loss_fn,
    params,
    batch,
    schedule="1f1b",
    num_microbatches=m,
    optimizer=tx,
    model_state=stats,
  )
  state = pipe.init(params, stats)
  state, _ = pipe.step(state, batch)
  grads, ref_stats = None, stats
  for k in range(m):
    mb = jax.tree.map(lambda x, k=k: x[4 * k : 4 * k + 4], batch)
    (_, ref_stats), g = jitted.value_and_grad(loss_fn, has_aux=True)(
      params, ref_stats, mb
    )
    grads = g if grads is None else jax.tree.map(jnp.add, grads, g)
  grads = jax.tree.map(lambda g: g / m, grads)
  updates, _ = tx.update(grads, tx.init(params), params)
  _assert_tree_close(
    pipe.gather_params(state), optax.apply_updates(params, updates)
  )
  _assert_tree_close(pipe.gather_model_state(state), ref_stats)


@pytest.mark.slow
def test_profiled_timeline_names_the_device_groups():
  """(Replicated stages against the references: test_matrix.py.)"""
  loss_fn, params, batch = async_tests._mlp()
  pipe = _replicated(
    LAYOUTS["disjoint"],
    loss_fn,
    params,
    batch,
    schedule="async",
    num_microbatches=async_tests.NUM_MICRO,
    optimizer=async_tests.SGD,
    weight_stashing=True,
  )
  state = pipe.init(params)
  _, metrics = pipe.step(state, batch, profile=True)
  assert set(metrics["timeline"].device_of.values()) == {0, 1, 2}


def test_bad_device_groups_are_clear_errors():
  loss_fn, params, batch, _ = flax_models.mlp_case()
  kwargs = {"optimizer": optax.sgd(0.1)}
  with pytest.raises(ValueError, match="overlap"):
    _replicated(
      ((0, 1), (1, 2), (3,)),
      loss_fn,
      params,
      batch,
      num_microbatches=2,
      **kwargs,
    )
  with pytest.raises(ValueError, match="microbatch has 1 examples"):
    _replicated(
      ((0, 1), (2,), (3,)),
      loss_fn,
      params,
      batch,
      num_microbatches=8,
      **kwargs,
    )


def _mlp_costs(loss_fn, params, batch):
  """The MLP traced, with a first layer far dearer than the rest (so
  PipeDream's DP replicates it when the all-reduce is cheap enough)."""
  traced = partition.trace(loss_fn, params, batch)
  costs = partition.profile_nodes(traced, params, batch, method="analytic")
  seconds = np.full(traced.num_nodes, 0.01)
  seconds[0] = 1.0
  costs = dataclasses.replace(
    costs, forward_seconds=seconds, backward_seconds=2 * seconds
  )
  return traced, costs


def test_pipedream_hybrid_plan_replicates_and_trains_like_one_device():
  loss_fn, params, batch, _ = flax_models.mlp_case()
  traced, costs = _mlp_costs(loss_fn, params, batch)
  # Slow links: replicating the heavy first layer pays, the rest does not.
  hybrid = partition.plan_traced(
    traced, costs, 3, method="pipedream_hybrid", bandwidth=1e4
  )
  straight = partition.plan_traced(
    traced, costs, 3, method="pipedream", bandwidth=1e4
  )
  assert hybrid.stage_devices == ((0, 1), (2,))
  assert hybrid.stage_of_node == (0, 1, 1, 1, 1, 1, 1, 1)
  assert hybrid.bottleneck_seconds < straight.bottleneck_seconds
  # The runtime's steady-state delay n - 1 - s (replicas split each
  # microbatch): 1, 0.
  assert hybrid.stage_stash_bytes == (hybrid.stage_param_bytes[0], 0.0)
  # Fast links: one stage, data parallel over every device.
  dp = partition.plan_traced(traced, costs, 3, method="pipedream_hybrid")
  assert dp.stage_devices == ((0, 1, 2),)
  tx = optax.sgd(0.1)
  pipe = jpipe.Pipeline(
    loss_fn,
    params,
    batch,
    num_stages=2,
    devices=jax.devices()[:3],
    schedule="1f1b",
    num_microbatches=2,
    optimizer=tx,
    partition=hybrid,
  )
  _trains_like_one_device(pipe, loss_fn, params, batch, tx)


def test_pipeline_takes_pipedream_hybrid_by_name():
  """partition="pipedream_hybrid" plans with the DP on the pipeline's own
  costs (on a tiny MLP's analytic costs the all-reduce outweighs the
  compute, so it does not replicate) and trains like one device."""
  loss_fn, params, batch, _ = flax_models.mlp_case()
  tx = optax.sgd(0.1)
  pipe = jpipe.Pipeline(
    loss_fn,
    params,
    batch,
    num_stages=2,
    devices=jax.devices()[:2],
    num_microbatches=2,
    optimizer=tx,
    partition="pipedream_hybrid",
  )
  assert pipe.plan.method == "pipedream_hybrid"
  assert sorted(d for ds in pipe.plan.stage_devices for d in ds) == [0, 1]
  _trains_like_one_device(pipe, loss_fn, params, batch, tx)


@pytest.mark.slow
def test_a_checkpoint_resumes_on_replica_groups():
  """state_dict of a one-device-per-stage pipeline, loaded where stages
  are replicated, continues the same trajectory."""
  loss_fn, params, batch, _ = flax_models.mlp_case()
  tx = optax.adam(1e-2)
  kwargs = {"num_microbatches": 2, "optimizer": tx, "schedule": "1f1b"}
  plain = jpipe.Pipeline(
    loss_fn, params, batch, num_stages=3, devices=jax.devices()[:3], **kwargs
  )
  state, _ = plain.step(plain.init(params), batch)
  pipe = _replicated(LAYOUTS["disjoint"], loss_fn, params, batch, **kwargs)
  resumed = pipe.load_state_dict(plain.state_dict(state))
  assert resumed.stage_params[0][0].sharding.device_set == set(
    jax.devices()[:2]
  )
  resumed, _ = pipe.step(resumed, batch)
  expected, _ = _reference_steps(loss_fn, params, batch, 2, tx, steps=2)
  _assert_tree_close(pipe.gather_params(resumed), expected)


def test_device_group_names():
  assert device_name((3,)) == "device 3"
  assert device_name((4, 5, 6)) == "devices 4-6"
  assert device_name((0, 2)) == "devices 0,2"
