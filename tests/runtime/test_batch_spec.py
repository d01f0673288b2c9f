"""Every batch like the example batch the pipeline was built with (its
size aside), and a loss_fn's output as a Pipeline takes it: mistakes
named in one line before any work (``build/batches.py``: ``BatchSpec``)."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jpipe
from jpipe.runtime.build.batches import BatchSpec
from tests.partition import flax_models


def _pipeline(loss_fn=None, batch=None, **options):
  case_loss, params, case_batch, _ = flax_models.mlp_case()
  return (
    jpipe.Pipeline(
      loss_fn or case_loss,
      params,
      case_batch if batch is None else batch,
      num_stages=2,
      devices=jax.devices()[:2],
      num_microbatches=2,
      optimizer=optax.sgd(0.1),
      **options,
    ),
    params,
    case_batch,
  )


def test_the_spec_is_the_example_batch_without_its_size():
  keys = jax.random.split(jax.random.key(0), 8)  # (Dropout keys.)
  batch = {"k": keys, "x": np.zeros((8, 3, 2), np.float64), "y": np.arange(8)}
  spec = BatchSpec.of(batch)
  assert spec.paths == ("['k']", "['x']", "['y']")
  assert spec.shapes == ((), (3, 2), ())
  # As a device stores them (x64 off): 64-bit NumPy leaves in 32 bits.
  assert spec.dtypes == (keys.dtype, jnp.float32, jnp.int32)
  spec.check({"k": keys[:4], "x": jnp.zeros((4, 3, 2)), "y": jnp.arange(4)})


@pytest.mark.parametrize(
  "leaf, message",
  [
    ("abc", r"batch leaf \['bad'\] is of type str, not an array"),
    (3, r"batch leaf \['bad'\] is of type int, not an array"),
    (jnp.float32(3), r"batch leaf \['bad'\] is a scalar"),
  ],
)
def test_an_example_batch_leaf_without_a_batch_axis_is_named(leaf, message):
  batch = flax_models.mlp_case()[2]
  with pytest.raises(ValueError, match=message):
    _pipeline(batch={**batch, "bad": leaf})


def test_a_step_batch_unlike_the_example_is_named():
  pipe, params, batch = _pipeline()
  state = pipe.init(params)
  with pytest.raises(ValueError, match="structured unlike the example"):
    pipe.step(state, {"x": batch["x"]})
  with pytest.raises(
    ValueError, match=r"batch leaf \['x'\] is float16\[8, 12\], the example"
  ):
    pipe.step(state, {**batch, "x": batch["x"].astype(jnp.float16)})
  with pytest.raises(ValueError, match=r"example batch's float32\[batch, 12\]"):
    pipe.step(state, {**batch, "x": batch["x"][:, :6]})
  # NumPy's own dtypes, as the device stores them, and another size: run.
  host = jax.tree.map(np.asarray, batch)
  state, metrics = pipe.step(state, {**host, "x": host["x"].astype(np.float64)})
  pipe.step(state, jax.tree.map(lambda x: x[:4], batch))
  assert np.isfinite(metrics["loss"])


@pytest.mark.parametrize("model_state", [False, True])
def test_a_loss_with_aux_outputs_names_what_a_pipeline_takes(model_state):
  case_loss, params, batch, _ = flax_models.mlp_case()
  if model_state:
    loss_fn = lambda p, s, b: (case_loss(p, b), s, {"extra": 1.0})  # noqa: E731
    options = {"model_state": {"count": jnp.zeros(())}}
    want = r"loss_fn\(params, model_state, batch\) returns \(loss, new_model"
  else:
    loss_fn = lambda p, b: (case_loss(p, b), {"mae": 0.0})  # noqa: E731
    options = {}
    want = r"loss_fn\(params, batch\) returns the loss alone"
  with pytest.raises(ValueError, match=want) as e:
    _pipeline(loss_fn, **options)
  assert "metrics_fn to pipe.evaluate" in str(e.value)


def test_a_loss_taking_the_other_convention_names_model_state():
  """A loss taking (params, model_state, batch) without model_state=
  (``jpipe.nnx_loss``'s, forgotten), or model_state= beside a loss
  taking (params, batch): one line naming the option, before tracing."""
  case_loss, params, batch, _ = flax_models.mlp_case()

  def with_state(params, model_state, batch):
    return case_loss(params, batch), model_state

  with pytest.raises(ValueError, match="no model_state was given: pass"):
    _pipeline(with_state)
  with pytest.raises(ValueError, match="loss_fn takes \\(params, batch\\)"):
    _pipeline(case_loss, model_state={"count": jnp.zeros(())})
  # Variadic and defaulted signatures bind either way: left to the trace.
  _pipeline(lambda p, b, extra=None: case_loss(p, b))
  _pipeline(lambda *a: case_loss(*a))
