"""``Pipeline.evaluate``: the loss forward through the stages, nothing
gathered, nothing changed."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jpipe
from tests.partition import flax_models
from tests.runtime.test_pipeline_sync import _microbatch, _reference_steps
from tests.tiers import slow


def _mean_loss(loss_fn, params, batch, m, *state):
  """The microbatches' mean loss on one device, by plain JAX."""
  losses = []
  for k in range(m):
    out = loss_fn(params, *state, _microbatch(batch, k, m))
    losses.append(out[0] if state else out)
  return float(np.mean(losses))


@pytest.mark.parametrize(
  "case, schedule, stages, devices",
  [
    ("mlp", "1f1b", 3, 3),
    slow("gpt_tied", "gpipe", 4, 4),  # A tied embedding on two stages.
    slow("encoder_decoder", "1f1b", 3, 3),  # Encoder output to every stage.
    slow("gpt_tied", "zbv", 4, 2),  # Two stages a device, in a V.
  ],
)
def test_evaluate_is_the_loss_at_the_params_never_gathered(
  case, schedule, stages, devices
):
  """Before and after two steps, ``evaluate`` equals the mean loss at the
  single-device reference's params (the pipeline's are never gathered);
  it changes nothing: the next step is the one it would have been."""
  loss_fn, params, batch, _ = flax_models.CASES[case]()
  tx = optax.adam(1e-2)
  pipe = jpipe.Pipeline(
    loss_fn,
    params,
    batch,
    num_stages=stages,
    devices=jax.devices()[:devices],
    schedule=schedule,
    num_microbatches=4,
    optimizer=tx,
  )
  state = pipe.init(params)
  got = float(pipe.evaluate(state, batch)["loss"])
  assert got == pytest.approx(_mean_loss(loss_fn, params, batch, 4), 1e-5)
  for _ in range(2):
    state, _ = pipe.step(state, batch)
  expected, _ = _reference_steps(loss_fn, params, batch, 4, tx, steps=2)
  at_two = _mean_loss(loss_fn, expected, batch, 4)
  assert float(pipe.evaluate(state, batch)["loss"]) == pytest.approx(
    at_two, 1e-5
  )
  # Another microbatch count, the same microbatch size: half the batch.
  half = jax.tree.map(lambda x: x[: len(x) // 2], batch)
  got = float(pipe.evaluate(state, half)["loss"])
  assert got == pytest.approx(_mean_loss(loss_fn, expected, half, 2), 1e-5)
  # The third step's forwards see the params two steps left, untouched.
  _, metrics = pipe.step(state, batch)
  assert float(metrics["loss"]) == pytest.approx(at_two, rel=1e-5)


def test_evaluate_reads_batchnorm_statistics_without_updating_them():
  loss_fn, params, stats, batch = flax_models.resnet_state_case()
  pipe = jpipe.Pipeline(
    loss_fn,
    params,
    batch,
    num_stages=2,
    devices=jax.devices()[:2],
    num_microbatches=2,
    optimizer=optax.sgd(0.1),
    model_state=stats,
  )
  state = pipe.init(params, stats)
  before = pipe.gather_model_state(state)
  got = float(pipe.evaluate(state, batch)["loss"])
  assert got == pytest.approx(
    _mean_loss(loss_fn, params, batch, 2, stats), 1e-5
  )
  after = pipe.gather_model_state(state)
  for a, b in zip(jax.tree.leaves(before), jax.tree.leaves(after), strict=True):
    np.testing.assert_array_equal(a, b)


def test_evaluate_in_the_middle_of_an_async_stream():
  """Mid-stream, each stage's newest params (a stream in flight is left
  as it was: the next step continues it); after a flush, the loss at the
  params the flush left."""
  loss_fn, params, batch, _ = flax_models.CASES["mlp"]()
  pipe = jpipe.Pipeline(
    loss_fn,
    params,
    batch,
    num_stages=3,
    devices=jax.devices()[:3],
    schedule="async",
    num_microbatches=4,
    optimizer=optax.sgd(0.05),
    weight_stashing=True,
  )
  state = pipe.init(params)
  state, _ = pipe.step(state, batch)
  assert not state.in_flight.drained
  mid = float(pipe.evaluate(state, batch)["loss"])
  newest = [tuple(p) for p in state.stage_params]
  assert np.isfinite(mid)
  continued, _ = pipe.step(state, batch)
  drained, _ = pipe.flush(continued)
  gathered = pipe.gather_params(drained)
  got = float(pipe.evaluate(drained, batch)["loss"])
  assert got == pytest.approx(_mean_loss(loss_fn, gathered, batch, 4), 1e-5)
  # Mid-stream it read the stages' newest params, as the stages held them.
  for s, p in enumerate(newest):
    for a, b in zip(p, state.stage_params[s], strict=True):
      assert a is b
  assert mid == pytest.approx(float(pipe.evaluate(state, batch)["loss"]), rel=0)


def test_evaluate_rejects_a_batch_of_another_microbatch_size():
  loss_fn, params, batch, _ = flax_models.CASES["mlp"]()
  pipe = jpipe.Pipeline(
    loss_fn,
    params,
    batch,
    num_stages=2,
    devices=jax.devices()[:2],
    num_microbatches=4,
    optimizer=optax.sgd(0.1),
  )
  odd = jax.tree.map(lambda x: jnp.concatenate([x, x[:1]]), batch)
  with pytest.raises(ValueError, match="does not split into microbatches"):
    pipe.evaluate(pipe.init(params), odd)


class _DropoutMLP(nn.Module):
  @nn.compact
  def __call__(self, x, train):
    for i in range(2):
      x = nn.relu(nn.Dense(8, name=f"d{i}")(x))
      x = nn.Dropout(0.5, deterministic=not train)(x)
    return x.sum(-1)


def test_a_batch_with_typed_keys_evaluates_and_predicts_as_it_steps():
  """A batch carrying ``jax.random.key`` dropout keys (typed keys, not
  uint32 data) goes through ``evaluate`` and ``predict`` as through
  ``step``; a batch unlike the example gets ``step``'s clear error."""
  model = _DropoutMLP()
  x = jnp.arange(8 * 4, dtype=jnp.float32).reshape(8, 4) / 32
  batch = {
    "x": x,
    "y": jnp.ones(8),
    "key": jax.random.split(jax.random.key(3), 8),
  }
  params = model.init(jax.random.key(0), x[:1], False)["params"]

  def loss_fn(p, b):
    out = model.apply(
      {"params": p}, b["x"], True, rngs={"dropout": b["key"][0]}
    )
    return jnp.mean((out - b["y"]) ** 2)

  pipe = jpipe.Pipeline(
    loss_fn,
    params,
    batch,
    num_stages=2,
    devices=jax.devices()[:2],
    num_microbatches=4,
    optimizer=optax.sgd(0.1),
  )
  state = pipe.init(params)
  got = float(pipe.evaluate(state, batch)["loss"])
  assert got == pytest.approx(_mean_loss(loss_fn, params, batch, 4), 1e-6)

  def outputs(p, b):
    return model.apply({"params": p}, b["x"], False)

  np.testing.assert_allclose(
    pipe.predict(state, batch, outputs), outputs(params, batch), rtol=1e-6
  )
  sums = pipe.evaluate(state, batch, lambda p, b: {"s": outputs(p, b).sum()})
  assert float(sums["s"]) == pytest.approx(float(outputs(params, batch).sum()))
  without_y = {"x": x, "key": batch["key"]}
  with pytest.raises(ValueError, match="structured unlike the example batch"):
    pipe.evaluate(state, without_y)
