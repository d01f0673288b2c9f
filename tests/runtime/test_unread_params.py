"""A param the loss never reads (a model's unused head, a mask token read
only on a branch the loss does not take, as HF's Dinov2 classifier's) is
held by the last stage: stepped with a zero gradient as one device's
optimizer steps it, gathered, saved and loaded with the rest."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jpipe
from jpipe import partition
from tests.runtime.test_pipeline_sync import (
  _assert_tree_close,
  _reference_steps,
)


class MaskedEncoder(nn.Module):
  """Dinov2's shape: ``mask_token`` replaces masked positions, and only a
  call with a mask reads it."""

  @nn.compact
  def __call__(self, x, mask=None):
    token = self.param("mask_token", nn.initializers.normal(1.0), (8,))
    if mask is not None:
      x = jnp.where(mask[..., None], token, x)
    for i in range(3):
      x = jnp.tanh(nn.Dense(8, name=f"layer_{i}")(x))
    return nn.Dense(3, name="head")(x.mean(1))


MODEL = MaskedEncoder()
BATCH = {
  "x": np.random.RandomState(0).randn(8, 4, 8).astype(np.float32),
  "y": np.arange(8, dtype=np.int32) % 3,
}
PARAMS = MODEL.init(jax.random.key(0), BATCH["x"][:2])["params"]


def loss_fn(params, batch):
  logits = MODEL.apply({"params": params}, batch["x"])
  return optax.softmax_cross_entropy_with_integer_labels(
    logits, batch["y"]
  ).mean()


def _pipeline(schedule="1f1b", tx=None):
  return jpipe.Pipeline(
    loss_fn,
    PARAMS,
    BATCH,
    num_stages=2,
    schedule=schedule,
    num_microbatches=2,
    optimizer=tx or optax.adamw(0.1, weight_decay=0.5),
  )


def test_the_definition_of_unread():
  """The leaves no equation reads: exactly ``mask_token``; none of a
  call that reads it."""
  names = [
    "/".join(k.key for k in p) for p, _ in jax.tree.leaves_with_path(PARAMS)
  ]
  traced = partition.trace(loss_fn, PARAMS, BATCH)
  assert [names[i] for i in traced.unread_param_leaves()] == ["mask_token"]

  def masked(params, batch):
    mask = batch["x"][..., 0] > 0
    return MODEL.apply({"params": params}, batch["x"], mask).mean()

  assert partition.trace(masked, PARAMS, BATCH).unread_param_leaves() == ()


@pytest.mark.parametrize("schedule", ["1f1b", "zbh1"])
def test_an_unread_param_trains_as_on_one_device(schedule):
  """AdamW's weight decay moves the never-read token as it does on one
  device; the last stage holds it, and the plan counts its bytes there."""
  tx = optax.adamw(0.1, weight_decay=0.5)
  pipe = _pipeline(schedule, tx)
  token = pipe.leaf_names.index("mask_token")
  assert token in pipe.stages.specs[-1].param_leaves
  assert all(token not in s.param_leaves for s in pipe.stages.specs[:-1])
  last_bytes = sum(
    np.prod(a.shape) * a.dtype.itemsize for a in pipe.stage_param_avals()[-1]
  )
  assert pipe.plan.stage_param_bytes[-1] == last_bytes
  state = pipe.init(PARAMS)
  for _ in range(2):
    state, _ = pipe.step(state, BATCH)
  expected, _ = _reference_steps(loss_fn, PARAMS, BATCH, 2, tx, steps=2)
  got = pipe.gather_params(state)
  _assert_tree_close(got, expected)
  decayed = np.asarray(PARAMS["mask_token"]) * (1 - 0.1 * 0.5) ** 2
  np.testing.assert_allclose(got["mask_token"], decayed, rtol=1e-6)


def test_an_unread_param_is_saved_and_loaded():
  """``state_dict`` holds the token and its optimizer state, and a
  pipeline loads what it saved (a missing leaf made the structures
  differ)."""
  pipe = _pipeline()
  state, _ = pipe.step(pipe.init(PARAMS), BATCH)
  saved = pipe.state_dict(state)
  assert saved["params"]["mask_token"].shape == (8,)
  resumed = pipe.load_state_dict(saved)
  _assert_tree_close(pipe.gather_params(resumed), pipe.gather_params(state))
  state, _ = pipe.step(state, BATCH)
  resumed, _ = pipe.step(resumed, BATCH)
  _assert_tree_close(pipe.gather_params(resumed), pipe.gather_params(state))


def test_a_function_cut_by_the_plan_holds_only_what_it_reads():
  """Evaluation programs (``hold_unread_params`` off) read only what
  they read; the training program's last stage holds the rest."""
  traced = partition.trace(loss_fn, PARAMS, BATCH)
  of = [0] * (traced.num_nodes // 2) + [1] * (
    traced.num_nodes - traced.num_nodes // 2
  )
  (token,) = traced.unread_param_leaves()
  held = partition.Stages(traced, of, hold_unread_params=True)
  cut = partition.Stages(traced, of)
  assert token in held.specs[1].param_leaves
  assert all(token not in s.param_leaves for s in cut.specs)
  assert [s.param_leaves for s in held.specs[:1]] == [
    s.param_leaves for s in cut.specs[:1]
  ]
