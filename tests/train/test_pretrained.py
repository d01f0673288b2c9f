"""Fine-tuning: pretrained params from every source, checked against the
model; frozen params through the pipeline; the training CLI's init_from."""

import flax.serialization
import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest

import jpipe
from jpipe.train import pretrained, tasks, train_lib
from jpipe.train.metric_log import read_metrics
from tests.partition import flax_models
from tests.train.test_train import _config as train_config


def _params():
  """An MLP's params and a different draw of the same shapes."""
  _, params, _, _ = flax_models.mlp_case()
  other = jax.tree.map(lambda x: x + 1.0, params)
  return params, other


def _assert_tree_equal(a, b):
  assert jax.tree.structure(a) == jax.tree.structure(b)
  for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


class _HuggingFaceLike:
  """What ``FlaxPreTrainedModel.from_pretrained`` returns: ``.params``."""

  def __init__(self, params):
    self.params = params


PRETRAINED = _params()[1]


def pretrained_params():
  return PRETRAINED


def test_every_source_loads_the_saved_params(tmp_path):
  template, saved = _params()
  msgpack = tmp_path / "flax_model.msgpack"
  msgpack.write_bytes(flax.serialization.to_bytes(saved))
  checkpointer = ocp.StandardCheckpointer()
  checkpointer.save(tmp_path / "orbax", saved)
  checkpointer.wait_until_finished()
  sources = {
    "msgpack": str(msgpack),
    "orbax": str(tmp_path / "orbax"),
    "module:callable": "tests.train.test_pretrained:pretrained_params",
    "callable": lambda: saved,
    ".params": _HuggingFaceLike(saved),
  }
  for source in sources.values():
    _assert_tree_equal(pretrained.load_params(source, template), saved)
  # Flax variables (or a state dict) around a model's bare params.
  variables = {"params": saved["params"], "batch_stats": {"x": np.ones(2)}}
  loaded = pretrained.load_params(variables, template["params"])
  _assert_tree_equal(loaded, saved["params"])
  # Values take the model's dtypes (bf16 weights into an f32 model).
  halves = jax.tree.map(lambda x: x.astype(jnp.bfloat16), saved)
  loaded = pretrained.load_params(halves, template)
  assert {x.dtype for x in jax.tree.leaves(loaded)} == {np.dtype("float32")}


def test_mismatches_name_the_first_differing_path():
  template, saved = _params()
  inner = saved["params"]
  missing = {"params": {k: v for k, v in inner.items() if k != "head"}}
  with pytest.raises(ValueError, match=r"have no 'params/head/bias'"):
    pretrained.load_params(missing, template)
  extra = {"params": {**inner, "head_2": inner["head"]}}
  with pytest.raises(ValueError, match=r"have 'params/head_2/bias', which"):
    pretrained.load_params(extra, template)
  wide = {
    "params": {
      **inner,
      "head": {"bias": np.zeros(11), **{"kernel": np.zeros((16, 11))}},
    }
  }
  with pytest.raises(ValueError, match=r"'params/head/bias' has shape \(11,\)"):
    pretrained.load_params(wide, template)
  # keep_init: the new head keeps its fresh init, the rest is pretrained.
  loaded = pretrained.load_params(wide, template, keep_init="^params/head/")
  _assert_tree_equal(loaded["params"]["head"], template["params"]["head"])
  _assert_tree_equal(loaded["params"]["dense_0"], inner["dense_0"])
  with pytest.raises(ValueError, match="no file or directory 'nowhere'"):
    pretrained.load_params("nowhere", template)


def test_frozen_params_through_the_pipeline_equal_plain_optax():
  """1F1B over 2 stages (the stage optimizers see flat {path: leaf}
  dicts) against optax on the nested params, one device."""
  loss_fn, params, batch, _ = flax_models.mlp_case()
  tx = pretrained.freeze(optax.adam(0.01), "dense_0/|^params/head/kernel")
  pipe = jpipe.Pipeline(
    loss_fn,
    params,
    batch,
    num_stages=2,
    devices=jax.devices()[:2],
    schedule="1f1b",
    num_microbatches=1,
    optimizer=tx,
  )
  state = pipe.init(params)
  want, opt_state = params, tx.init(params)
  for _ in range(2):
    state, _ = pipe.step(state, batch)
    grads = jax.grad(loss_fn)(want, batch)
    updates, opt_state = tx.update(grads, opt_state, want)
    want = optax.apply_updates(want, updates)
  got = pipe.gather_params(state)
  for path, x in pretrained.flat_paths(got).items():
    np.testing.assert_allclose(
      x, pretrained.flat_paths(want)[path], rtol=1e-5, atol=1e-6
    )
    before = pretrained.flat_paths(params)[path]
    frozen = path.startswith("params/dense_0/") or path == "params/head/kernel"
    assert np.array_equal(x, before) == frozen, path


def _config(**overrides):
  """test_train's small default config, trained 2 steps."""
  short = {f"train.{k}": 2 for k in ("steps", "eval_every", "checkpoint_every")}
  return train_config(
    **short, **{"train.profile_last_step": False}, **overrides
  )


def _no_work(config):
  raise AssertionError("built the task before refusing the config")


@pytest.mark.slow
def test_cli_fine_tunes_from_a_workdir_and_freezes(tmp_path, monkeypatch):
  pre, tuned = str(tmp_path / "pre"), str(tmp_path / "tuned")
  train_lib.train_and_evaluate(_config(), pre)
  summary = train_lib.train_and_evaluate(
    _config(
      init_from=pre,
      **{"optimizer.freeze": "^layer_0/", "data.train_split": "train[:50%]"},
    ),
    tuned,
  )
  evals = [r for r in read_metrics(tuned) if "eval/accuracy" in r]
  # Step 0 is evaluated: the pretrained model's accuracy, exactly.
  pretrained_eval = [r for r in read_metrics(pre) if "eval/accuracy" in r]
  assert evals[0]["step"] == 0
  assert evals[0]["eval/accuracy"] == pretrained_eval[-1]["eval/accuracy"]
  assert summary["eval"]["accuracy"] == evals[-1]["eval/accuracy"]
  # The frozen layer still holds the pretrained values after training.
  template = tasks.build_task(_config()).params
  before = pretrained.load_params(pre, template)
  after = pretrained.load_params(tuned, template)
  for path, x in pretrained.flat_paths(after).items():
    same = np.array_equal(x, pretrained.flat_paths(before)[path])
    assert same == path.startswith("layer_0/"), path
  # Bad fine-tuning settings stop before any work.
  monkeypatch.setattr(train_lib, "build_task", _no_work)
  for overrides, message in (
    ({"init_from": str(tmp_path / "nowhere")}, "no file or directory"),
    ({"init_keep": "head"}, "init_keep: keeps leaves .* set config.init_from"),
  ):
    with pytest.raises(ValueError, match=message):
      train_lib.train_and_evaluate(_config(**overrides), str(tmp_path / "x"))


def test_cli_refuses_patterns_that_match_nothing(tmp_path):
  for overrides, message in (
    ({"optimizer.freeze": "^nothing/"}, "matches 0 of the .* param paths"),
    (
      {"init_from": str(tmp_path), "init_keep": "^nothing/"},
      "init_keep='\\^nothing/' matches no param path",
    ),
  ):
    with pytest.raises(ValueError, match=message):
      train_lib.train_and_evaluate(_config(**overrides), str(tmp_path / "w"))


def test_hf_names_of_the_configs_model_or_which_models_take_them():
  """``tasks.hf_names``: the config's model's map to HuggingFace names
  (GPT-2's, as ``jpipe.models.gpt2.hf_names`` gives it for the model the
  config builds), or a one-line refusal naming the models that can."""
  from jpipe.models import gpt2
  from jpipe.train.errors import UsageError

  config = train_config()
  config.model.name = "gpt2"
  config.model.kwargs = {"vocab_size": 32, "n_positions": 8}
  config.model.kwargs.update(d_model=16, num_layers=2, num_heads=2)
  names = tasks.hf_names(config)
  want = gpt2.hf_names(gpt2.Model(**tasks.model_kwargs(config)))
  assert names == want and names
  config = train_config()
  config.init_from = "hf:/weights"
  with pytest.raises(UsageError, match="model 'mlp' cannot take HuggingFace"):
    tasks.hf_names(config)
