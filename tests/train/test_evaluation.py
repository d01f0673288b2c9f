"""The CLI's evaluation: a Task's held-out sums run forward through the
pipeline's stages, equal to the same evaluation on one device."""

import jax
import numpy as np
import pytest

import jpipe
from jpipe.train import evaluation, pipeline_mode, tasks, train_lib
from jpipe.train.errors import UsageError
from tests.tiers import slow
from tests.train.test_configs import _get_config, _short


@pytest.mark.parametrize(
  "name",
  [
    "default",  # MLP on digits: accuracy.
    slow("pipedream_resnet"),  # BatchNorm statistics as model state.
    slow("gpt_lm"),  # Token loss and perplexity.
    slow("t5"),  # Encoder-decoder, padded targets weighted out.
  ],
)
def test_through_the_pipeline_equals_one_device(name):
  """After two steps: the metrics through the stages equal the same
  Evaluation at the gathered params on one device."""
  config = _short(_get_config(name))
  task = tasks.build_task(config)
  lr = train_lib.learning_rate(config)
  tx = train_lib.build_optimizer(config, lr)
  pipe = train_lib.build_pipeline(config, task, task.batch_at(0), tx, lr)
  state = pipe.init(task.params, task.model_state)
  for step in range(2):
    state, _ = pipe.step(state, task.batch_at(step))
  state, _ = pipe.flush(state)
  got = evaluation.through_pipeline(pipe, state, task.evaluation)
  want = task.evaluation.on_one_device(
    pipe.gather_params(state), pipe.gather_model_state(state)
  )
  assert set(got) == set(want)
  for key in got:
    assert got[key] == pytest.approx(want[key], rel=1e-5), key


def test_the_cli_evaluates_without_gathering(tmp_path, monkeypatch):
  """The CLI's evaluations never gather the params (what a model too big
  for one device needs); a Task without ``evaluation`` still may."""

  def refuse(self, state):
    raise AssertionError("the evaluation gathered the params")

  monkeypatch.setattr(pipeline_mode.PipelineMode, "evaluation_inputs", refuse)
  config = _short(_get_config("default"))
  config.train.eval_every = 1
  summary = train_lib.train_and_evaluate(config, str(tmp_path))
  assert 0 < summary["eval"]["accuracy"] <= 1


@pytest.mark.slow
def test_sdpipe_evaluates_the_consensus_through_a_pipeline(
  tmp_path, monkeypatch
):
  """SD-Pipe's CLI evaluation: the replicas' mean, averaged stage by
  stage on the devices and run through the first pipeline's stages,
  gathering nothing; equal to the gathered mean on one device."""
  from jpipe.train import data_parallel_mode

  mode = data_parallel_mode.DataParallelMode
  seen = []
  through_stages = mode.evaluate

  def evaluate_and_compare(self, states, task):
    got = through_stages(self, states, task)
    want = task.evaluation.on_one_device(
      self.dp.consensus_params(states),
      self.dp.pipelines[0].gather_model_state(states[0]),
    )
    seen.append((got, want))
    return got

  def refuse(self, states):
    raise AssertionError("the evaluation gathered the params")

  monkeypatch.setattr(mode, "evaluate", evaluate_and_compare)
  monkeypatch.setattr(mode, "evaluation_inputs", refuse)
  config = _short(_get_config("sdpipe"))
  train_lib.train_and_evaluate(config, str(tmp_path))
  assert seen
  for got, want in seen:
    assert got["accuracy"] == pytest.approx(want["accuracy"], abs=1e-9)


def test_padded_batches_weigh_out_the_padding():
  arrays = {"x": np.arange(10, dtype=np.float32), "y": np.arange(10)}
  batches = evaluation.padded_batches(arrays, 4)
  assert [len(b["x"]) for b in batches] == [4, 4, 4]
  assert sum(b["weight"].sum() for b in batches) == 10
  np.testing.assert_array_equal(batches[2]["weight"], [1, 1, 0, 0])
  kept = np.concatenate([b["y"][b["weight"] > 0] for b in batches])
  np.testing.assert_array_equal(kept, arrays["y"])


def test_metrics_are_ratios_of_totals():
  """Totals, not means of batch means: a padded last batch counts only
  its examples."""
  batches = [
    {"y": np.array([1, 1, 0, 0]), "weight": np.ones(4, np.float32)},
    {"y": np.array([1, 0, 0, 0]), "weight": np.array([1, 0, 0, 0], "f4")},
  ]
  held_out = evaluation.Evaluation(
    lambda params, b: {
      "correct": (b["y"] * b["weight"]).sum(),
      "count": b["weight"].sum(),
    },
    lambda: batches,
    evaluation.accuracy,
  )
  got = held_out.on_one_device({"w": np.zeros(1)}, None)
  assert got["accuracy"] == pytest.approx(3 / 5)


def _task_with(evaluation_value):
  config = _short(_get_config("default"))
  task = tasks.build_task(config)
  return tasks.Task(
    task.kind,
    task.loss_fn,
    task.params,
    None,
    task.batch_at,
    evaluation=evaluation_value,
  )


@pytest.mark.parametrize(
  "change, message",
  [
    ("none", "give Task.evaluation"),
    ("size", "must have the training batch's size"),
    ("vector", "must return {name: a scalar sum"),
  ],
)
def test_a_bad_evaluation_is_one_line_before_training(change, message):
  good = tasks.build_task(_short(_get_config("default"))).evaluation
  if change == "none":
    bad = None
  elif change == "size":
    first = good.batches()[0]
    half = jax.tree.map(lambda x: x[:3], first)
    bad = evaluation.Evaluation(good.sums_fn, lambda: [half], good.metrics)
  else:

    def vector(params, batch):
      return {"hits": batch["weight"]}

    bad = evaluation.Evaluation(vector, good.batches, good.metrics)
  with pytest.raises(UsageError, match=message):
    tasks.check_task(_task_with(bad), "test")


def test_dynamic_pipeline_evaluates_through_its_stages():
  """A DynamicPipeline evaluates with the pipeline in force."""
  config = _short(_get_config("default"))
  task = tasks.build_task(config)
  lr = train_lib.learning_rate(config)
  tx = train_lib.build_optimizer(config, lr)
  options = train_lib.pipeline_options(config, task, lr)
  options.pop("partition")
  dp = jpipe.dynamic.DynamicPipeline(
    jpipe.PipelineBuilder.of(
      task.loss_fn,
      task.params,
      task.batch_at(0),
      optimizer=tx,
      devices=jax.devices(),
      **options,
    )
  )
  state = dp.init(task.params)
  got = evaluation.through_pipeline(dp, state, task.evaluation)
  want = task.evaluation.on_one_device(task.params, None)
  assert got["accuracy"] == pytest.approx(want["accuracy"], rel=1e-6)
