"""``jpipe.Pipeline(schedule="auto")``: the plan's numbers handed to the
choice (stage costs, transfer times, the partitioner's memory model),
the chosen schedule built and run, and auto's refusals in one line."""

import dataclasses

import jax
import numpy as np
import optax
import pytest

import jpipe
from jpipe import partition, runtime
from jpipe import schedule as sc
from jpipe.runtime.build import auto_schedule
from tests.partition import flax_models


def _pipe(**kwargs):
  loss_fn, params, batch, _ = flax_models.mlp_case()
  options = dict(num_stages=4, num_microbatches=4, optimizer=optax.adam(0.1))
  options.update(kwargs)
  pipe = jpipe.Pipeline(
    loss_fn,
    params,
    batch,
    devices=jax.devices()[:4],
    schedule="auto",
    **options,
  )
  return pipe, params, batch


def test_auto_builds_and_runs_the_first_of_its_table():
  pipe, _, _ = _pipe(num_stages=2)
  choice = pipe.schedule_choice
  assert pipe.schedule_name == choice.chosen == choice.rows[0].name
  assert pipe.schedule.name == choice.chosen  # The lists it runs.
  steps = [r.step_seconds for r in choice.rows]
  assert steps == sorted(steps)  # No limit: every row fits.
  # (It trains: tests/train/test_auto_schedule.py runs a step.)
  named = jpipe.Pipeline(
    *flax_models.mlp_case()[:3],
    devices=jax.devices()[:2],
    schedule="1f1b",
    num_stages=2,
    num_microbatches=4,
    optimizer=optax.adam(0.1),
  )
  assert named.schedule_choice is None
  assert named.plan == pipe.plan  # Auto plans as 1f1b does.


def test_more_stages_than_devices_rank_schedules_on_the_loop():
  """4 contiguous stages on 2 devices: auto plans the loop (stage s on
  device s mod 2) and ranks every schedule there, the loop schedules
  among them; the chosen one trains."""
  loss_fn, params, batch, _ = flax_models.mlp_case()
  pipe = jpipe.Pipeline(
    loss_fn,
    params,
    batch,
    devices=jax.devices()[:2],
    schedule="auto",
    num_stages=4,
    num_microbatches=4,
    optimizer=optax.adam(0.1),
  )
  assert pipe.plan.stage_devices == ((0,), (1,), (0,), (1,))
  choice = pipe.schedule_choice
  names = [r.name for r in choice.rows]
  assert {"interleaved", "interleaved_zb", "1f1b"} <= set(names)
  assert pipe.schedule_name == choice.chosen == names[0]
  _, metrics = pipe.step(pipe.init(params), batch)
  assert np.isfinite(float(metrics["loss"]))


def test_stage_costs_are_the_plans_with_transfers_over_the_bandwidth():
  pipe, _, _ = _pipe()
  plan, traced = pipe.plan, pipe.traced
  f = np.array(plan.stage_forward_seconds)
  b = np.array(plan.stage_backward_seconds)
  plain = auto_schedule.plan_costs(plan, traced, None, recompute=False)
  np.testing.assert_allclose(plain.input, b / 2)
  assert plain.comm == ()
  costs = auto_schedule.plan_costs(plan, traced, 1e6, recompute=True)
  np.testing.assert_allclose(costs.input, f + (b - f) / 2)  # I recomputes.
  stage = plan.stage_of_node
  for k in range(plan.num_stages - 1):  # Bytes crossing cut k, by hand.
    crossing = sum(
      w
      for (u, v), w in traced.edges().items()
      if min(stage[u], stage[v]) <= k < max(stage[u], stage[v])
    )
    assert costs.comm[k] == pytest.approx(crossing / 1e6)


@pytest.mark.parametrize("recompute", [False, True])
def test_memory_terms_are_the_partitioners_model(recompute):
  pipe, params, _ = _pipe()
  plan, n = pipe.plan, pipe.plan.num_stages
  terms = auto_schedule.memory_terms(
    plan, pipe.traced, params, optax.adam(0.1), 4, recompute
  )
  adam = runtime.partitioner_memory_model(
    None,
    optax.adam(0.1),
    params,
    sc.lookup("1f1b"),
    4,
    n,
    recompute=recompute,
    stashes=False,
    fused_last=False,
  )
  for flight in ([1, 2, 3, 4], [4, 4, 4, 4]):
    budget = dataclasses.replace(adam, in_flight=flight)
    want = partition.stage_memory_bytes(pipe.traced, plan, budget).total
    got = (
      np.array(terms.fixed)
      + np.array(flight) * np.array(terms.kept)
      + np.array(terms.working)
    )
    np.testing.assert_allclose(got, want)
  # Between I and W: the stage's activations, as kept without recompute.
  plain = dataclasses.replace(adam, in_flight=[1] * n, recompute=False)
  none = dataclasses.replace(plain, in_flight=[0] * n)
  activations = (
    partition.stage_memory_bytes(pipe.traced, plan, plain).total
    - partition.stage_memory_bytes(pipe.traced, plan, none).total
  )
  np.testing.assert_allclose(terms.weight_kept, activations)


def test_a_limit_no_schedule_fits_is_one_line():
  with pytest.raises(sc.NoScheduleFits) as error:
    _pipe(memory_limit=4096)
  text = str(error.value)
  assert "\n" not in text and "the smallest need is " in text


def test_a_limit_picks_the_fastest_schedule_that_fits_it():
  free, _, _ = _pipe()
  rows = {r.name: r for r in free.schedule_choice.rows}
  limit = rows["1f1b"].peak_bytes
  assert rows[free.schedule_name].peak_bytes > limit  # (zero bubble)
  pipe, _, _ = _pipe(memory_limit=limit)  # Built: its own check passed.
  choice = pipe.schedule_choice
  chosen = choice.rows[0]
  assert chosen.name == pipe.schedule_name and chosen.peak_bytes <= limit
  faster = [r for r in choice.rows if r.step_seconds < chosen.step_seconds]
  assert faster and all(not r.fits for r in faster)
  assert max(pipe.device_memory.values()) <= limit


def test_the_built_pipelines_prediction_moves_auto_down_its_table():
  # (2 stages, no recomputation: the partitioner's model predicts less
  # than the built pipeline for this MLP's zero-bubble schedules.)
  free, _, _ = _pipe(num_stages=2, recompute=False)
  top = free.schedule_choice.rows[0]
  assert top.peak_bytes < max(free.device_memory.values())
  pipe, _, _ = _pipe(num_stages=2, recompute=False, memory_limit=top.peak_bytes)
  choice = pipe.schedule_choice
  assert top.name in choice.over_when_built
  assert pipe.schedule_name == choice.chosen != top.name
  assert pipe.schedule.name == choice.chosen
  assert max(pipe.device_memory.values()) <= top.peak_bytes
  ranked = [r.name for r in choice.rows]
  # Every row ranked above the chosen one was over, by either model.
  for row in choice.rows[: ranked.index(choice.chosen)]:
    assert not row.fits or row.name in choice.over_when_built
  assert "(over the limit as built)" in "\n".join(choice.table())


def test_stale_options_are_refused_in_one_line():
  with pytest.raises(ValueError, match="schedule='auto' chooses among the"):
    _pipe(weight_stashing=True)
