"""The README's Python snippets run as written.

A user copies them first. Each block runs with only the names its prose
says the user brings (a loss, its params, a batch; an NNX model), defined
here on the smallest models; whatever the snippet imports or computes
itself it must do itself. The blocks run in order in one namespace, as
the README reads (the replicated-stage block replaces the pipeline above
it). The fine-tuning block is left out: it needs transformers < 5 and a
GPT-2 checkpoint on disk (``tests/models/test_hf_flax.py`` covers it).
"""

import re
from pathlib import Path

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

README = Path(__file__).resolve().parents[1] / "README.md"
BATCH = 64  # The async block asks for 64 microbatches.


def _python_blocks() -> list[str]:
  return re.findall(r"```python\n(.*?)```", README.read_text(), re.S)


class _MLP(nn.Module):
  @nn.compact
  def __call__(self, x):
    for i in range(8):
      x = nn.tanh(nn.Dense(8, name=f"dense_{i}")(x))
    return nn.Dense(3, name="head")(x)


class _NnxMLP(nnx.Module):
  def __init__(self, rngs):
    self.layers = nnx.List(
      [nnx.Linear(4 if i == 0 else 8, 8, rngs=rngs) for i in range(4)]
    )
    self.head = nnx.Linear(8, 3, rngs=rngs)

  def __call__(self, x):
    for layer in self.layers:
      x = nnx.tanh(layer(x))
    return self.head(x)


def _batch(seed):
  x = jax.random.normal(jax.random.key(seed), (BATCH, 4))
  y = jax.random.randint(jax.random.key(seed + 1), (BATCH,), 0, 3)
  return {"x": x, "y": y}


def _linen_context():
  """What the partitioner and pipeline snippets say the user brings."""
  model = _MLP()
  batch = _batch(0)
  params = model.init(jax.random.key(0), batch["x"][:1])["params"]

  def loss_fn(params, batch):
    logits = model.apply({"params": params}, batch["x"])
    return optax.softmax_cross_entropy_with_integer_labels(
      logits, batch["y"]
    ).mean()

  def metrics_fn(params, batch):
    logits = model.apply({"params": params}, batch["x"])
    correct = jnp.sum(jnp.argmax(logits, -1) == batch["y"])
    return {"correct": correct, "count": jnp.float32(len(batch["y"]))}

  def predict_fn(params, batch):
    return model.apply({"params": params}, batch["x"])

  return {
    "loss_fn": loss_fn,
    "params": params,
    "batch": batch,
    "example_batch": batch,
    "batches": [_batch(2), _batch(4)],
    "metrics_fn": metrics_fn,
    "predict_fn": predict_fn,
  }


def _nnx_context():
  def loss_fn(model, batch):
    return optax.softmax_cross_entropy_with_integer_labels(
      model(batch["x"]), batch["y"]
    ).mean()

  return {"model": _NnxMLP(nnx.Rngs(0)), "loss_fn": loss_fn}


def test_the_readme_has_the_blocks_this_test_runs():
  blocks = _python_blocks()
  assert len(blocks) == 7, "a Python block was added: run it here too"
  assert "FlaxGPT2LMHeadModel" in blocks[6]


def test_the_staleness_snippet_runs_with_params_and_gradients():
  params = {"w": jnp.ones((3, 2)), "b": jnp.zeros(2)}
  space = {
    "params": params,
    "grads": jax.tree.map(lambda p: 0.5 * jnp.ones_like(p), params),
    "delay": 2,
    "microbatch": 0,
  }
  exec(_python_blocks()[0], space)
  # A delay-2 prediction from a fresh momentum state moves nothing; the
  # updates are the stepped gradient (no gap yet).
  jax.tree.map(np.testing.assert_array_equal, space["forward_params"], params)
  np.testing.assert_allclose(space["updates"]["w"], -0.05 * np.ones((3, 2)))
  # The gap from the gradient at delay 0: none either.
  np.testing.assert_allclose(space["grad_updates"]["w"], space["updates"]["w"])


def test_the_partitioner_and_pipeline_snippets_run_in_order(
  tmp_path, monkeypatch
):
  monkeypatch.chdir(tmp_path)  # (The async block draws timeline.png.)
  blocks = _python_blocks()
  space = _linen_context()
  loss_fn, params, batch = space["loss_fn"], space["params"], space["batch"]
  exec(blocks[1], space)  # The partitioner.
  expected, grads = jax.value_and_grad(loss_fn)(params, batch)
  assert float(space["loss"]) == pytest.approx(float(expected), rel=1e-5)
  jax.tree.map(
    lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6),
    space["grads"],
    grads,
  )
  exec(blocks[2], space)  # A 4-stage 1F1B pipeline, one step.
  assert float(space["metrics"]["loss"]) == pytest.approx(
    float(expected), rel=1e-5
  )
  space["params"] = params
  exec(blocks[3], space)  # Its first stage replicated.
  assert space["pipe"].plan.stage_devices[0] == (0, 1)
  exec(blocks[5], space)  # The async stream, evaluation, a timeline.
  assert (tmp_path / "timeline.png").stat().st_size > 0
  assert float(space["sums"]["count"]) == BATCH
  assert np.shape(space["logits"]) == (BATCH, 3)


def test_the_nnx_snippet_runs_on_a_model_of_params_only():
  space = {**_nnx_context(), "batch": _batch(0), "example_batch": _batch(0)}
  before = np.array(space["model"].head.kernel[...])
  # (The pipeline section's first block imported these.)
  exec("import jpipe, optax\n" + _python_blocks()[4], space)
  after = nnx.state(space["model"], nnx.Param)
  jax.tree.map(
    np.testing.assert_array_equal,
    after,
    space["pipe"].gather_params(space["state"]),
  )
  assert not np.allclose(before, space["model"].head.kernel[...])
