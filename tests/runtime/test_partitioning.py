"""The split and placement options as one value:
``jpipe.runtime.Partitioning``."""

import dataclasses

import jax
import numpy as np
import optax
import pytest

import jpipe
from jpipe.runtime import Partitioning
from tests.runtime.test_pipeline_async import NUM_MICRO, _mlp, mlp_pipeline


def _pipe(**options):
  return mlp_pipeline("1f1b", optax.sgd(0.1), 3, **options)


@pytest.mark.slow
def test_a_partitioning_value_builds_and_trains_as_its_keywords_do():
  keywords = dict(num_stages=3, depth=1, cost_model="analytic")
  by_keywords, params, batch = _pipe(**keywords)
  by_value, _, _ = _pipe(partitioning=Partitioning(**keywords))
  assert by_value.partitioning == by_keywords.partitioning
  assert by_value.plan.stage_of_node == by_keywords.plan.stage_of_node
  results = []
  for pipe in (by_keywords, by_value):
    state, metrics = pipe.step(pipe.init(params), batch)
    results.append((float(metrics["loss"]), pipe.gather_params(state)))
  (loss_a, params_a), (loss_b, params_b) = results
  assert loss_a == loss_b
  jax.tree.map(np.testing.assert_array_equal, params_a, params_b)


def test_options_given_twice_or_missing_are_refused_by_name():
  with pytest.raises(
    ValueError, match=r"given twice: .*\['num_stages', 'depth'\]"
  ):
    _pipe(num_stages=3, depth=1, partitioning=Partitioning(3))
  with pytest.raises(ValueError, match="num_stages is required"):
    _pipe()
  with pytest.raises(ValueError, match="num_stages must be >= 1, got 0"):
    Partitioning(0)
  with pytest.raises(ValueError, match="unknown transport 'tcp'"):
    Partitioning(2, transport="tcp")


def test_an_option_of_neither_value_is_refused_with_the_nearest_name():
  """A misspelt option fails at once (a TypeError, as a misspelt keyword
  of any function does) naming it and the option it nearly is; the
  options of the two values are the keywords, nothing else."""
  with pytest.raises(
    TypeError, match=r"keyword argument 'num_stage' \(did you mean 'num_stages'"
  ):
    _pipe(num_stage=3)
  with pytest.raises(TypeError, match="'wieght_stash'.*'weight_stashing'"):
    _pipe(num_stages=3, wieght_stash=True)
  with pytest.raises(TypeError, match="unexpected keyword argument 'zzz'"):
    _pipe(num_stages=3, zzz=1)
  # The nearest may be one of the Pipeline's own arguments.
  with pytest.raises(TypeError, match="'num_microbatch'.*'num_microbatches'"):
    _pipe(num_stages=3, num_microbatch=2)


def test_a_plan_as_partition_is_never_mistaken_for_the_default():
  """A Plan given as a keyword beside a Partitioning value is refused
  (comparing it with the default "contiguous" must not raise)."""
  pipe, _, _ = _pipe(num_stages=3)
  with pytest.raises(ValueError, match=r"given twice: .*\['partition'\]"):
    _pipe(partition=pipe.plan, partitioning=Partitioning(3))


def test_layers_above_keep_the_spelling_they_were_given():
  """DynPipe and SD-Pipe rebuild pipelines on a solved Plan: with a
  Partitioning value, inside it (no "given twice")."""
  from jpipe.runtime import partition_of, with_partition

  value = Partitioning(3, depth=1)
  options = with_partition({"partitioning": value}, "mixed")
  assert options == {
    "partitioning": Partitioning(3, partition="mixed", depth=1)
  }
  assert partition_of(options) == "mixed"
  assert with_partition({"num_stages": 3}, "mixed") == {
    "num_stages": 3,
    "partition": "mixed",
  }
  assert partition_of({}) == "contiguous"
  loss_fn, params, batch = _mlp()
  build = jpipe.PipelineBuilder.of(
    loss_fn,
    params,
    batch,
    schedule="1f1b",
    num_microbatches=NUM_MICRO,
    optimizer=optax.sgd(0.1),
    partitioning=Partitioning(2),
  )
  dp = jpipe.parallel.DataParallelPipelines(
    build, pipelines=2, devices=jax.devices()[:4]
  )
  first, second = dp.pipelines
  assert first.partitioning.partition == "contiguous"  # It solves.
  assert second.partitioning.partition == first.plan  # It follows.
  dp.close()


def test_every_phase_field_is_a_declared_read_only_attribute():
  """``Pipeline.parts`` holds the construction phases' values; each of
  their fields (but the cut's construction-only ones) is an attribute of
  the same name, declared on the class and read-only."""
  pipe, _, _ = _pipe(num_stages=2)
  construction_only = {"micro", "num_state_leaves"}
  for phase in dataclasses.fields(pipe.parts):
    value = getattr(pipe.parts, phase.name)
    for field in dataclasses.fields(value):
      if field.name in construction_only:
        continue
      assert isinstance(vars(jpipe.Pipeline).get(field.name), property), (
        f"{phase.name}.{field.name} is not declared on Pipeline"
      )
      assert getattr(pipe, field.name) is getattr(value, field.name)
  with pytest.raises(AttributeError):
    pipe.plan = None
  # A builder builds it again for a plan, on other devices.
  build = jpipe.PipelineBuilder(*_mlp(), {"num_stages": 2})
  assert build.partition == "contiguous"
  again = build.with_options(optimizer=optax.sgd(0.1))(
    pipe.plan, devices=jax.devices()[2:4]
  )
  assert again.partitioning.partition == pipe.plan
  assert again.plan.stage_of_node == pipe.plan.stage_of_node
  assert [d.id for d in again.devices] == [2, 3]


@pytest.mark.parametrize("devices", [((0,), (1,)), ((0,), (1,), (2,), (0,))])
def test_a_plan_whose_devices_do_not_match_its_stages_is_refused(devices):
  """A Plan given with more or fewer stage devices than stages is a
  one-line error naming the field, before anything is placed."""
  plain, _, _ = _pipe(num_stages=3)
  plan = dataclasses.replace(plain.plan, stage_devices=devices)
  with pytest.raises(
    ValueError,
    match=rf"cuts its nodes into 3 stages .* stage_devices has "
    rf"{len(devices)} entries: give one per stage$",
  ):
    _pipe(num_stages=3, partition=plan)
  empty = dataclasses.replace(plain.plan, stage_devices=((0,), (), (1,)))
  with pytest.raises(ValueError, match="stage 1 has no device"):
    _pipe(num_stages=3, partition=empty)


def test_mixed_blocks_reach_the_mixed_solver_and_nothing_else():
  """``mixed_blocks`` bounds the built pipeline's mixed-pipe stages;
  another partition refuses it; a solved Plan put in its place (data
  parallel and re-partitioning runs) leaves it out."""
  from jpipe.runtime import with_partition

  pipe, _, _ = _pipe(num_stages=2, partition="mixed", mixed_blocks=(3,))
  assert 2 <= pipe.plan.num_stages <= 3
  assert pipe.partitioning.mixed_blocks == (3,)
  with pytest.raises(ValueError, match="is for partition='mixed'"):
    Partitioning(2, mixed_blocks=(3,))
  value = Partitioning(2, partition="mixed", mixed_blocks=(3,))
  solved = with_partition({"partitioning": value}, pipe.plan)
  assert solved["partitioning"].mixed_blocks is None
  kept = with_partition({"partitioning": value}, "mixed")
  assert kept["partitioning"].mixed_blocks == (3,)
  keywords = with_partition({"mixed_blocks": (3,)}, pipe.plan)
  assert keywords == {"partition": pipe.plan, "mixed_blocks": None}
