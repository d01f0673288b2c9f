"""The user's own model and task through ``python -m jpipe.train``.

This file defines its own model and task (nothing of it lives in
``jpipe/``), and the CLI imports them by path: as a new user's file
``my_task.py`` would be, ``--config.task=my_task:build_task``.
"""

import dataclasses
import functools
import json
import os
import subprocess
import sys

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest

from jpipe.train import config_check, train_lib
from jpipe.train.errors import UsageError
from jpipe.train.tasks import Task, check_task
from tests.train.test_train import ROOT, _cli_env, _losses

HERE = "tests.train.test_user_task"


class Blocks(nn.Module):
  """A model no jpipe code knows: residual tanh blocks on flattened
  8x8 digits, under names of its own, with dropout driven by
  ``deterministic`` (HuggingFace's spelling)."""

  width: int = 24
  blocks: int = 4
  classes: int = 10
  rate: float = 0.0
  param_dtype: str = "float32"

  @nn.compact
  def __call__(self, x, deterministic: bool = True):
    dense = functools.partial(nn.Dense, param_dtype=self.param_dtype)
    h = dense(self.width, name="stem")(x.reshape(x.shape[0], -1))
    for i in range(self.blocks):
      h = h + jnp.tanh(dense(self.width, name=f"block{i}")(h))
      h = nn.Dropout(self.rate, deterministic=deterministic)(h)
    return dense(self.classes, name="out")(h)


def build_task(config) -> Task:
  """The test's own task: the digits (as a user's data: plain arrays)
  regressed to one-hot targets by squared error, evaluated by a metric of
  its own."""
  from jpipe.data import digits

  images, labels = digits.load_digits("train", None)
  test_images, test_labels = digits.load_digits("test", None)
  model = Blocks()
  size = config.data.batch_size

  def batch_at(step):
    take = np.random.default_rng([config.seed, step]).permutation(len(labels))[
      :size
    ]
    return {"pixels": images[take], "target": np.eye(10)[labels[take]]}

  def loss_fn(params, batch):
    out = model.apply({"params": params}, batch["pixels"])
    return jnp.mean(jnp.sum(jnp.square(out - batch["target"]), -1))

  def evaluate(params, model_state):
    del model_state
    out = model.apply({"params": params}, test_images)
    hits = np.mean(np.argmax(np.asarray(out), -1) == test_labels)
    return {"hit_rate": float(hits)}

  params = model.init(jax.random.key(config.seed), images[:1])["params"]
  return Task("regression", loss_fn, params, None, batch_at, evaluate)


def not_a_task(config):
  return {"loss_fn": None}


def bad_loss_task(config):
  task = build_task(config)
  return Task(
    task.kind,
    lambda params, batch: jnp.zeros(3),
    task.params,
    None,
    task.batch_at,
    task.evaluate,
  )


def aux_task(config, metrics=None) -> Task:
  """The test's task whose loss also returns its hit rate (``has_aux``:
  logged as train/hit_rate); ``metrics``: what it returns instead."""
  task = build_task(config)
  model = Blocks()

  def loss_fn(params, batch):
    out = model.apply({"params": params}, batch["pixels"])
    loss = jnp.mean(jnp.sum(jnp.square(out - batch["target"]), -1))
    hits = jnp.argmax(out, -1) == jnp.argmax(batch["target"], -1)
    if metrics is not None:
      return loss, metrics(loss)
    return loss, {"hit_rate": jnp.mean(hits)}

  return Task(
    task.kind,
    loss_fn,
    task.params,
    None,
    task.batch_at,
    task.evaluate,
    has_aux=True,
  )


def loss_named_aux_task(config):
  return aux_task(config, lambda loss: {"loss": loss})


def aux_without_the_flag_task(config):
  return dataclasses.replace(aux_task(config), has_aux=False)


def array_aux_task(config):
  return aux_task(config, lambda loss: {"hits": jnp.zeros(3)})


def _cli(workdir, *overrides):
  return [
    sys.executable,
    "-m",
    "jpipe.train",
    "--config",
    os.path.join(ROOT, "configs", "default.py"),
    "--workdir",
    str(workdir),
    f"--config.task={HERE}:build_task",
    "--config.pipeline.num_stages=3",
    "--config.train.log_every=1",
    "--config.train.eval_every=3",
    "--config.train.checkpoint_every=3",
    "--config.train.profile_last_step=False",
    "--config.optimizer.learning_rate=0.01",
    "--config.optimizer.clip_norm=1.0",
    *overrides,
  ]


def _config(**overrides):
  sys.path.insert(0, os.path.join(ROOT, "configs"))
  import default

  config = default.get_config()
  config.task = f"{HERE}:build_task"
  config.pipeline.num_stages = 3
  config.train.log_every = 1
  config.train.eval_every = 3
  config.train.checkpoint_every = 3
  config.train.profile_last_step = False
  config.optimizer.learning_rate = 0.01
  config.optimizer.clip_norm = 1.0
  config.update_from_flattened_dict(overrides)
  return config


@pytest.mark.slow
def test_cli_trains_the_users_task_by_import_path_and_resumes_it(tmp_path):
  """Three steps, then the same command to six resumes from the
  checkpoint and lands where six uninterrupted steps do; the task's own
  metric is logged; the checkpoint is refused to another task."""
  env = _cli_env()
  resumed, straight = tmp_path / "resumed", tmp_path / "straight"
  outputs = []
  for workdir, steps in ((resumed, 3), (resumed, 6), (straight, 6)):
    done = subprocess.run(
      _cli(workdir, f"--config.train.steps={steps}"),
      capture_output=True,
      text=True,
      env=env,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    outputs.append(done.stdout)
  assert "Resuming from step 3" in outputs[1]
  a, b = _losses(resumed), _losses(straight)
  assert sorted(a) == sorted(b) == [1, 2, 3, 4, 5, 6]
  for step in (4, 5, 6):
    assert a[step] == pytest.approx(b[step], rel=1e-6)
  rows = [json.loads(x) for x in open(resumed / "metrics.jsonl")]
  assert [r["step"] for r in rows if "eval/hit_rate" in r] == [3, 6]
  # The fingerprint names the task: another task cannot resume it.
  other = subprocess.run(
    _cli(
      resumed,
      "--config.train.steps=9",
      "--config.task=",
      "--config.model.kwargs.hidden=(8,8)",
    ),
    capture_output=True,
    text=True,
    env=env,
  )
  assert other.returncode == 2, other.stderr[-2000:]
  assert "Traceback" not in other.stderr


@pytest.mark.slow
def test_the_users_flax_module_on_a_built_in_task(tmp_path):
  """``model.name=package.module:Module``: the digits' classification
  task with the test's module (its ``deterministic`` flag set for
  training and evaluation, dropout keys from the batch), async with
  stashing."""
  config = _config(
    **{
      "task": "",
      "model.name": f"{HERE}:Blocks",
      "model.kwargs": {"rate": 0.1, "width": 16},
      "train.steps": 4,
      "schedule.name": "async",
      "staleness.stashing": True,
      "optimizer.clip_norm": 1.0,
    }
  )
  summary = train_lib.train_and_evaluate(config, str(tmp_path))
  assert 0.0 <= summary["eval"]["accuracy"] <= 1.0
  assert sorted(_losses(tmp_path)) == [1, 2, 3, 4]


def _trained_to_bfloat16_params(config, workdir):
  """Trains ``config`` (3 steps) in ``workdir``: it evaluates, and its
  checkpoint (read as plain orbax) holds bfloat16 params; returns it."""
  summary = train_lib.train_and_evaluate(config, str(workdir))
  assert 0.0 <= summary["eval"]["accuracy"] <= 1.0
  saved = ocp.StandardCheckpointer().restore(
    workdir / "checkpoints" / "3" / "state"
  )
  assert {str(x.dtype) for x in jax.tree.leaves(saved["params"])} == {
    "bfloat16"
  }
  return saved


def test_bfloat16_params_accumulate_in_float32_through_the_cli(tmp_path):
  """``optimizer.grad_accum_dtype=float32`` on the user's module with
  bfloat16 params: trains, and the checkpoint keeps bfloat16 params and
  the float32 momentum one step makes of float32 gradients."""
  config = _config(
    **{
      "task": "",
      "model.name": f"{HERE}:Blocks",
      "model.kwargs": {"width": 16, "param_dtype": "bfloat16"},
      "train.steps": 3,
      "optimizer.grad_accum_dtype": "float32",
    }
  )
  saved = _trained_to_bfloat16_params(config, tmp_path)
  moments = {str(x.dtype) for x in jax.tree.leaves(saved["opt_state"])}
  assert "float32" in moments and "bfloat16" not in moments
  config.optimizer.grad_accum_dtype = "int8"
  with pytest.raises(UsageError, match="grad_accum_dtype.*floating dtype"):
    config_check.check(config)


def test_a_built_in_models_params_in_bfloat16_through_the_cli(tmp_path):
  """``model.param_dtype=bfloat16`` on a jpipe model (its init is
  float32): the params train and are saved in bfloat16, the gradients
  summed in float32; a resume in another dtype is refused by name; a
  bad dtype is one line."""
  config = _config(
    **{
      "task": "",
      "model.param_dtype": "bfloat16",
      "train.steps": 3,
      "optimizer.grad_accum_dtype": "float32",
    }
  )
  _trained_to_bfloat16_params(config, tmp_path)
  config.model.param_dtype = ""
  config.train.steps = 4
  with pytest.raises(
    Exception, match=r"config.model.param_dtype: saved 'bfloat16', now ''"
  ):
    train_lib.train_and_evaluate(config, str(tmp_path))
  config.model.param_dtype = "int8"
  with pytest.raises(UsageError, match="model.param_dtype: 'int8'.*bfloat16"):
    config_check.check(config)


def test_sdpipe_runs_the_users_task(tmp_path):
  """Two pipelines in data parallel (SD-Pipe's partial reduce) on the
  test's task."""
  sdpipe = _config(
    **{
      "train.steps": 2,
      "data_parallel.pipelines": 2,
      "data_parallel.sync": "preduce",
      "data_parallel.epoch_batches": 1,
      "pipeline.num_stages": 2,
    }
  )
  summary = train_lib.train_and_evaluate(sdpipe, str(tmp_path / "sd"))
  assert "hit_rate" in summary["eval"]


@pytest.mark.parametrize("pipelines", [1, 2])
def test_the_users_metrics_beside_the_loss_are_logged(
  tmp_path, capsys, pipelines
):
  """``Task.has_aux``: the loss's own metric, averaged over a log
  window, logged as train/<name> and printed beside the loss -- one
  pipeline, and SD-Pipe's two (each pipeline's mean, averaged)."""
  config = _config(
    **{
      "task": f"{HERE}:aux_task",
      "train.steps": 2,
      "schedule.name": "1f1b",
      "pipeline.num_stages": 2,
      "data_parallel.pipelines": pipelines,
      "data_parallel.epoch_batches": 1,
    }
  )
  train_lib.train_and_evaluate(config, str(tmp_path))
  rows = [json.loads(x) for x in open(tmp_path / "metrics.jsonl")]
  logged = {r["step"]: r["train/hit_rate"] for r in rows if "train/loss" in r}
  printed = capsys.readouterr().out
  assert f"train hit_rate {logged[2]:.4f}" in printed, printed
  assert sorted(logged) == [1, 2]
  if pipelines == 1:  # Step 1's: the batch's hit rate at the start.
    task = aux_task(config)
    batch = jax.tree.map(jnp.asarray, task.batch_at(0))
    want = task.loss_fn(task.params, batch)[1]["hit_rate"]
    assert logged[1] == pytest.approx(float(want), abs=1e-6)
  assert all(0.0 <= v <= 1.0 for v in logged.values())


def test_dynpipe_runs_the_users_task(tmp_path, capsys):
  """DynPipe re-partitioning off a slowed device on the test's task (its
  metric beside the loss logged on every split)."""
  dynamic = _config(
    **{
      "task": f"{HERE}:aux_task",
      "train.steps": 8,
      "dynamic.enabled": True,
      "dynamic.window": 2,
      "dynamic.simulated_ms": 20.0,
      "dynamic.inject": "1:6.0:4",
      "dynamic.horizon_steps": 500,
      "train.eval_every": 8,
      "train.checkpoint_every": 8,
    }
  )
  summary = train_lib.train_and_evaluate(dynamic, str(tmp_path / "dyn"))
  assert "re-partition at step 8" in capsys.readouterr().out
  assert summary["repartitions"]
  rows = [json.loads(x) for x in open(tmp_path / "dyn" / "metrics.jsonl")]
  hits = [r["train/hit_rate"] for r in rows if "train/loss" in r]
  assert len(hits) == 8 and all(0.0 <= h <= 1.0 for h in hits)


def test_a_task_that_breaks_the_protocol_is_one_line_before_any_work():
  config = _config()
  for builder, message in [
    ("not_a_task", "returned a dict, not a jpipe.train.tasks.Task"),
    ("bad_loss_task", "must return a scalar loss"),
    ("loss_named_aux_task", "metric 'loss' would overwrite"),
    ("array_aux_task", "a dict of named scalars"),
    ("aux_without_the_flag_task", "set Task\\(..., has_aux=True\\)"),
  ]:
    config.task = f"{HERE}:{builder}"
    with pytest.raises(UsageError, match=message):
      train_lib.build_task(config)
  task = build_task(config)
  with pytest.raises(UsageError, match="leading batch axis"):
    check_task(
      Task("x", task.loss_fn, task.params, None, lambda s: {}, task.evaluate),
      "here",
    )
  unseeded = np.random.default_rng()  # Another batch on every call.

  def drawn(step):
    return task.batch_at(int(unseeded.integers(1000)))

  with pytest.raises(UsageError, match="must be a pure function of the step"):
    check_task(
      Task("x", task.loss_fn, task.params, None, drawn, task.evaluate), "here"
    )


@pytest.mark.parametrize(
  "key, value, message",
  [
    ("task", f"{HERE}:nope", "defines no 'nope'"),
    ("task", "no_such_module_anywhere:build", "no module"),
    ("task", HERE, "write package.module:name"),
    ("task", f"{HERE}:HERE", "is a str, not a function"),
    ("model.name", f"{HERE}:build_task", "not a Flax module class"),
    ("model.name", "nosuchmodel", "nor package.module:Module"),
  ],
)
def test_bad_import_paths_name_the_fix(key, value, message):
  config = _config(**{"task": "", key: value})
  with pytest.raises(UsageError, match=message):
    config_check.check(config)


def test_cli_import_path_errors_are_one_line(tmp_path):
  done = subprocess.run(
    _cli(tmp_path, f"--config.task={HERE}:nope"),
    capture_output=True,
    text=True,
    env=_cli_env(),
  )
  assert done.returncode == 2
  assert "defines no 'nope'" in done.stderr
  assert len(done.stderr.strip().splitlines()) <= 3, done.stderr
  assert not (tmp_path / "metrics.jsonl").exists()


def test_label_smoothing_is_optax_smoothing():
  """The built-in tasks' smoothed cross entropy against the formula."""
  from jpipe.train.model_calls import cross_entropy

  logits = jax.random.normal(jax.random.key(0), (5, 7))
  labels = jnp.array([0, 3, 6, 2, 2])
  eps = 0.1
  target = (1 - eps) * np.eye(7)[labels] + eps / 7
  logp = np.asarray(jax.nn.log_softmax(logits))
  want = -np.sum(target * logp, -1)
  np.testing.assert_allclose(cross_entropy(logits, labels, eps), want, 1e-6)
  np.testing.assert_allclose(
    cross_entropy(logits, labels, 0.0),
    optax.softmax_cross_entropy_with_integer_labels(logits, labels),
  )
  # Smoothing never lowers the loss of a confident correct prediction.
  sure = 10.0 * jax.nn.one_hot(labels, 7)
  assert np.all(cross_entropy(sure, labels, eps) > cross_entropy(sure, labels))


@pytest.mark.parametrize(
  "marker, metric",
  [
    ("--config.task=examples.my_task:build_task", "accuracy"),
    ("--config.model.name=examples.my_task:ConvNet", "accuracy"),
  ],
)
@pytest.mark.slow
def test_the_readmes_own_model_commands_run_as_written(
  tmp_path, marker, metric
):
  """The README's "Your own model" commands (from the repository's root,
  as a user runs them), a few steps."""
  from tests.distributed.test_readme_commands import _with, readme_command

  command = _with(
    readme_command(marker),
    tmp_path,
    "--config.train.steps=4",
    "--config.train.eval_every=2",
    "--config.train.profile_last_step=False",
  )
  done = subprocess.run(
    command, capture_output=True, text=True, env=_cli_env(), cwd=ROOT
  )
  assert done.returncode == 0, done.stderr[-3000:]
  rows = [json.loads(x) for x in open(tmp_path / "metrics.jsonl")]
  assert [r["step"] for r in rows if f"eval/{metric}" in r] == [2, 4]
