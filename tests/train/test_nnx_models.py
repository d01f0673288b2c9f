"""A Flax NNX module class as ``config.model.name`` (``NnxModel``): its
variables and calls against NNX's own (split, ``train()`` / ``eval()``,
reseeded dropout), and a pipeline of the built-in task it makes against a
one-device microbatch loop."""

import subprocess

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import jpipe
from examples.nnx_model import CNN
from jpipe.train import model_calls, tasks
from jpipe.train.errors import UsageError
from jpipe.train.nnx_models import NnxModel
from tests import jitted
from tests.runtime.test_pipeline_sync import _assert_tree_close
from tests.train.test_train import ROOT, _cli_env, _config

SMALL = {"channels": (4, 8), "hidden": (16, 16), "dropout": 0.5}


def _str_keys(tree):
  """A pure dict with every key a string (``NnxModel``'s layout)."""
  if isinstance(tree, dict):
    return {str(k): _str_keys(v) for k, v in tree.items()}
  return tree


def _images(n=4, seed=1):
  return jax.random.normal(jax.random.key(seed), (n, 8, 8, 1))


def test_init_is_the_modules_params_and_batch_statistics():
  """``init(key)``'s params are ``nnx.Param``s of ``CNN(rngs=nnx.Rngs(
  key))`` (a list's indices as string keys), its model state the
  BatchNorm statistics; RNG state is in neither."""
  key = jax.random.key(3)
  module = CNN(**SMALL, rngs=nnx.Rngs(key))
  _, params, stats, _ = nnx.split(module, nnx.Param, nnx.BatchStat, ...)
  variables = NnxModel(CNN, **SMALL).init(key, _images())
  assert set(variables) == {"params", "batch_stats"}
  _assert_tree_close(variables["params"], _str_keys(nnx.to_pure_dict(params)))
  _assert_tree_close(
    variables["batch_stats"], _str_keys(nnx.to_pure_dict(stats))
  )
  assert set(variables["params"]["dense"]) == {"0", "1"}
  assert set(variables["batch_stats"]) == {"bn1", "bn2"}


def test_a_module_of_hijax_variables_gives_arrays_and_the_same_calls():
  """A module made under ``nnx.var_defaults(hijax=True)`` (a user's
  module may set it): params and statistics are arrays, and a jitted
  call equals the ordinary module's."""
  key, x = jax.random.key(0), _images()
  with nnx.var_defaults(hijax=True):
    model = NnxModel(CNN, **SMALL)
    variables = model.init(key)
    got = jax.jit(lambda v: model.apply(v, x, train=False))(variables)
  assert all(isinstance(v, jax.Array) for v in jax.tree.leaves(variables))
  ordinary = NnxModel(CNN, **SMALL)
  want = ordinary.apply(ordinary.init(key), x, train=False)
  np.testing.assert_allclose(got, want, rtol=1e-6)


def test_calls_equal_the_modules_own_in_either_mode():
  """Evaluation: the module after ``eval()``. Training: the module after
  ``train()`` with its dropout stream reseeded from the key, its output
  and updated BatchNorm statistics; masks follow the key."""
  key, x = jax.random.key(0), _images()
  model = NnxModel(CNN, **SMALL)
  variables = model.init(key)
  assert model_calls.mode_kwargs(model, True) == {"train": True}
  assert model_calls.needs_dropout_key(model, variables, x)

  module = CNN(**SMALL, rngs=nnx.Rngs(key))
  module.eval()
  np.testing.assert_allclose(
    model.apply(variables, x, train=False), module(x), rtol=1e-6
  )

  drop = jax.random.key(7)
  module.train()  # Its one stream: Dropout's, from nnx.Rngs(key)'s default.
  nnx.reseed(module, default=jax.random.fold_in(drop, 0))
  want = module(x)
  got, updates = model.apply(
    variables, x, train=True, rngs={"dropout": drop}, mutable=["batch_stats"]
  )
  np.testing.assert_allclose(got, want, rtol=1e-6)
  stats = _str_keys(nnx.to_pure_dict(nnx.state(module, nnx.BatchStat)))
  _assert_tree_close(updates["batch_stats"], stats)
  assert not np.allclose(  # Statistics moved.
    updates["batch_stats"]["bn1"]["mean"],
    variables["batch_stats"]["bn1"]["mean"],
  )
  again = model.apply(variables, x, train=True, rngs={"dropout": drop})
  other = model.apply(
    variables, x, train=True, rngs={"dropout": jax.random.key(8)}
  )
  np.testing.assert_array_equal(again, got)
  assert not np.allclose(other, got)


class _Tagger(nnx.Module):
  """An NNX module with its own mode keyword (``deterministic``), dropout
  drawn from ``rngs`` passed to the call (none kept), and a counter
  variable of its own (model state that is not BatchNorm's)."""

  def __init__(self, features: int = 6, *, rngs: nnx.Rngs):
    self.embed = nnx.Embed(11, features, rngs=rngs)
    self.dropout = nnx.Dropout(0.5)
    self.out = nnx.Linear(features, 3, rngs=rngs)
    self.calls = nnx.Variable(jnp.zeros((), jnp.int32))

  def __call__(self, ids, *, deterministic: bool = True, rngs=None):
    self.calls[...] = self.calls[...] + 1
    h = self.dropout(self.embed(ids), deterministic=deterministic, rngs=rngs)
    return self.out(h.mean(axis=1))


def test_own_mode_keyword_call_rngs_and_other_state():
  """A module's own ``deterministic`` is the mode keyword; its call gets
  ``nnx.Rngs(dropout=key)``; any other variable is model state, returned
  updated."""
  model = NnxModel(_Tagger)
  ids = jnp.arange(12).reshape(2, 6) % 11
  variables = model.init(jax.random.key(0))
  assert model_calls.mode_kwargs(model, True) == {"deterministic": False}
  assert model.draws_random
  assert variables["batch_stats"] == {"calls": 0}
  drop = jax.random.key(5)
  got, updates = model.apply(
    variables, ids, deterministic=False, rngs={"dropout": drop}, mutable=True
  )
  module = _Tagger(rngs=nnx.Rngs(jax.random.key(0)))
  want = module(ids, deterministic=False, rngs=nnx.Rngs(dropout=drop))
  np.testing.assert_allclose(got, want, rtol=1e-6)
  assert int(updates["batch_stats"]["calls"]) == 1
  evaluated = model.apply(variables, ids, deterministic=True)
  np.testing.assert_allclose(
    evaluated, module(ids, deterministic=True), rtol=1e-6
  )


def test_model_name_takes_an_nnx_class_and_refuses_other_things():
  assert isinstance(tasks.flax_module("examples.nnx_model:CNN")(), NnxModel)
  with pytest.raises(UsageError, match="not a Flax module class"):
    tasks.flax_module("jpipe.train.tasks:flax_module")  # (A function.)
  config = _config(**{"model.name": "examples.nnx_model:CNN"})
  config.model.kwargs.unknown = 1
  with pytest.raises(
    UsageError,
    match=r"config.model.kwargs of CNN.*unknown.* \(the config gives "
    r"\{.*'unknown': 1\}, perhaps for the model it names itself: "
    r"--config.model.kwargs='\{...\}' sets yours, '\{\}' none\)",
  ):
    tasks.build_task(config)


def _example_task(kwargs):
  """The digits' classification task of the example CNN built with
  ``kwargs``, and its first batch."""
  config = _config(**{"model.name": "examples.nnx_model:CNN"})
  config.model.kwargs = kwargs
  task = tasks.build_task(config)
  return task, jax.tree.map(jnp.asarray, task.batch_at(0))


def _task_pipeline(task, batch, **options):
  """The task through 3 stages (SGD at 0.1 unless ``options`` say)."""
  return jpipe.Pipeline(
    task.loss_fn,
    task.params,
    batch,
    num_stages=3,
    devices=jax.devices()[:3],
    model_state=task.model_state,
    **{"optimizer": optax.sgd(0.1), **options},
  )


@pytest.mark.parametrize("schedule", ["1f1b", "zbh1"])
def test_a_pipeline_of_the_nnx_task_equals_a_microbatch_loop(schedule):
  """The digits' classification task of the example CNN (BatchNorm state,
  dropout keys in the batch) through 3 stages: params, statistics and
  loss equal one device's loop over the microbatches."""
  task, batch = _example_task(SMALL)
  assert "dropout_key" in batch
  m, tx = 4, optax.sgd(0.1)
  pipe = _task_pipeline(
    task, batch, schedule=schedule, num_microbatches=m, optimizer=tx
  )
  state, metrics = pipe.step(pipe.init(task.params, task.model_state), batch)
  grads, stats, losses, size = None, task.model_state, [], len(batch["y"]) // m
  for k in range(m):
    mb = jax.tree.map(lambda x, k=k: x[k * size : (k + 1) * size], batch)
    (loss, stats), g = jitted.value_and_grad(task.loss_fn, has_aux=True)(
      task.params, stats, mb
    )
    losses.append(loss)
    grads = g if grads is None else jax.tree.map(jnp.add, grads, g)
  updates, _ = tx.update(
    jax.tree.map(lambda g: g / m, grads), tx.init(task.params), task.params
  )
  _assert_tree_close(
    pipe.gather_params(state), optax.apply_updates(task.params, updates)
  )
  _assert_tree_close(pipe.gather_model_state(state), stats)
  assert float(metrics["loss"]) == pytest.approx(np.mean(losses), rel=1e-5)


@pytest.mark.slow
def test_the_readmes_nnx_model_command_trains_and_resumes(tmp_path):
  """The README's NNX command as written, 4 steps, then resumed to 6:
  the losses of steps 5-6 equal an uninterrupted run's."""
  from tests.distributed.test_readme_commands import _with, readme_command
  from tests.train.test_train import _losses

  command = readme_command("--config.model.name=examples.nnx_model:CNN")

  def run(workdir, steps):
    done = subprocess.run(
      _with(
        command,
        workdir,
        f"--config.train.steps={steps}",
        "--config.train.log_every=1",
        "--config.train.eval_every=2",
        "--config.train.checkpoint_every=2",
        "--config.train.profile_last_step=False",
      ),
      capture_output=True,
      text=True,
      env=_cli_env(),
      cwd=ROOT,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return _losses(workdir)

  run(tmp_path / "resumed", 4)
  resumed = run(tmp_path / "resumed", 6)
  straight = run(tmp_path / "straight", 6)
  assert sorted(resumed) == [1, 2, 3, 4, 5, 6]
  np.testing.assert_allclose(
    [resumed[s] for s in (5, 6)], [straight[s] for s in (5, 6)], rtol=1e-6
  )


def test_evaluation_follows_a_split_between_list_items():
  """Stages cut between ``dense[0]`` and ``dense[1]`` (items of one
  ``nnx.List``, separated by dropout calls in training only): the
  evaluation-mode function, which calls them back to back, runs on the
  same stages and equals one device's. (Items once shared one node,
  ``dense``, in evaluation: the wrong stage read ``dense[1]``.)"""
  task, batch = _example_task({**SMALL, "hidden": (16, 16, 16)})
  pipe = _task_pipeline(
    task, batch, num_microbatches=2, partition=jpipe.partition.Split((5, 1, 5))
  )
  names = pipe.traced.node_names
  assert names[4:7] == ("dense[0]", "dropout", "dense[1]")
  assert pipe.stages.stage_of_node[4:7] == (0, 1, 2)
  state = pipe.init(task.params, task.model_state)
  sums_fn = task.evaluation.sums_fn
  eval_batch = next(iter(task.evaluation.batches()))
  got = pipe.evaluate(state, eval_batch, sums_fn)
  want = sums_fn(task.params, task.model_state, eval_batch)
  _assert_tree_close(got, want)


class _Annotated(nnx.Module):
  """Production-style NNX layers: kernels annotated for a mesh
  (``nnx.with_partitioning``), which NNX refuses to build without one."""

  def __init__(self, *, rngs: nnx.Rngs):
    init = nnx.with_partitioning(
      nnx.initializers.lecun_normal(), ("embed", "mlp")
    )
    self.up = nnx.Linear(4, 8, kernel_init=init, rngs=rngs)
    self.down = nnx.Linear(8, 2, rngs=rngs)

  def __call__(self, x):
    return self.down(nnx.relu(self.up(x)))


def test_sharding_annotations_stay_metadata():
  """The pipeline places stages whole (no mesh): annotated kernels build,
  and calls equal the module's own built without eager sharding."""
  x = jnp.ones((3, 4))
  with pytest.raises(ValueError, match="mesh"):
    _Annotated(rngs=nnx.Rngs(0))
  model = NnxModel(_Annotated)
  variables = model.init(jax.random.key(0))
  with nnx.use_eager_sharding(False):
    module = _Annotated(rngs=nnx.Rngs(jax.random.key(0)))
  np.testing.assert_allclose(
    model.apply(variables, x, train=False), module(x), rtol=1e-6
  )
