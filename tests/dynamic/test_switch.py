"""Moving a training pipeline to another partition mid-run keeps every
bit of state: a synchronous run with a re-partition equals one without;
an asynchronous one keeps its optimizer's momentum; a plan seen before
costs no new pipeline."""

import jax
import numpy as np
import optax

import jpipe
from jpipe import dynamic, partition
from tests.partition import flax_models


def _setup(schedule, **options):
  loss_fn, params, batch, _ = flax_models.mlp_case()
  common = dict(
    num_stages=2,
    devices=jax.devices()[:2],
    schedule=schedule,
    num_microbatches=2,
    optimizer=optax.sgd(0.1, momentum=0.9),
    **options,
  )

  def build(plan):
    return jpipe.Pipeline(loss_fn, params, batch, partition=plan, **common)

  first = build("contiguous")
  micro = jax.tree.map(lambda x: x[:4], batch)
  costs = partition.profile_nodes(
    first.traced, params, micro, method="analytic"
  )
  bounds = dynamic.boundaries_of(first.plan.stage_of_node)
  n = bounds[-1]
  other = bounds[1] - 1 if bounds[1] > 1 else bounds[1] + 1
  assert 0 < other < n
  moved = partition.plan_from_boundaries(first.traced, costs, (0, other, n))
  return build, first, moved, params, batch


def _batches(batch, count):
  rng = np.random.default_rng(0)
  n = batch["x"].shape[0]
  return [
    jax.tree.map(lambda x: x[rng.permutation(n)], batch) for _ in range(count)
  ]


def test_sync_run_with_a_repartition_equals_one_without():
  build, first, moved, params, batch = _setup("gpipe")
  data = _batches(batch, 4)
  state = first.init(params)
  want = []
  for b in data:
    state, m = first.step(state, b)
    want.append(float(m["loss"]))
  want_params = first.gather_params(state)

  switch = dynamic.PlanSwitch(build, build(first.plan))
  state = switch.pipeline.init(params)
  got = []
  for i, b in enumerate(data):
    if i == 2:
      state = switch.switch(state, moved)
    state, m = switch.pipeline.step(state, b)
    got.append(float(m["loss"]))
  assert switch.pipeline.plan.stage_of_node == moved.stage_of_node
  np.testing.assert_allclose(got, want, rtol=0, atol=1e-6)
  for x, y in zip(
    jax.tree.leaves(switch.pipeline.gather_params(state)),
    jax.tree.leaves(want_params),
    strict=True,
  ):
    np.testing.assert_allclose(x, y, rtol=0, atol=1e-6)
  (record,) = switch.history
  assert record.step == 2 and record.compiled
  assert record.new[0] == (0, moved.stage_of_node.index(1))


def test_async_switch_keeps_momentum_and_reuses_seen_plans():
  build, first, moved, params, batch = _setup("async", weight_stashing=True)
  switch = dynamic.PlanSwitch(build, first)
  state = first.init(params)
  for b in _batches(batch, 3):
    state, _ = switch.pipeline.step(state, b)
  drained, _ = switch.pipeline.flush(state)
  before = switch.pipeline.state_dict(drained)
  state = switch.switch(state, moved)
  after = switch.pipeline.state_dict(state)
  # Params, momentum (by parameter path) and the step count all moved.
  for x, y in zip(jax.tree.leaves(after), jax.tree.leaves(before), strict=True):
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
  momentum = [x for x in jax.tree.leaves(after["opt_state"]) if np.ndim(x)]
  assert any(np.abs(x).max() > 0 for x in momentum)
  state, _ = switch.pipeline.step(state, batch)  # The stream goes on.
  back = switch.switch(state, first.plan)
  assert switch.pipeline is first  # Seen before: the same pipeline.
  assert [h.compiled for h in switch.history] == [True, False]
  assert switch.seen(moved) and switch.seen(first.plan)
  back, _ = switch.pipeline.step(back, batch)
  back, _ = switch.pipeline.flush(back)
  assert all(
    np.all(np.isfinite(x))
    for x in jax.tree.leaves(switch.pipeline.gather_params(back))
  )


def test_boundaries_of_another_stage_count_are_refused_by_name():
  """A split cutting 3 stages for a pipeline of 2 slots: one line naming
  both counts (it was NumPy's broadcast error), before any move."""
  _, first, _, params, batch = _setup("1f1b")
  micro = jax.tree.map(lambda x: x[:4], batch)
  costs = partition.profile_nodes(
    first.traced, params, micro, method="analytic"
  )
  n = dynamic.boundaries_of(first.plan.stage_of_node)[-1]
  with np.testing.assert_raises_regex(
    ValueError, r"cut 3 stages, for 2 devices \(stage slots\): give 3"
  ):
    partition.plan_from_boundaries(
      first.traced, costs, (0, 1, 2, n), devices=[0, 1]
    )
