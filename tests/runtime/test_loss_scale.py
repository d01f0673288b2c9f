"""``loss_scale``: static loss scaling for float16 activations. Each
backward starts from the loss cotangent times S and each step divides its
gradient by S (clipping sees the unscaled norm), as on one device: a
power of two changes no bit of a float32 model's steps, float16
cotangents that underflow without it survive with it, and too large a
scale overflows into a skipped step."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jpipe
from tests.partition import flax_models


def _pipeline(
  loss_fn, params, batch, schedule="1f1b", stages=2, optimizer=None, **options
):
  """2 microbatches over ``stages`` stages (a V's two a device)."""
  devices = stages // 2 if schedule in ("zbv", "dualpipev") else stages
  return jpipe.Pipeline(
    loss_fn,
    params,
    batch,
    num_stages=stages,
    devices=jax.devices()[:devices],
    num_microbatches=2,
    optimizer=optimizer or optax.sgd(0.1, momentum=0.9),
    schedule=schedule,
    **options,
  )


def _params_after(pipe, params, batches):
  state = pipe.init(params)
  for batch in batches:
    state, _ = pipe.step(state, batch)
  state, _ = pipe.flush(state)
  return pipe.gather_params(state)


@pytest.mark.parametrize(
  "schedule, options",
  [
    ("1f1b", {}),
    ("1f1b", {"clip_global_norm": 0.05}),
    ("zbv", {}),
    ("async", {"weight_stashing": True}),
    # (Clipped at every step, as here, a gradient's scale cancels: the
    # case checks the stream's norm path, the one above its division.)
    ("async", {"weight_stashing": True, "clip_global_norm": 0.05}),
  ],
)
def test_a_power_of_two_changes_no_bit_of_a_float32_model(schedule, options):
  # Scaling by 2**k and back is exact in floating point (no overflow or
  # underflow here): any step that missed the division, or divided
  # twice, or clipped the scaled norm, would be off by a power of two.
  loss_fn, params, batch, _ = flax_models.CASES["mlp"]()
  stages = 4 if schedule == "zbv" else 2
  batches = [batch, jax.tree.map(lambda x: x[::-1], batch)]
  got = {}
  for scale in (None, 2.0**10):
    pipe = _pipeline(
      loss_fn, params, batch, schedule, stages, loss_scale=scale, **options
    )
    got[scale] = _params_after(pipe, params, batches)
  for x, y in zip(
    jax.tree.leaves(got[None]), jax.tree.leaves(got[2.0**10]), strict=True
  ):
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


class _HalfMLP(nn.Module):
  """Float32 params, float16 activations (Flax's ``dtype``)."""

  @nn.compact
  def __call__(self, x):
    for _ in range(3):
      x = nn.tanh(nn.Dense(8, dtype=jnp.float16)(x))
    return nn.Dense(1, dtype=jnp.float16)(x)


def _half_case():
  model = _HalfMLP()
  x = jax.random.normal(jax.random.key(0), (8, 4))
  y = jax.random.normal(jax.random.key(1), (8, 1))
  batch = {"x": x, "y": y}
  params = model.init(jax.random.key(2), x)["params"]

  def loss_fn(p, b):
    out = model.apply({"params": p}, b["x"]).astype(jnp.float32)
    # A loss this small makes float16 cotangents underflow to zero.
    return 1e-6 * jnp.mean(jnp.square(out - b["y"]))

  return loss_fn, params, batch


def _reference_grads(loss_fn, params, batch, scale, m=2):
  """One device: the microbatches' gradients of ``loss * scale / m``
  (float16 activations alike), summed in float32, then divided by
  ``scale``."""
  grad = jax.jit(jax.grad(lambda p, b: loss_fn(p, b) * (scale / m)))
  size = len(batch["x"]) // m
  micro = [
    jax.tree.map(lambda x, i=i: x[i * size : (i + 1) * size], batch)
    for i in range(m)
  ]
  total = grad(params, micro[0])
  for b in micro[1:]:
    total = jax.tree.map(jnp.add, total, grad(params, b))
  return jax.tree.map(lambda g: g / scale, total)


RATE = 2.0**20


def test_float16_cotangents_survive_the_scale_as_on_one_device():
  loss_fn, params, batch = _half_case()
  scale = 2.0**14
  want = _reference_grads(loss_fn, params, batch, scale)
  lost = _reference_grads(loss_fn, params, batch, 1.0)
  # Why it exists: unscaled, some float16 cotangents underflow to zero.
  zero = sum(int(jnp.sum(g == 0)) for g in jax.tree.leaves(lost))
  assert zero > sum(int(jnp.sum(g == 0)) for g in jax.tree.leaves(want))
  # Plain SGD at rate 2**20 (a gradient ~1e-7 beside params ~0.5 would
  # be lost in their float32 rounding): a step's change is minus its
  # gradient times the rate.
  for s, expect in ((scale, want), (None, lost)):
    pipe = _pipeline(
      loss_fn, params, batch, optimizer=optax.sgd(RATE), loss_scale=s
    )
    new = _params_after(pipe, params, [batch])
    step = jax.tree.map(
      lambda a, b: (np.asarray(a) - np.asarray(b)) / RATE, new, params
    )
    for got, g in zip(
      jax.tree.leaves(step), jax.tree.leaves(expect), strict=True
    ):
      np.testing.assert_allclose(got, -np.asarray(g), rtol=1e-3, atol=1e-12)


def test_an_overflowing_scale_skips_the_step():
  loss_fn, params, batch = _half_case()

  def big(p, b):  # Cotangents past float16's largest number, 65504.
    return loss_fn(p, b) * 1e9

  pipe = _pipeline(
    big, params, batch, loss_scale=2.0**15, skip_nonfinite_steps=True
  )
  start = pipe.init(params)
  state, metrics = pipe.step(start, batch)
  assert bool(metrics["step_skipped"])
  for x, y in zip(
    jax.tree.leaves(pipe.gather_params(state)),
    jax.tree.leaves(params),
    strict=True,
  ):
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
  assert pipe.loss_scale == 2.0**15


@pytest.mark.parametrize("bad", [0, -1.0, float("inf"), float("nan"), "2"])
def test_a_scale_that_is_not_a_positive_number_is_refused(bad):
  loss_fn, params, batch, _ = flax_models.CASES["mlp"]()
  with pytest.raises(ValueError, match="loss_scale must be a finite number"):
    _pipeline(loss_fn, params, batch, loss_scale=bad)


def _restated_scales(initial, interval, factor, floor, finite):
  """jmp's DynamicLossScale, restated: the scale each step used."""
  used, scale, good = [], initial, 0
  for ok in finite:
    used.append(scale)
    if ok:
      good += 1
      if good == interval:
        scale, good = scale * factor, 0
    else:
      scale, good = max(scale / factor, floor), 0
  return used


def test_the_dynamic_rule_is_jmps():
  rule = jpipe.runtime.DynamicLossScale(
    initial=8.0, growth_interval=3, factor=2.0, min_scale=2.0
  )
  rng = np.random.default_rng(0)
  finite = [bool(x) for x in rng.random(200) < 0.7]
  state, used = rule.start(), []
  for ok in finite:
    used.append(state.scale)
    state = rule.adjust(state, ok)
  assert used == _restated_scales(8.0, 3, 2.0, 2.0, finite)
  assert min(used) == 2.0  # (Runs of overflows reach the floor.)
  assert all(np.log2(s) == int(np.log2(s)) for s in used)


def test_a_dynamic_scale_halves_past_overflow_then_trains_as_the_static():
  # The loss is ~1e-6 (float16 cotangents underflow unscaled): a scale
  # of 2**44 overflows them, and halving finds one that does not.
  loss_fn, params, batch = _half_case()
  steps = 16
  rule = jpipe.runtime.DynamicLossScale(initial=2.0**44, growth_interval=100)
  pipe = _pipeline(loss_fn, params, batch, loss_scale=rule)
  assert pipe.skip_nonfinite_steps  # (Implied: how an overflow is survived.)
  state, used, skipped = pipe.init(params), [], []
  for _ in range(steps):
    state, metrics = pipe.step(state, batch)
    used.append(metrics["loss_scale"])
    skipped.append(bool(metrics["step_skipped"]))
  first = skipped.index(False)
  assert first > 0 and not any(skipped[first:]), skipped
  assert used == [2.0**44 / 2**k for k in range(first)] + [used[first]] * (
    steps - first
  )
  assert state.loss_scale == (used[first], steps - first)
  # Skipped steps changed nothing: the finite ones at a static scale.
  # (Skipping too: the same step programs, so the same bits.)
  static = _pipeline(
    loss_fn, params, batch, loss_scale=used[first], skip_nonfinite_steps=True
  )
  want = _params_after(static, params, [batch] * (steps - first))
  for x, y in zip(
    jax.tree.leaves(pipe.gather_params(state)),
    jax.tree.leaves(want),
    strict=True,
  ):
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def test_a_dynamic_scale_grows_resumes_from_the_state_dict_and_changes_no_bit():
  loss_fn, params, batch, _ = flax_models.CASES["mlp"]()
  rule = jpipe.runtime.DynamicLossScale(initial=4.0, growth_interval=2)
  batches = [
    jax.tree.map(lambda x, k=k: jnp.roll(x, k, 0), batch) for k in range(5)
  ]
  pipe = _pipeline(loss_fn, params, batch, loss_scale=rule)
  state, used = pipe.init(params), []
  for b in batches[:3]:
    state, metrics = pipe.step(state, b)
    used.append(metrics["loss_scale"])
  saved = pipe.state_dict(state)
  assert saved["loss_scale"] == {"scale": 8.0, "good_steps": 1}
  # A fresh pipeline (another split) goes on from the saved scale.
  other = _pipeline(loss_fn, params, batch, loss_scale=rule, schedule="gpipe")
  resumed = other.load_state_dict(saved)
  assert resumed.loss_scale == (8.0, 1)
  for b in batches[3:]:
    state, metrics = pipe.step(state, b)
    used.append(metrics["loss_scale"])
    resumed, _ = other.step(resumed, b)
  assert used == [4.0, 4.0, 8.0, 8.0, 16.0]
  assert resumed.loss_scale == state.loss_scale == (16.0, 1)
  # Powers of two on a float32 model: the unscaled steps, to the bit
  # (skipping too: the same step programs); gpipe's sums in another order.
  plain = _pipeline(loss_fn, params, batch, skip_nonfinite_steps=True)
  want = jax.tree.leaves(_params_after(plain, params, batches))
  got = jax.tree.leaves(pipe.gather_params(state))
  for x, y in zip(got, want, strict=True):
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
  got = jax.tree.leaves(other.gather_params(resumed))
  for x, y in zip(got, want, strict=True):
    np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=1e-6)


def test_a_dynamic_scale_on_a_stream_is_refused_naming_the_static_one():
  loss_fn, params, batch, _ = flax_models.CASES["mlp"]()
  with pytest.raises(ValueError, match="synchronous schedule.*give a number"):
    _pipeline(loss_fn, params, batch, loss_scale="dynamic", schedule="async")


def test_a_dynamic_scale_is_in_every_form_of_the_state_dict():
  # (What a checkpoint across processes writes and restores: each
  # process's local state dict and the layout it restores into.)
  loss_fn, params, batch, _ = flax_models.CASES["mlp"]()
  pipe = _pipeline(loss_fn, params, batch, loss_scale="dynamic")
  state, _ = pipe.step(pipe.init(params), batch)
  whole, local = pipe.state_dict(state), pipe.local_state_dict(state)
  layout, needed = pipe.state_dict_layout()
  assert whole["loss_scale"] == {"scale": 2.0**15, "good_steps": 1}
  assert {k: float(v) for k, v in local["loss_scale"].items()} == {
    "scale": 2.0**15,
    "good_steps": 1.0,
  }
  assert jax.tree.structure(local) == jax.tree.structure(layout)
  assert needed["loss_scale"] == {"scale": True, "good_steps": True}
  assert pipe.load_state_dict(local).loss_scale == (2.0**15, 1)
  # Without a dynamic scale, no entry (a static one is the pipeline's).
  plain = _pipeline(loss_fn, params, batch, loss_scale=8.0)
  assert "loss_scale" not in plain.state_dict(plain.init(params))
