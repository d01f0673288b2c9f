"""Node profiling and plans for traced models."""

import dataclasses

import numpy as np
import pytest

from jpipe import partition
from jpipe import schedule as jpipe_schedule
from tests import jitted
from tests.partition import flax_models


@pytest.fixture(scope="module")
def mlp():
  loss_fn, params, batch, _ = flax_models.mlp_case()
  traced = partition.trace(loss_fn, params, batch)
  return traced, params, batch


def test_xla_costs_count_the_matrix_products(mlp):
  traced, params, batch = mlp
  costs = partition.profile_nodes(traced, params, batch, method="xla")
  # dense_1: [8, 16] @ [16, 16] -> 2 * 8 * 16 * 16 multiply-adds.
  i = traced.node_names.index("dense_1")
  assert 2 * 8 * 16 * 16 <= costs.forward_flops[i] <= 1.5 * 2 * 8 * 16 * 16
  # Backward with recomputation: forward again + two products.
  assert 2.0 <= costs.backward_flops[i] / costs.forward_flops[i] <= 4.5
  np.testing.assert_allclose(costs.forward_seconds, costs.forward_flops / 1e12)


def test_analytic_costs_need_no_compilation(mlp):
  traced, params, batch = mlp
  costs = partition.profile_nodes(traced, params, batch, method="analytic")
  np.testing.assert_array_equal(costs.forward_flops, traced.node_flops())
  np.testing.assert_allclose(costs.backward_flops, 3 * costs.forward_flops)
  xla = partition.profile_nodes(traced, params, batch, method="xla")
  ratio = costs.forward_flops.sum() / xla.forward_flops.sum()
  assert 0.7 < ratio < 1.3  # the two counts agree to within 30%


def test_measured_costs_are_positive(mlp):
  traced, params, batch = mlp
  costs = partition.profile_nodes(
    traced, params, batch, method="measured", repeats=2
  )
  assert np.all(costs.forward_seconds > 0)
  assert np.all(costs.backward_seconds > 0)


@pytest.mark.parametrize("devices", [(0, 1, 1, 0), (0, 1, 0, 1)])
def test_stages_sharing_a_device_share_its_time(mlp, devices):
  """Four stages on two devices (a V, an interleaving): the busiest
  device's summed stage times pace the pipeline, and the predicted
  speed-up is at most the two devices."""
  traced, params, batch = mlp
  costs = partition.profile_nodes(traced, params, batch, method="analytic")
  n = len(traced.node_names)
  plan = partition.plan_from_boundaries(
    traced, costs, (0, 1, 2, 3, n), devices=devices
  )
  t = plan.stage_seconds
  by_device = [sum(t[s] for s in range(4) if devices[s] == d) for d in (0, 1)]
  assert plan.bottleneck_seconds == pytest.approx(max(by_device))
  assert plan.bottleneck_seconds > max(t)
  assert 1.0 < plan.predicted_speedup <= 2.0 * (1 + 1e-12)


def test_plan_round_trips_json_and_builds(mlp):
  traced, params, batch = mlp
  costs = partition.profile_nodes(traced, params, batch)
  plan = partition.plan_traced(traced, costs, 4, bandwidth=1e10)
  assert plan.num_stages == 4
  assert partition.Plan.from_json(plan.to_json()) == plan
  assert 1.0 < plan.predicted_speedup <= 4.0
  assert plan.bottleneck_seconds == max(plan.stage_seconds)
  assert sum(plan.stage_forward_seconds) == pytest.approx(
    float(costs.forward_seconds.sum())
  )
  assert plan.stage_stash_bytes[-1] == 0.0
  assert plan.stage_stash_bytes[0] == 3 * plan.stage_param_bytes[0]
  # One formula for the plan's stash and the runtime's delays.
  stream = jpipe_schedule.Stream("async", plan.num_stages)
  for s in range(plan.num_stages):
    delay = partition.steady_state_delay(plan.num_stages, s)
    assert stream.max_delay(s) == delay
    assert plan.stage_stash_bytes[s] == delay * plan.stage_param_bytes[s]
  stages = partition.Stages(traced, plan.stage_of_node)
  assert stages.num_stages == 4


def test_plan_errors(mlp):
  traced, params, batch = mlp
  costs = partition.profile_nodes(traced, params, batch)
  with pytest.raises(ValueError, match="unknown method 'metis'"):
    partition.plan_traced(traced, costs, 2, method="metis")
  with pytest.raises(ValueError, match="cannot split 8 nodes into 9"):
    partition.plan_traced(traced, costs, 9)
  with pytest.raises(ValueError, match="smallest limit that fits"):
    partition.plan_traced(
      traced, costs, 2, memory=partition.MemoryBudget(limit=100.0)
    )
  with pytest.raises(ValueError, match="not a jpipe Plan"):
    partition.Plan.from_json('{"method": "contiguous"}')
  with pytest.raises(ValueError, match="unknown method 'sgd'"):
    partition.profile_nodes(traced, params, batch, method="sgd")


def test_plan_is_frozen(mlp):
  traced, params, batch = mlp
  plan = partition.plan_traced(
    traced, partition.profile_nodes(traced, params, batch), 2
  )
  with pytest.raises(dataclasses.FrozenInstanceError):
    plan.method = "other"


@pytest.mark.slow
def test_mixed_plan_puts_several_stages_on_a_device_and_builds():
  loss_fn, params, batch, _ = flax_models.encoder_decoder_case()
  traced = partition.trace(loss_fn, params, batch)
  costs = partition.profile_nodes(traced, params, batch)
  straight = partition.plan_traced(traced, costs, 3)
  mixed = partition.plan_traced(traced, costs, 3, method="mixed")
  assert mixed.num_stages >= 3
  assert {d for ds in mixed.stage_devices for d in ds} <= {0, 1, 2}
  assert mixed.bottleneck_seconds <= straight.bottleneck_seconds + 1e-15
  stages = partition.Stages(traced, mixed.stage_of_node)
  out, grads = stages.run_forward_backward(params, batch)
  import jax

  ref_out, ref_grads = jitted.value_and_grad(loss_fn)(params, batch)
  np.testing.assert_allclose(out, ref_out, rtol=1e-5)
  for a, b in zip(
    jax.tree.leaves(grads), jax.tree.leaves(ref_grads), strict=True
  ):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


def test_mixed_blocks_bound_the_mixed_pipes_stages(mlp):
  """``mixed_blocks`` (FTPipe's L): the mixed solver cuts L blocks, so a
  plan has at most L stages (same-device runs merge), never slower than
  the straight split; other methods refuse it in one line."""
  traced, params, batch = mlp
  costs = partition.profile_nodes(traced, params, batch)
  straight = partition.plan_traced(traced, costs, 2)
  for blocks in range(2, traced.num_nodes + 1):
    plan = partition.plan_traced(
      traced, costs, 2, method="mixed", mixed_blocks=(blocks,)
    )
    assert 2 <= plan.num_stages <= blocks
    assert plan.bottleneck_seconds <= straight.bottleneck_seconds * (1 + 1e-12)
  with pytest.raises(ValueError, match="mixed_blocks are for method 'mixed'"):
    partition.plan_traced(traced, costs, 2, mixed_blocks=(4,))
  with pytest.raises(ValueError, match="block count 1 must lie in"):
    partition.plan_traced(traced, costs, 2, method="mixed", mixed_blocks=(1,))


@pytest.mark.parametrize("routing", ["split", "round_robin"])
def test_a_replicated_stage_holds_its_share_of_the_microbatches(mlp, routing):
  """Stage 0 of 4 (4 microbatches in flight, 4 stashed versions) on 3
  replicas: split holds 1/3 of each microbatch's activations (and of the
  working values) but every version; 1F1B-RR whole microbatches,
  PipeDream's (6 - 1 - 0) // 3 + 1 = 2 of them, and as many versions.
  Restated from the model's terms; the other stages as in the straight
  plan (its S - s is PipeDream's count there)."""
  traced, params, batch = mlp
  costs = partition.profile_nodes(traced, params, batch, method="analytic")
  straight = partition.plan_traced(traced, costs, 4)
  plan = dataclasses.replace(
    straight, stage_devices=((0, 1, 2), (3,), (4,), (5,))
  )
  budget = partition.MemoryBudget(param_versions=(4, 3, 2, 1))
  got = partition.stage_memory_bytes(traced, plan, budget, routing)
  one = partition.stage_memory_bytes(traced, straight, budget)
  of = np.asarray(plan.stage_of_node)
  p0 = np.bincount(of, weights=traced.node_param_bytes(), minlength=4)[0]
  v0 = np.bincount(of, weights=traced.node_intermediate_bytes(), minlength=4)[0]
  if routing == "split":
    kept, versions, working = 4 / 3, 4, p0 + v0 / 3
  else:
    kept, versions, working = 2, 2, p0 + v0
  # Params, gradients and Adam's two moments; stashed copies; activations.
  want = 4 * p0 + (versions - 1) * p0 + kept * v0
  np.testing.assert_allclose(got.persistent[0], want, rtol=1e-12)
  np.testing.assert_allclose(got.working[0], working, rtol=1e-12)
  np.testing.assert_allclose(got.persistent[1:], one.persistent[1:])
  np.testing.assert_allclose(got.working[1:], one.working[1:])
  assert got.total[0] < one.total[0]
