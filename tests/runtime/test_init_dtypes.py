"""Params of other dtypes than the pipeline was built with, at ``init`` and
``load_state_dict``: floating leaves cast to the built dtypes (a float32
checkpoint into a bfloat16 pipeline), anything else refused by name. An
outside check found a reshape error (packed small leaves) or a silent
float32 run with half the predicted memory (big leaves)."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jpipe


class _Dense4(nn.Module):
  dtype: str = "bfloat16"

  @nn.compact
  def __call__(self, x):
    for i in range(4):
      x = nn.Dense(16, param_dtype=self.dtype, name=f"d{i}")(x)
    return x


def _pipeline(dtype):
  model = _Dense4(dtype)
  x = jax.random.normal(jax.random.key(0), (8, 16))
  params = model.init(jax.random.key(1), x)

  def loss_fn(params, batch):
    return (model.apply(params, batch["x"]).astype(jnp.float32) ** 2).mean()

  pipe = jpipe.Pipeline(
    loss_fn,
    params,
    {"x": x},
    num_stages=2,
    devices=jax.devices()[:2],
    num_microbatches=2,
    optimizer=optax.sgd(0.1, momentum=0.9),
  )
  return pipe, params, {"x": x}


def _dtypes(tree):
  return {str(x.dtype) for x in jax.tree.leaves(tree)}


@pytest.mark.parametrize(
  "built, given", [("bfloat16", "float32"), ("float32", "bfloat16")]
)
def test_floating_params_are_cast_to_the_built_dtypes(built, given):
  pipe, params, batch = _pipeline(built)
  other = jax.tree.map(lambda x: x.astype(given), params)
  state, _ = pipe.step(pipe.init(other), batch)
  # (What a cast by hand gives: the same numbers.)
  by_hand = jax.tree.map(lambda x: x.astype(built), other)
  expected, _ = pipe.step(pipe.init(by_hand), batch)
  got = pipe.gather_params(state)
  assert _dtypes(got) == {built}
  for a, b in zip(
    jax.tree.leaves(got),
    jax.tree.leaves(pipe.gather_params(expected)),
    strict=True,
  ):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  assert sum(m.params for m in pipe.memory) == sum(
    x.nbytes for x in jax.tree.leaves(got)
  )


def test_a_float32_state_dict_loads_into_a_bfloat16_pipeline():
  """Fine-tuning in bfloat16 from a float32 run's state: params and
  optimizer state in the bfloat16 pipeline's dtypes, and it steps."""
  pipe32, params32, batch = _pipeline("float32")
  pipe16, _, _ = _pipeline("bfloat16")
  state32, _ = pipe32.step(pipe32.init(params32), batch)
  state16 = pipe16.load_state_dict(pipe32.state_dict(state32))
  saved = pipe16.state_dict(state16)
  assert _dtypes(saved["params"]) == {"bfloat16"}
  assert _dtypes(saved["opt_state"]) == {"bfloat16"}
  state16, metrics = pipe16.step(state16, batch)
  assert np.isfinite(float(metrics["loss"]))


def test_other_kinds_of_dtype_are_refused_by_name():
  pipe, params, _ = _pipeline("bfloat16")
  ints = jax.tree.map(lambda x: x.astype(jnp.int32), params)
  with pytest.raises(
    ValueError,
    match=r"param params/d0/bias is int32, the pipeline was built with bfloat16",
  ):
    pipe.init(ints)
