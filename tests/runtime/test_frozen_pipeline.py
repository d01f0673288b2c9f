"""``Pipeline(..., frozen=patterns)``: the frozen leaves held inside as
model state (no gradient, no optimizer state), the whole params outside:
``init`` takes them, ``gather_params`` and ``state_dict`` give them, and
the functions given to ``evaluate``, ``predict`` and ``generate`` see
them; against one device training with ``freeze``."""

import jax
import numpy as np
import optax
import pytest

import jpipe
from jpipe.train.pretrained import freeze
from tests import jitted
from tests.partition import flax_models
from tests.runtime import test_generate
from tests.runtime.test_pipeline_sync import (
  _assert_tree_close,
  _microbatch,
  _reference_steps,
)

M = 2


def test_a_frozen_embedding_trains_as_one_device_and_keeps_the_callers_view():
  """GPT's tied embedding frozen on 2 stages (1F1B): whole params in and
  out, equal to one device with ``freeze(adamw, "embed/")``; the state
  dict has the whole params and no optimizer state for the embedding,
  and loads back; a metrics function sees the whole params."""
  loss_fn, params, batch, _ = flax_models.gpt_case()
  tx = optax.adamw(0.05, weight_decay=0.1)
  pipe = jpipe.Pipeline(
    loss_fn,
    params,
    batch,
    frozen="embed/",
    num_stages=2,
    schedule="1f1b",
    num_microbatches=M,
    optimizer=tx,
  )
  assert all("embed" not in name for name in pipe.leaf_names)
  with pytest.raises(ValueError, match="exactly when the Pipeline was built"):
    pipe.init(params, {"stats": np.zeros(3)})  # (The loss has none.)
  state = pipe.init(params)
  assert pipe.gather_model_state(state) is None
  for _ in range(2):
    state, _ = pipe.step(state, batch)
  want, _ = _reference_steps(
    loss_fn, params, batch, M, freeze(tx, "embed/"), steps=2
  )
  got = pipe.gather_params(state)
  _assert_tree_close(got, want)
  np.testing.assert_array_equal(
    got["params"]["embed"]["embedding"], params["params"]["embed"]["embedding"]
  )
  saved = pipe.state_dict(state)
  assert jax.tree.structure(saved["params"]) == jax.tree.structure(params)
  assert saved["model_state"] is None
  assert "embed" not in str(jax.tree.structure(saved["opt_state"]))
  resumed = pipe.load_state_dict(saved)
  _assert_tree_close(pipe.gather_params(resumed), got)
  layout, needed = pipe.state_dict_layout()
  assert jax.tree.structure(layout["params"]) == jax.tree.structure(params)
  assert all(jax.tree.leaves(needed["params"]))  # (One process: all.)

  def sums_fn(params, batch):  # (Reads the frozen embedding by name.)
    norm = (params["params"]["embed"]["embedding"] ** 2).sum()
    return {"loss": loss_fn(params, batch) * len(batch["tokens"]), "norm": norm}

  sums = pipe.evaluate(state, batch, sums_fn)
  expected = [sums_fn(want, _microbatch(batch, k, M)) for k in range(M)]
  for name in ("loss", "norm"):
    total = sum(float(e[name]) for e in expected)
    assert float(sums[name]) == pytest.approx(total, rel=1e-5)


def test_with_the_models_own_state():
  """A ResNet's BatchNorm statistics beside a frozen convolution:
  ``gather_model_state`` gives the statistics alone, as one device's."""
  loss_fn, params, stats, batch = flax_models.resnet_state_case(num_blocks=2)
  tx = optax.sgd(0.1)
  pipe = jpipe.Pipeline(
    loss_fn,
    params,
    batch,
    model_state=stats,
    frozen="block_0/Conv",
    num_stages=2,
    schedule="1f1b",
    num_microbatches=M,
    optimizer=tx,
  )
  state = pipe.init(params, stats)
  state, _ = pipe.step(state, batch)
  grads, new_stats = [], stats
  for k in range(M):
    (_, new_stats), g = jitted.value_and_grad(loss_fn, has_aux=True)(
      params, new_stats, _microbatch(batch, k, M)
    )
    grads.append(g)
  mean = jax.tree.map(lambda *g: sum(g) / M, *grads)
  frozen_tx = freeze(tx, "block_0/Conv")
  updates, _ = frozen_tx.update(mean, frozen_tx.init(params), params)
  _assert_tree_close(
    pipe.gather_params(state), optax.apply_updates(params, updates)
  )
  _assert_tree_close(pipe.gather_model_state(state), new_stats)
  saved = pipe.state_dict(state)
  assert jax.tree.structure(saved["model_state"]) == jax.tree.structure(stats)
  again = pipe.load_state_dict(saved)
  _assert_tree_close(pipe.gather_model_state(again), new_stats)


def test_generate_sees_the_whole_params():
  """jpipe's GPT-2 with its tied embedding frozen decodes through 2
  stages as the one-device greedy loop does (its decode_fn reads the
  whole params)."""
  model, params, prompts = test_generate._tiny()
  pipe, state = test_generate._pipeline(
    model, params, prompts, 2, frozen="wte/"
  )
  got = test_generate._generate(pipe, state, model, prompts, 4)
  want = test_generate._greedy_recomputing(model, params, prompts, 4)
  np.testing.assert_array_equal(got, want)


def test_state_dicts_move_between_frozen_sets():
  """Train the head frozen-body, then unfreeze (ULMFiT's gradual
  unfreezing), or freeze more: a state dict loads into a pipeline of
  another frozen set. Leaves trained in both keep their saved optimizer
  state; newly trained ones start theirs fresh, as at init (zeros for
  Adam's moments); the newly frozen ones' is dropped. (Each direction
  was "the saved optimizer state lacks [...]".)"""
  loss_fn, params, batch, _ = flax_models.mlp_case()

  def pipeline(frozen):
    return jpipe.Pipeline(
      loss_fn,
      params,
      batch,
      frozen=frozen,
      num_stages=2,
      num_microbatches=M,
      optimizer=optax.adam(0.01),
    )

  body = "dense_[0-3]/"
  frozen, free, other = pipeline(body), pipeline(None), pipeline("dense_[4-6]/")
  state, _ = frozen.step(frozen.init(params), batch)
  saved = frozen.state_dict(state)
  mu = saved["opt_state"][0].mu
  for target in (free, other, frozen):
    loaded = target.load_state_dict(saved)
    target.step(loaded, batch)  # (It trains.)
    got = target.state_dict(loaded)["opt_state"][0].mu
    kept = fresh = 0
    for key in target.leaf_names:
      if key in mu:  # Trained before: its moments kept.
        np.testing.assert_array_equal(got[key], mu[key])
        kept += 1
      else:  # Frozen before: fresh.
        assert not np.any(got[key]), key
        fresh += 1
    # (Leaves: 8 layers x 2; saved with moments: dense_4-6 and head.)
    want = {id(free): (8, 8), id(other): (2, 8), id(frozen): (8, 0)}
    assert (kept, fresh) == want[id(target)]
    _assert_tree_close(target.gather_params(loaded), saved["params"])
  back = frozen.load_state_dict(free.state_dict(free.init(params)))
  _assert_tree_close(frozen.gather_params(back), params)
