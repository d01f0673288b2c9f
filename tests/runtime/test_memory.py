"""The pipeline's memory prediction: against XLA's own figures for the
compiled stage programs, against what the running driver holds, and the
limit that refuses a pipeline before it trains."""

import jax
import jax.numpy as jnp
import optax
import pytest

import jpipe
from jpipe.runtime.build.memory import (
  StageMemory,
  device_totals,
  in_flight_counts,
  nbytes,
)
from tests.partition import flax_models


def _gpt_pipe(schedule="1f1b", num_stages=3, num_micro=4, **kwargs):
  loss_fn, params, batch, _ = flax_models.gpt_case()
  batch = jax.tree.map(lambda x: jnp.concatenate([x] * num_micro), batch)
  pipe = jpipe.Pipeline(
    loss_fn,
    params,
    batch,
    num_stages=num_stages,
    devices=jax.devices()[:num_stages],
    schedule=schedule,
    num_microbatches=num_micro,
    optimizer=optax.adam(1e-3),
    **kwargs,
  )
  return pipe, params, batch


def _stage_inputs(pipe, s):
  """Stage s's abstract (params, batch leaves, acts) of one microbatch."""
  avals = pipe.traced.closed_jaxpr.in_avals
  spec = pipe.stages.specs[s]
  params = tuple(avals[i] for i in spec.param_leaves)
  first = pipe.traced.num_param_leaves
  batch = tuple(avals[first + i] for i in spec.batch_leaves)
  return params, batch, tuple(v.aval for v in spec.inputs)


@pytest.mark.parametrize("recompute", [False, True])
def test_prediction_matches_xla_memory_analysis(recompute):
  pipe, _, _ = _gpt_pipe(recompute=recompute)
  for s, memory in enumerate(pipe.memory):
    params, batch, acts = _stage_inputs(pipe, s)
    # The optimizer state XLA allocates for the stage's leaves.
    init = jax.jit(pipe.stage_optimizers[s].init)
    opt_shapes = jax.eval_shape(init, params)
    xla = init.lower(params).compile().memory_analysis().output_size_in_bytes
    _assert_same_bytes(memory.opt_state, xla, opt_shapes)
    # One version of the params, and (recomputing) what a microbatch
    # keeps in flight: its inputs -- XLA's argument bytes of the forward.
    saving = pipe.stages.jitted("forward_saving", s)
    stats = saving.lower(params, batch, acts).compile().memory_analysis()
    inputs = nbytes((batch, acts))
    _assert_same_bytes(
      memory.params + inputs,
      stats.argument_size_in_bytes,
      (params, batch, acts),
    )
    # Or, keeping residuals: XLA's output bytes of the saving forward
    # (residuals, values sent on, results).
    saved = jax.eval_shape(saving, params, batch, acts)
    sent = nbytes(saved[:2])
    residual_bytes = nbytes(saved[2])
    assert memory.kept_per_microbatch == (
      inputs if recompute else residual_bytes
    )
    _assert_same_bytes(residual_bytes + sent, stats.output_size_in_bytes, saved)
    # The working term bounds XLA's temporaries of the stage's programs
    # (from above: XLA fuses and frees; not by more than a small factor).
    if pipe.stages.specs[s].outputs:
      backward = pipe.programs.backward(s, first=True)
      head = (batch, acts) if recompute else (saved[2],)
      args = (None, params, *head, saved[0], _cots(saved[1]))
    else:  # The last stage runs fused.
      backward = pipe.programs.forward_backward(s, first=True)
      args = (None, params, batch, acts, _cots(saved[1]))
    temps = [
      stats.temp_size_in_bytes,
      backward.lower(*args).compile().memory_analysis().temp_size_in_bytes,
    ]
    assert max(temps) <= memory.working <= 4 * max(temps), (temps, memory)
    assert memory.grads == memory.params


def _assert_same_bytes(predicted, xla, tree):
  """XLA's figure is the data plus, at most, an 8-byte pointer per buffer
  of a tuple (its index table)."""
  leaves = len(jax.tree.leaves(tree))
  assert 0 <= xla - predicted <= 8 * (leaves + 4), (predicted, xla)


def _cots(results):
  return tuple(jax.ShapeDtypeStruct(r.shape, r.dtype) for r in results)


@pytest.mark.parametrize(
  "schedule, num_micro",
  [("gpipe", 4), ("1f1b", 4), ("1f1b", 2), ("async", 4)],
)
def test_in_flight_counts_follow_the_schedule(schedule, num_micro):
  kwargs = {"weight_stashing": True} if schedule == "async" else {}
  pipe, _, _ = _gpt_pipe(schedule, num_micro=num_micro, **kwargs)
  n = 3
  flight = tuple(m.in_flight for m in pipe.memory)
  if schedule == "gpipe":  # Every microbatch; the fused last stage none.
    expected = (num_micro,) * (n - 1) + (0,)
  else:  # PipeDream's 1F1B: n - s (at most the call's microbatches).
    expected = tuple(min(n - s, num_micro) for s in range(n - 1)) + (0,)
  assert flight == expected


def test_in_flight_counts_without_fusion():
  pipe, _, _ = _gpt_pipe("gpipe", fuse_last_stage=False)
  call = pipe.calls(0, 4)
  assert in_flight_counts([call], 3) == (4, 4, 4)


@pytest.mark.parametrize(
  "schedule, kwargs",
  [
    ("1f1b", {}),
    ("async", {"recompute": True}),
    ("async", {"weight_stashing": True}),
    ("async", {"weight_stashing": True, "prediction": "msnag"}),
    ("async", {"recompute": True, "prediction": "msnag"}),
    ("async", {"weight_stashing": True, "gap_aware": "ga"}),
    ("2bw", {"step_every": 4, "recompute": True}),
  ],
)
def test_versions_and_kept_bytes_match_the_running_driver(schedule, kwargs):
  if "gap_aware" in kwargs:
    kwargs["gap_aware_options"] = {"optimizer": "adam", "learning_rate": 1e-3}
  pipe, params, batch = _gpt_pipe(schedule, **kwargs)
  state = pipe.init(params)
  held = [0, 0, 0]
  for _ in range(3):  # Into the stream's steady state.
    state, metrics = pipe.step(state, batch)
    held = [
      max(h, v) for h, v in zip(held, metrics["param_bytes"], strict=True)
    ]
  for s, memory in enumerate(pipe.memory):
    predicted = memory.params * memory.versions + memory.tied_copies
    assert held[s] <= predicted
    # Exact where no tied replica is involved, except a prediction made
    # and dropped inside each forward (the driver never holds it).
    transient = "prediction" in kwargs and not pipe.policy.keeps_forward_params
    if not memory.tied_copies and not transient:
      assert held[s] == predicted
  saved = state.in_flight.saved if state.in_flight else {}
  for (s, _), value in saved.items():  # Real arrays a microbatch keeps.
    assert nbytes(value) == pipe.memory[s].kept_per_microbatch


def test_a_pipeline_over_the_limit_is_refused_before_it_compiles():
  pipe, _, _ = _gpt_pipe("gpipe", recompute=False)
  total = max(m.total for m in pipe.memory)
  # A given Plan (no partitioner involved): the prediction decides.
  kwargs = {"recompute": False, "partition": pipe.plan}
  with pytest.raises(jpipe.MemoryLimitError) as err:
    _gpt_pipe("gpipe", memory_limit=total * 0.9, **kwargs)
  message = str(err.value)
  assert "memory_limit=" in message and "stage" in message
  assert "more stages" in message and "recompute=True" in message
  assert "schedule='1f1b'" in message
  # It stopped before any stage program compiled.
  ok, _, _ = _gpt_pipe("gpipe", memory_limit=total * 1.01, **kwargs)
  assert not ok.programs.compiled_kinds()


def test_the_partitioner_keeps_to_the_limit():
  # (4 stages: at 3 the fastest split, its last stage priced without
  # recomputation, is already the one that needs least.)
  free, _, _ = _gpt_pipe("1f1b", num_stages=4)
  # (jpipe.MemoryLimitError, as a given split over the limit raises.)
  with pytest.raises(
    jpipe.MemoryLimitError, match="smallest limit that fits"
  ) as err:
    _gpt_pipe("1f1b", num_stages=4, memory_limit=1000.0)
  need = float(str(err.value).split("fits is ")[1].split(" bytes")[0])
  # At the smallest limit the partitioner's model allows, it moves nodes
  # off the stage the balanced split loads most, and the prediction fits
  # (the partitioner's per-node model bounds it from above).
  limited, _, _ = _gpt_pipe("1f1b", num_stages=4, memory_limit=need * 1.0001)
  assert limited.plan.stage_of_node != free.plan.stage_of_node
  assert max(m.total for m in limited.memory) <= need * 1.0001
  assert max(m.total for m in limited.memory) < max(
    m.total for m in free.memory
  )


def test_memory_limit_bad_values():
  with pytest.raises(ValueError, match="bytes per device"):
    _gpt_pipe(memory_limit=-1)
  with pytest.raises(ValueError, match="do not report their memory"):
    _gpt_pipe(memory_limit="device")
  loss_fn, params, batch, _ = flax_models.mlp_case()
  traced = jpipe.partition.trace(loss_fn, params, batch)
  costs = jpipe.partition.profile_nodes(traced, params, batch)
  with pytest.raises(ValueError, match="no mixed-pipe placement on 2"):
    jpipe.partition.plan_traced(
      traced,
      costs,
      2,
      method="mixed",
      memory=jpipe.partition.MemoryBudget(limit=1.0),
    )

  # The mixed pipe's memory model: each device within the limit.
  def held(plan):
    stage_bytes = jpipe.partition.stage_memory_bytes(traced, plan)
    return max(stage_bytes.per_device(plan.stage_devices).values())

  roomy = jpipe.partition.plan_traced(traced, costs, 2, method="mixed")
  limit = 0.999 * held(roomy)
  try:
    plan = jpipe.partition.plan_traced(
      traced,
      costs,
      2,
      method="mixed",
      memory=jpipe.partition.MemoryBudget(limit=limit),
    )
  except ValueError as e:  # Or no placement fits: the error says so.
    assert "no mixed-pipe placement" in str(e)
  else:
    assert held(plan) <= limit


def test_device_totals_add_the_stages_a_device_runs():
  def mem(total, working=0):
    return StageMemory(total, 1, 0, 0, 0, 0, 0, working)

  stages = [mem(10), mem(20), mem(5)]
  # A mixed pipe (stages 0 and 2 on device 0) and a replicated stage.
  assert device_totals(stages, [(0,), (1, 2), (0,)]) == {0: 15, 1: 20, 2: 20}
  # One program runs at a time on a device: the largest working term
  # counts once, the rest of each stage adds up (params 10 and 5 here).
  stages = [mem(10, working=4), mem(20, working=7), mem(5, working=1)]
  assert device_totals(stages, [(0,), (1, 2), (0,)]) == {
    0: 10 + 5 + 4,
    1: 20 + 7,
    2: 20 + 7,
  }
