"""What ``init``, ``load_state_dict`` and ``step`` accept. Params of
other dtypes than the pipeline was built with: floating leaves cast to the
built dtypes (a float32 checkpoint into a bfloat16 pipeline), anything
else refused by name (an outside check found a reshape error, packed small
leaves, or a silent float32 run with half the predicted memory). Params of
other shapes or structure, another optimizer's state dict, another
pipeline's state, a call inside jax.jit: one line each (outside checks of
the library API found silent training on a transposed kernel and
JAX-internal or optax-internal errors)."""

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


def _pipeline(dtype, optimizer=None, num_stages=2):
  model = _Dense4(dtype)
  x = jax.random.normal(jax.random.key(0), (8, 16))
  params = model.init(jax.random.key(1), x)

  def loss_fn(params, batch):
    return (model.apply(params, batch["x"]).astype(jnp.float32) ** 2).mean()

  pipe = jpipe.Pipeline(
    loss_fn,
    params,
    {"x": x},
    num_stages=num_stages,
    devices=jax.devices()[:num_stages],
    num_microbatches=2,
    optimizer=optimizer or optax.sgd(0.1, momentum=0.9),
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


def test_params_of_other_shapes_or_structure_are_refused_by_name():
  """``init`` checks what it is given against the params the pipeline was
  built with: a transposed kernel (it once trained as a reshape of
  itself where leaves are packed), a leaf of another size (a reshape
  error at the first step), an extra leaf (silently dropped) or a renamed
  one -- each one line naming the leaf; the same params of another init
  are fine."""
  pipe, params, batch = _pipeline("float32")
  inner = params["params"]

  def changed(**layers):
    return {"params": {**inner, **layers}}

  d0 = inner["d0"]
  cases = [
    (
      changed(d0={**d0, "kernel": d0["kernel"][:, :8]}),
      r"param params/d0/kernel has shape \(16, 8\), the pipeline was "
      r"built with \(16, 16\)$",
    ),
    (
      changed(d1={**inner["d1"], "bias": inner["d1"]["bias"][:15]}),
      r"param params/d1/bias has shape \(15,\), the pipeline was built "
      r"with \(16,\)$",
    ),
    (changed(zzz={"w": np.ones(3)}), r"not in the model: \['params/zzz/w'\]"),
    (
      {"params": {("a" if k == "d0" else k): v for k, v in inner.items()}},
      r"not in the model: \['params/a/bias', 'params/a/kernel'\]; missing: "
      r"\['params/d0/bias', 'params/d0/kernel'\]",
    ),
  ]
  for bad, message in cases:
    with pytest.raises(ValueError, match=message):
      pipe.init(bad)
  rect = jpipe.Pipeline(
    lambda p, b: (b["x"] @ p["w"].T).sum(),
    {"w": np.ones((3, 16), np.float32)},
    batch,
    num_stages=1,
    devices=jax.devices()[:1],
    optimizer=optax.sgd(0.1),
  )
  with pytest.raises(ValueError, match=r"\(transposed: a PyTorch Linear"):
    rect.init({"w": np.ones((16, 3), np.float32)})
  other = jax.tree.map(lambda x: x + 1, params)  # Another init: fine.
  pipe.step(pipe.init(other), batch)


def test_another_optimizers_state_dict_names_both_states():
  """SGD-with-momentum's state loaded into an Adam pipeline: the error
  names both states (it was "int() argument must be ... not
  'builtin_function_or_method'": the saved TraceState's tuple.count
  taken for Adam's count field)."""
  pipe, params, batch = _pipeline("float32")
  state, _ = pipe.step(pipe.init(params), batch)
  saved = pipe.state_dict(state)
  adam, _, _ = _pipeline("float32", optax.adam(0.01))
  with pytest.raises(
    ValueError,
    match="has TraceState where this optimizer's has ScaleByAdamState "
    "\\(its field 'count'\\): it was saved for another optimizer",
  ):
    adam.load_state_dict(saved)


def test_a_pipeline_called_inside_jit_says_so():
  """jax.jit(pipe.step) (an expert's first reflex): one line saying the
  pipeline dispatches its own programs (it was JAX's "get_mesh can only
  be used outside of jax.jit")."""
  pipe, params, batch = _pipeline("float32")
  state = pipe.init(params)
  with pytest.raises(TypeError, match=r"jpipe's step\(\) was called inside"):
    jax.jit(pipe.step)(state, batch)


def test_another_pipelines_state_is_refused_at_step():
  """A state of a pipeline with other stages, or another optimizer: the
  step says so (it met an IndexError, or optax's AttributeError)."""
  pipe, params, batch = _pipeline("float32")
  adam, _, _ = _pipeline("float32", optax.adam(0.01))
  four, _, _ = _pipeline("float32", num_stages=4)
  with pytest.raises(
    ValueError, match=r"another pipeline's \(4 stages, this pipeline has 2\)"
  ):
    pipe.step(four.init(params), batch)
  with pytest.raises(
    ValueError, match=r"another pipeline's \(stage 0, 1's params or optimizer"
  ):
    adam.step(pipe.init(params), batch)
  state, _ = adam.step(adam.init(params), batch)  # Its own: fine.
  with pytest.raises(ValueError, match="not a PipelineState"):
    adam.step({"params": params}, batch)


def test_an_optimizer_factory_instead_of_an_optimizer_says_so():
  """optimizer=optax.sgd (not called): one line naming the call (it was
  "'function' object has no attribute 'init'" deep in the build)."""
  with pytest.raises(
    TypeError, match=r"optax.sgd\(...\), called: sgd is its factory"
  ):
    _pipeline("float32", optax.sgd)


def test_a_weakly_typed_param_passes_the_own_state_check():
  """A scalar param made from a Python float is weakly typed, and its
  optimizer state packs otherwise than one made on shapes: the state check
  compares the unpacked structure (GNMT's attention scale failed a step of
  its own state)."""
  params = {
    "a": jnp.ones((16, 16)),
    "b": jnp.ones((16, 16)),
    "g": jnp.asarray(0.5),  # (weak_type=True)
  }

  def loss_fn(p, batch):
    with jax.named_scope("first"):
      h = jnp.tanh(batch["x"] @ p["a"])
    with jax.named_scope("second"):
      return ((p["g"] * h @ p["b"]) ** 2).mean()

  x = {"x": jnp.ones((8, 16))}
  pipe = jpipe.Pipeline(
    loss_fn,
    params,
    x,
    num_stages=2,
    devices=jax.devices()[:2],
    num_microbatches=2,
    optimizer=optax.adam(0.01),
  )
  state, _ = pipe.step(pipe.init(params), x)
  pipe.step(state, x)
