"""Optax masks and labels written for the whole model apply through the
pipeline as on one device: each stage's optimizer sees its leaves where
the model declares them (``runtime/build/params_view.py``)."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import traverse_util

import jpipe
from tests import jitted


class _Blocks(nn.Module):
  @nn.compact
  def __call__(self, x):
    for i in range(4):
      x = x + nn.Dense(8, name=f"d{i}")(nn.LayerNorm(name=f"ln{i}")(x))
    return nn.Dense(1, name="head")(x)


class _ScanBlock(nn.Module):
  @nn.compact
  def __call__(self, x, _):
    return x + nn.Dense(8)(nn.LayerNorm()(x)), None


class _Scanned(nn.Module):
  @nn.compact
  def __call__(self, x):
    x = nn.Dense(8, name="stem")(x)
    stack = nn.scan(
      _ScanBlock,
      variable_axes={"params": 0},
      split_rngs={"params": True},
      length=4,
    )
    x, _ = stack(name="layers")(x, None)
    return nn.Dense(1, name="head")(x)


def _problem(model):
  x = jax.random.normal(jax.random.key(1), (8, 8))
  batch = {"x": x, "y": jnp.sin(x[:, :1])}
  params = model.init(jax.random.key(0), x)["params"]

  def loss_fn(p, b):
    return jnp.mean((model.apply({"params": p}, b["x"]) - b["y"]) ** 2)

  return loss_fn, params, batch


def hf_decay_mask(params):
  """HuggingFace's Flax examples' weight-decay mask (run_mlm_flax.py):
  no decay for biases and LayerNorm scales, by path."""
  flat = traverse_util.flatten_dict(params)
  mask = {
    path: path[-1] != "bias"
    and path[-2:] != ("LayerNorm_0", "scale")
    and not path[-2].startswith("ln")
    for path in flat
  }
  return traverse_util.unflatten_dict(mask)


def _freeze(params, frozen):
  """``optax.multi_transform`` freezing the top-level modules ``frozen``
  (labels as a whole-model tree of prefixes)."""
  labels = {k: "frozen" if k in frozen else "train" for k in params}
  return optax.multi_transform(
    {"train": optax.adam(0.05), "frozen": optax.set_to_zero()}, labels
  )


def _pipeline(loss_fn, params, batch, schedule, tx):
  """The 3-stage pipeline every case runs, 2 microbatches."""
  return jpipe.Pipeline(
    loss_fn,
    params,
    batch,
    num_stages=3,
    devices=jax.devices()[:3],
    schedule=schedule,
    num_microbatches=2,
    optimizer=tx,
  )


def _one_device(loss_fn, params, batch, tx, steps):
  opt_state = tx.init(params)
  for _ in range(steps):
    grads = jitted.grad(loss_fn)(params, batch)
    updates, opt_state = tx.update(grads, opt_state, params)
    params = optax.apply_updates(params, updates)
  return params


def _assert_close(a, b):
  for path, x in jax.tree_util.tree_flatten_with_path(a)[0]:
    y = b
    for key in path:
      y = y[key.key]
    np.testing.assert_allclose(
      x, y, rtol=2e-5, atol=2e-6, err_msg=jax.tree_util.keystr(path)
    )


CASES = {
  "adamw, mask as a whole-model tree": (
    _Blocks,
    lambda p: optax.adamw(
      0.05,
      weight_decay=0.5,
      mask=jax.tree_util.tree_map_with_path(
        lambda path, _: path[-1].key == "kernel", p
      ),
    ),
  ),
  "adamw, HuggingFace's mask function, scanned layers split": (
    _Scanned,
    lambda p: optax.adamw(0.05, weight_decay=0.5, mask=hf_decay_mask),
  ),
  "multi_transform, a module frozen by a label tree": (
    _Blocks,
    lambda p: _freeze(p, {"d0", "ln0"}),
  ),
}


@pytest.mark.parametrize("case", list(CASES))
def test_a_1f1b_pipeline_steps_as_one_device_with_whole_model_masks(case):
  model, make_tx = CASES[case]
  loss_fn, params, batch = _problem(model())
  tx = make_tx(params)
  pipe = _pipeline(loss_fn, params, batch, "1f1b", tx)
  state = pipe.init(params)
  for _ in range(2):
    state, _ = pipe.step(state, batch)
  _assert_close(
    pipe.gather_params(state), _one_device(loss_fn, params, batch, tx, 2)
  )


def test_a_stream_leaves_frozen_modules_as_they_were_and_resumes():
  """Asynchronous: the labels freeze the stem and the stacked layers'
  rows train, whichever stage holds them; a state dict saved and loaded
  steps on as the original does."""
  loss_fn, params, batch = _problem(_Scanned())
  pipe = _pipeline(loss_fn, params, batch, "async", _freeze(params, {"stem"}))
  assert len(set(pipe.plan.stage_of_node[1:5])) > 1  # The scan is split.
  state = pipe.init(params)
  for _ in range(2):
    state, _ = pipe.step(state, batch)
  state, _ = pipe.flush(state)
  trained = pipe.gather_params(state)
  for a, b in zip(
    jax.tree.leaves(trained["stem"]),
    jax.tree.leaves(params["stem"]),
    strict=True,
  ):
    np.testing.assert_array_equal(a, b)
  for a, b in zip(
    jax.tree.leaves(trained["layers"]),
    jax.tree.leaves(params["layers"]),
    strict=True,
  ):
    assert np.all(
      np.any(np.asarray(a) != np.asarray(b), axis=tuple(range(1, a.ndim)))
    )
  saved = pipe.state_dict(state)
  moments = saved["opt_state"].inner_states["train"].inner_state[0].mu
  assert moments["layers/Dense_0/kernel"].shape == (4, 8, 8)  # Stacked.
  resumed = pipe.load_state_dict(saved)
  state, _ = pipe.step(state, batch)
  resumed, _ = pipe.step(resumed, batch)
  state, _ = pipe.flush(state)
  resumed, _ = pipe.flush(resumed)
  _assert_close(pipe.gather_params(resumed), pipe.gather_params(state))


def test_adafactor_over_split_scanned_layers_saves_and_resumes():
  """Adafactor keeps one (1,) value for an unfactored leaf: a stage of
  a stacked leaf's rows stores it per row, and a state dict of those
  reads back into the rows (it failed before: () against (1,)). Its
  row-wise form: the default's block-RMS clip and parameter scale read
  every row (refused, ``test_row_locality.py``)."""
  loss_fn, params, batch = _problem(_Scanned())
  tx = optax.adafactor(
    0.05, clipping_threshold=None, multiply_by_parameter_scale=False
  )
  pipe = _pipeline(loss_fn, params, batch, "1f1b", tx)
  state, _ = pipe.step(pipe.init(params), batch)
  resumed = pipe.load_state_dict(pipe.state_dict(state))
  state, _ = pipe.step(state, batch)
  resumed, _ = pipe.step(resumed, batch)
  _assert_close(pipe.gather_params(resumed), pipe.gather_params(state))
