"""A plan given by hand (``jpipe.partition.Split``; issue 65, item 2):
node counts and replica counts per stage, resolved on the traced model,
against a restatement; the solver's split for replicas alone against
brute force; the mismatches named in one line."""

import jax
import numpy as np
import optax
import pytest

import jpipe
from jpipe import partition
from tests import jitted
from tests.partition import flax_models

SGD = optax.sgd(0.1)


@pytest.fixture(scope="module")
def stacked():
  """3 nodes at depth 1, 10 at depth 2 (stem, 8 blocks, head), 34 at 3."""
  loss_fn, params, batch, _ = flax_models.stack_in_submodule_case()
  return partition.trace(loss_fn, params, batch), params, batch


def _costs(traced, params, batch):
  return partition.profile_nodes(traced, params, batch, method="analytic")


def test_node_counts_pick_their_depth_and_make_the_plan(stacked):
  traced, params, batch = stacked
  split = partition.Split((1, 4, 4, 1), replicas=(1, 2, 1, 1))
  cut, granularity = split.depth_of(traced)
  assert (cut.depth, cut.num_nodes) == (2, 10) and granularity.depth == 2
  costs = _costs(cut, params, batch)
  plan = split.plan(cut, costs)
  assert plan.stage_of_node == (0, 1, 1, 1, 1, 2, 2, 2, 2, 3)
  assert plan.stage_devices == ((0,), (1, 2), (3,), (4,))
  # Restated: a stage's time is its nodes' compute over its replicas.
  compute = costs.forward_seconds + costs.backward_seconds
  expected = [
    compute[0],
    compute[1:5].sum() / 2,
    compute[5:9].sum(),
    compute[9],
  ]
  np.testing.assert_allclose(plan.stage_seconds, expected)
  assert plan.method == "split"


def test_replicas_alone_split_by_the_solver_priced_per_replica(stacked):
  traced, params, batch = stacked
  split = partition.Split(replicas=(3, 1))
  cut, _ = split.depth_of(traced)
  costs = _costs(cut, params, batch)
  plan = split.plan(cut, costs)
  compute = costs.forward_seconds + costs.backward_seconds
  # Brute force: the cut minimising the slowest stage, stage 0 3x faster.
  best = min(
    max(compute[:c].sum() / 3, compute[c:].sum())
    for c in range(1, cut.num_nodes)
  )
  assert plan.bottleneck_seconds == pytest.approx(best)
  assert plan.stage_devices == ((0, 1, 2), (3,))
  # The replicated stage takes more of the nodes than an even split would.
  first = plan.stage_of_node.count(0)
  assert first > cut.num_nodes / 2


@pytest.mark.parametrize(
  "nodes, replicas, match",
  [
    ((), None, "counts of at least 1"),
    ((2, 0), None, "counts of at least 1"),
    ((2, 2), (1, 1, 1), "2 stages of nodes but 3 replica counts"),
    (None, None, "needs nodes_per_stage, replicas or both"),
  ],
)
def test_bad_splits_are_one_line(nodes, replicas, match):
  with pytest.raises(ValueError, match=match):
    partition.Split(nodes, replicas)


def test_counts_no_depth_has_are_named(stacked):
  traced, _, _ = stacked
  with pytest.raises(
    partition.SplitMismatch, match="3 at depth 1, 10 at depth 2"
  ):
    partition.Split((4, 4)).depth_of(traced)


def test_a_split_pipeline_steps_as_one_device():
  """1 + 2 nodes on 1 + 2 devices (the second stage data parallel): one
  SGD step equals the step of the whole model on one device."""
  loss_fn, params, batch, _ = flax_models.mlp_case()
  split = partition.Split((3, 5), replicas=(1, 2))
  pipe = jpipe.Pipeline(
    loss_fn,
    params,
    batch,
    num_stages=2,
    partition=split,
    optimizer=SGD,
    num_microbatches=2,
    devices=jax.devices()[:3],
  )
  assert pipe.plan.stage_devices == ((0,), (1, 2))
  state, _ = pipe.step(pipe.init(params), batch)
  grads = jitted.grad(loss_fn)(params, batch)
  expected = jax.tree.map(lambda p, g: p - 0.1 * g, params, grads)
  for a, b in zip(
    jax.tree.leaves(pipe.gather_params(state)),
    jax.tree.leaves(expected),
    strict=True,
  ):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
  with pytest.raises(ValueError, match="num_stages=3 but the split"):
    jpipe.Pipeline(
      loss_fn, params, batch, num_stages=3, partition=split, optimizer=SGD
    )
  with pytest.raises(ValueError, match="needs 3 devices, got 2"):
    jpipe.Pipeline(
      loss_fn,
      params,
      batch,
      num_stages=2,
      partition=split,
      optimizer=SGD,
      devices=jax.devices()[:2],
    )
