"""grad_accum_dtype: microbatch gradients of bfloat16 params summed in
float32, as one device summing ``grad.astype(float32)`` in a loop would.

The model multiplies by weights of 1 (every product exact in bfloat16),
so each microbatch's gradient is exact whatever the stage split, and only
the accumulation rounds: microbatch 0's examples are 1, the other seven's
2^-8. Each microbatch's gradient of a weight is its examples' mean over
the 8 microbatches: 1/8, then 2^-11 seven times (twice that for the
weight read twice). In bfloat16 every 2^-11 added to 1/8 is half an ulp,
rounded to even: the sum stays 1/8; in float32 it is 1/8 + 7 * 2^-11.
"""

import dataclasses

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jpipe
from jpipe import parallel, runtime
from jpipe.runtime import check_grad_accum_dtype
from tests.tiers import slow

M = 8  # microbatches
SMALL = 2.0**-8
F32_SUM = 1 / 8 + 7 * SMALL / 8  # each weight's mean gradient, float32
BF16_SUM = 1 / 8  # the same summed in bfloat16


class Scale(nn.Module):
  """``x * w``, w of ones (bfloat16)."""

  @nn.compact
  def __call__(self, x):
    w = self.param("w", nn.initializers.ones, (x.shape[-1],), jnp.bfloat16)
    return x * w[None, :]


class ScaleChain(nn.Module):
  """Scale layers; ``tied``: the first one is read again at the end."""

  num_layers: int = 6
  tied: bool = False

  @nn.compact
  def __call__(self, x):
    first = Scale(name="first")
    x = first(x)
    for i in range(self.num_layers):
      x = Scale(name=f"scale_{i}")(x)
    if self.tied:
      x = first(x)
    return x


def _case(tied=False):
  model = ScaleChain(tied=tied)
  x = np.full((2 * M, 4), SMALL, np.float32)
  x[:2] = 1.0  # Microbatch 0's two examples.
  x = jnp.asarray(x, jnp.bfloat16)
  params = model.init(jax.random.key(0), x)

  def loss_fn(params, batch):
    return model.apply(params, batch["x"]).sum(-1).mean()

  return loss_fn, params, {"x": x}


def _pipeline(loss_fn, params, batch, tx, **options):
  return jpipe.Pipeline(
    loss_fn,
    params,
    batch,
    devices=jax.devices()[: options.get("num_stages", 2)],
    num_microbatches=M,
    optimizer=tx,
    **{"num_stages": 2, "schedule": "1f1b", **options},
  )


def _reference_trace(loss_fn, params, batch, dtype):
  """One device: the mean of the microbatch gradients summed in
  ``dtype`` (SGD with momentum's trace after one step)."""
  grad = jax.jit(jax.grad(loss_fn))
  total = None
  for k in range(M):
    mb = jax.tree.map(lambda x, k=k: x[2 * k : 2 * k + 2], batch)
    g = jax.tree.map(lambda x: x.astype(dtype), grad(params, mb))
    total = g if total is None else jax.tree.map(jnp.add, total, g)
  total = jax.tree.map(lambda g: g / M, total)
  tx = optax.sgd(1.0, momentum=0.9)
  _, state = tx.update(total, tx.init(params), params)
  return state[0].trace


def _traces(pipe, state):
  """The momentum trace by leaf path, from the pipeline's state dict."""
  trace = pipe.state_dict(state)["opt_state"][0].trace
  return dict(trace) if isinstance(trace, dict) else trace


def _by_path(tree):
  flat, _ = jax.tree_util.tree_flatten_with_path(tree)
  return {"/".join(str(k.key) for k in path): x for path, x in flat}


@pytest.mark.parametrize(
  "schedule, stages, tied",
  [
    ("1f1b", 2, False),
    ("gpipe", 4, False),
    ("zbh1", 2, False),
    ("1f1b", 2, True),
    slow("gpipe", 4, True),
  ],
)
def test_float32_sums_what_bfloat16_loses(schedule, stages, tied):
  loss_fn, params, batch = _case(tied)
  tx = optax.sgd(1.0, momentum=0.9)
  expected = _by_path(_reference_trace(loss_fn, params, batch, jnp.float32))
  ratio = 2.0 if tied else 1.0
  # The independent reference is the closed form.
  assert float(expected["params/first/w"][0]) == ratio * F32_SUM
  pipe = _pipeline(
    loss_fn,
    params,
    batch,
    tx,
    schedule=schedule,
    num_stages=stages,
    grad_accum_dtype="float32",
  )
  if tied:
    assert pipe.tied.shared  # The first layer's weight is on two stages.
  state, _ = pipe.step(pipe.init(params), batch)
  got = _by_path(_traces(pipe, state))
  assert set(got) == set(expected)
  for path, want in expected.items():
    assert got[path].dtype == np.float32, path  # Promoted, as on one device.
    np.testing.assert_array_equal(np.asarray(got[path]), np.asarray(want))
  # The params stay bfloat16: the float32 update is cast back.
  new = pipe.gather_params(state)
  assert {x.dtype for x in jax.tree.leaves(new)} == {jnp.dtype(jnp.bfloat16)}
  w = float(new["params"]["scale_0"]["w"][0])
  assert w == float(jnp.bfloat16(1.0 - F32_SUM))


def test_default_sums_in_the_params_dtype():
  """Without the option: the bfloat16 sum a one-device loop in the
  params' dtype gives (the small microbatches lost)."""
  loss_fn, params, batch = _case()
  tx = optax.sgd(1.0, momentum=0.9)
  expected = _by_path(_reference_trace(loss_fn, params, batch, jnp.bfloat16))
  assert float(expected["params/scale_0/w"][0]) == BF16_SUM
  pipe = _pipeline(loss_fn, params, batch, tx)
  state, _ = pipe.step(pipe.init(params), batch)
  got = _by_path(_traces(pipe, state))
  for path, want in expected.items():
    assert got[path].dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(got[path]), np.asarray(want))


@pytest.mark.parametrize("step_every", [M, 1])
def test_stream_sums_in_float32(step_every):
  """An asynchronous stream with weight stashing, the learning rate 0
  (every microbatch sees the same weights). A window of M microbatches:
  each stage's one step holds the window's float32 mean. A step per
  microbatch (its backward and step one program): the momentum trace of
  the float32 gradients 1, then 2^-8 seven times."""
  loss_fn, params, batch = _case()
  tx = optax.sgd(0.0, momentum=0.9)
  pipe = _pipeline(
    loss_fn,
    params,
    batch,
    tx,
    schedule="async",
    step_every=step_every,
    weight_stashing=True,
    grad_accum_dtype="float32",
  )
  state, _ = pipe.step(pipe.init(params), batch)
  state, _ = pipe.flush(state)
  want = np.float32(F32_SUM)
  if step_every == 1:
    want = np.float32(0.0)
    for g in [1.0] + [SMALL] * (M - 1):
      want = np.float32(g) + np.float32(0.9) * want
    assert any(k.endswith("_step") for k in pipe.programs.compiled_kinds())
  for path, x in _by_path(_traces(pipe, state)).items():
    assert x.dtype == np.float32, path
    np.testing.assert_allclose(np.asarray(x), np.full(4, want), 1e-6, 0, path)


def test_adam_moments_and_memory_follow_the_gradient():
  """Adam's first moment is float32 from the start, its second
  bfloat16 (what one step makes them on one device), and the memory
  prediction counts the float32 accumulator: twice the bfloat16 params'
  bytes."""
  loss_fn, params, batch = _case()
  tx = optax.adam(1e-2)
  plain = _pipeline(loss_fn, params, batch, tx)
  wide = _pipeline(loss_fn, params, batch, tx, grad_accum_dtype="float32")
  for s in range(2):
    assert wide.memory[s].grads == 2 * plain.memory[s].grads
    assert wide.memory[s].opt_state > plain.memory[s].opt_state
  state = wide.init(params)
  adam = wide.state_dict(state)["opt_state"][0]
  assert {x.dtype for x in jax.tree.leaves(adam.mu)} == {np.dtype(np.float32)}
  assert {x.dtype for x in jax.tree.leaves(adam.nu)} == {jnp.dtype("bfloat16")}
  # Two steps: the one-device float32-accumulated Adam to the last bit.
  reference_params, opt_state = params, tx.init(params)
  grad = jax.jit(jax.grad(loss_fn))
  for _ in range(2):
    state, _ = wide.step(state, batch)
    total = None
    for k in range(M):
      mb = jax.tree.map(lambda x, k=k: x[2 * k : 2 * k + 2], batch)
      g = jax.tree.map(
        lambda x: x.astype(jnp.float32), grad(reference_params, mb)
      )
      total = g if total is None else jax.tree.map(jnp.add, total, g)
    total = jax.tree.map(lambda g: g / M, total)
    updates, opt_state = tx.update(total, opt_state, reference_params)
    reference_params = optax.apply_updates(reference_params, updates)
  for x, y in zip(
    jax.tree.leaves(wide.gather_params(state)),
    jax.tree.leaves(reference_params),
    strict=True,
  ):
    assert x.dtype == y.dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


@pytest.mark.parametrize("bad", ["int32", "bool", "floot32", 3])
def test_a_bad_dtype_is_named(bad):
  with pytest.raises(ValueError, match="grad_accum_dtype=.*floating dtype"):
    check_grad_accum_dtype(bad)


def test_dtypes_read_as_given():
  assert check_grad_accum_dtype(None) is None
  assert check_grad_accum_dtype("") is None
  assert check_grad_accum_dtype(" float32 ") == jnp.float32
  assert check_grad_accum_dtype(jnp.bfloat16) == jnp.bfloat16


@pytest.mark.parametrize("routing", ["split", "round_robin"])
def test_replicated_stage_and_clipping_in_float32(routing):
  """Stage 0 on two devices (each replica's own float32 accumulator,
  summed at the step) and global-norm clipping of the float32 gradient:
  optax.clip_by_global_norm on one device's float32 sum."""
  loss_fn, params, batch = _case()
  tx = optax.sgd(1.0, momentum=0.9)
  plain = _pipeline(loss_fn, params, batch, tx, num_stages=3)
  plan = dataclasses.replace(plain.plan, stage_devices=((0, 1), (2,), (3,)))
  pipe = jpipe.Pipeline(
    loss_fn,
    params,
    batch,
    devices=jax.devices()[:4],
    num_stages=3,
    partition=plan,
    schedule="1f1b",
    num_microbatches=M,
    optimizer=tx,
    replica_routing=routing,
    clip_global_norm=0.1,
    grad_accum_dtype="float32",
  )
  state, _ = pipe.step(pipe.init(params), batch)
  mean = jax.tree.map(lambda x: jnp.full(x.shape, F32_SUM, jnp.float32), params)
  clipped, _ = optax.clip_by_global_norm(0.1).update(mean, None)
  want = _by_path(clipped)
  for path, x in _by_path(_traces(pipe, state)).items():
    assert x.dtype == np.float32, path
    np.testing.assert_allclose(np.asarray(x), np.asarray(want[path]), 1e-6)
    assert abs(float(x[0]) - F32_SUM) > 0.05  # (Clipped.)


def test_data_parallel_allreduce_averages_float32_gradients():
  """Two pipelines (SD-Pipe's allreduce) averaging their float32
  accumulators: each steps on the float32 mean."""
  loss_fn, params, batch = _case()
  tx = optax.sgd(1.0, momentum=0.9)
  dp = parallel.DataParallelPipelines(
    jpipe.PipelineBuilder.of(
      loss_fn,
      params,
      batch,
      num_stages=2,
      schedule="1f1b",
      num_microbatches=M,
      optimizer=tx,
      grad_accum_dtype="float32",
    ),
    pipelines=2,
    sync="allreduce",
    devices=jax.devices()[:4],
  )
  states, _ = dp.step(dp.init(params), [batch, batch])
  states, _ = dp.flush(states)
  for pipe, state in zip(dp.pipelines, states, strict=True):
    for path, x in _by_path(_traces(pipe, state)).items():
      assert x.dtype == np.float32, path
      np.testing.assert_array_equal(np.asarray(x), np.full(4, F32_SUM))


def test_the_partitioners_memory_model_counts_the_wider_gradient():
  """Per bfloat16 param byte: Adam's moments 2 (bfloat16), or 3 after a
  float32 step (optax's first moment follows the gradient to float32, its
  second keeps the params' dtype), and the float32 gradient 1 more than
  the model's own gradient byte."""
  params = {"w": jax.ShapeDtypeStruct((1024,), jnp.bfloat16)}
  kind = jpipe.schedule.REGISTRY["1f1b"]

  def factor(dtype):
    budget = runtime.partitioner_memory_model(
      None,
      optax.adam(1e-3),
      params,
      kind,
      4,
      2,
      recompute=True,
      stashes=False,
      fused_last=False,
      grad_accum_dtype=dtype,
    )
    return budget.optimizer_state_factor

  count = 4 / 2048  # Adam's int32 count per param byte.
  assert factor(None) == pytest.approx(2 + count)
  assert factor(jnp.float32) == pytest.approx(3 + 1 + count)
