"""A loss's aux outputs (``Pipeline(has_aux=True)``): each step's
``metrics["aux"]`` is the mean of every aux leaf over the microbatches
whose forward ran in the call, computed on the stage that makes it --
against a one-device loop over the microbatches; training unchanged."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jpipe
from tests.partition import flax_models
from tests.runtime.test_pipeline_sync import (
  _assert_tree_close,
  _reference_steps,
)


class _SowingMlp(nn.Module):
  """An MLP whose first layer sows the mean of its activation: an aux
  output made on the first stage."""

  @nn.compact
  def __call__(self, x):
    for i in range(4):
      x = nn.relu(nn.Dense(8, name=f"dense_{i}")(x))
      if i == 0:
        self.sow("intermediates", "first_mean", jnp.mean(x))
    return nn.Dense(4, name="head")(x)


def _case():
  """(loss_fn -> (loss, aux), its loss alone, params, batch of 8)."""
  model = _SowingMlp()
  x = jax.random.normal(jax.random.key(0), (8, 6))
  y = jax.random.randint(jax.random.key(1), (8,), 0, 4)
  params = model.init(jax.random.key(2), x)["params"]

  def with_aux(params, batch):
    logits, sown = model.apply(
      {"params": params}, batch["x"], mutable=["intermediates"]
    )
    loss = optax.softmax_cross_entropy_with_integer_labels(
      logits, batch["y"]
    ).mean()
    aux = {
      "accuracy": jnp.mean(jnp.argmax(logits, -1) == batch["y"]),
      "first_mean": sown["intermediates"]["first_mean"][0],
      "logit_sums": jnp.sum(logits, axis=0),  # Not a scalar: shape [4].
      "loss": loss,
      "two": 2.0,  # A constant: a literal of the traced loss.
    }
    return loss, aux

  return with_aux, lambda p, b: with_aux(p, b)[0], params, {"x": x, "y": y}


def _pipeline(loss_fn, params, batch, *, devices=2, **options):
  """``loss_fn`` (returning aux outputs) as a Pipeline on the first
  ``devices`` devices: 2 stages, 2 microbatches, SGD unless ``options``
  say otherwise."""
  options = {
    "num_stages": 2,
    "num_microbatches": 2,
    "optimizer": optax.sgd(0.1),
    "has_aux": True,
    **options,
  }
  return jpipe.Pipeline(
    loss_fn, params, batch, devices=jax.devices()[:devices], **options
  )


def _microbatch_means(fn, params, batch, m, select):
  """The mean over m microbatches of ``select(fn(params, microbatch))``."""
  size = batch["x"].shape[0] // m
  values = [
    select(
      fn(
        params, jax.tree.map(lambda x, k=k: x[k * size : (k + 1) * size], batch)
      )
    )
    for k in range(m)
  ]
  return jax.tree.map(lambda *v: np.mean(np.stack(v), axis=0), *values)


@pytest.mark.parametrize(
  "schedule, stages",
  [("gpipe", 2), ("1f1b", 2), ("zbh1", 2), ("interleaved", 4)],
)
def test_aux_means_are_the_one_device_microbatch_means(schedule, stages):
  with_aux, loss_fn, params, batch = _case()
  tx = optax.sgd(0.1)
  pipe = _pipeline(
    with_aux,
    params,
    batch,
    num_stages=stages,
    schedule=schedule,
    num_microbatches=4,
    optimizer=tx,
  )
  stage_of = pipe.driver.result_stage
  assert stage_of[pipe.driver.first_aux_result + 1] == 0  # first_mean
  state, metrics = pipe.step(pipe.init(params), batch)
  want = _microbatch_means(with_aux, params, batch, 4, lambda out: out[1])
  assert set(metrics["aux"]) == set(want)
  for name, value in want.items():
    np.testing.assert_allclose(
      metrics["aux"][name], value, rtol=1e-5, atol=1e-6
    )
  assert metrics["aux"]["loss"] == metrics["loss"]
  # The aux outputs are not differentiated: the step is the loss's alone.
  expected, _ = _reference_steps(loss_fn, params, batch, 4, tx)
  _assert_tree_close(pipe.gather_params(state), expected)
  # Evaluated forward through the stages at the new params: the same.
  evaluated = pipe.evaluate(state, batch)
  at_new = _microbatch_means(with_aux, expected, batch, 4, lambda out: out)
  assert evaluated["loss"] == pytest.approx(float(at_new[0]), 1e-5)
  for name, value in at_new[1].items():
    np.testing.assert_allclose(
      evaluated["aux"][name], value, rtol=1e-5, atol=1e-6
    )


def test_aux_beside_model_state():
  """``(loss, (new_model_state, aux))``: the statistics threaded through
  the microbatches as without aux, the aux means beside them."""
  state_loss, params, stats, batch = flax_models.resnet_state_case(
    num_blocks=2, batch_size=4
  )

  def with_aux(params, stats, batch):
    loss, new_stats = state_loss(params, stats, batch)
    return loss, (new_stats, {"loss_times_two": 2 * loss})

  pipe = _pipeline(with_aux, params, batch, schedule="1f1b", model_state=stats)
  state, metrics = pipe.step(pipe.init(params, stats), batch)
  ref_stats, losses = stats, []
  for k in range(2):
    mb = jax.tree.map(lambda x, k=k: x[2 * k : 2 * k + 2], batch)
    loss, ref_stats = state_loss(params, ref_stats, mb)
    losses.append(loss)
  _assert_tree_close(pipe.gather_model_state(state), ref_stats)
  assert float(metrics["aux"]["loss_times_two"]) == pytest.approx(
    2 * np.mean(losses), rel=1e-5
  )


def test_an_asynchronous_stream_reports_each_stage_s_forwards_of_the_call():
  """A stream's call: the first stage's aux averages the microbatches fed
  in the call (its forwards run then), the last stage's those that
  finished (as the loss). With a zero learning rate the params stay put,
  so the reference is the loop over the call's microbatches."""
  with_aux, _, params, batch = _case()
  pipe = _pipeline(
    with_aux,
    params,
    batch,
    schedule="async",
    num_microbatches=4,
    optimizer=optax.sgd(0.0),
    weight_stashing=True,
  )
  state = pipe.init(params)
  rng = np.random.default_rng(0)
  for _ in range(3):
    rows = rng.permutation(8)
    data = jax.tree.map(lambda x, rows=rows: x[rows], batch)
    state, metrics = pipe.step(state, data)
    fed = _microbatch_means(with_aux, params, data, 4, lambda out: out[1])
    np.testing.assert_allclose(
      metrics["aux"]["first_mean"], fed["first_mean"], rtol=1e-5
    )
    assert metrics["aux"]["loss"] == metrics["loss"]
    np.testing.assert_allclose(metrics["aux"]["two"], 2.0)


@pytest.mark.parametrize(
  "model_state, returns, message",
  [
    (
      False,
      "scalar",
      r"with has_aux=True a Pipeline's loss_fn\(params, batch\) returns \(loss, aux\)",
    ),
    (True, "triple", r"returns \(loss, \(new_model_state, aux\)\)"),
    (True, "flat", r"its second output is dict, not a pair"),
    (True, "other state", r"new_model_state structured like model_state"),
  ],
)
def test_what_a_loss_with_aux_returns_is_named(model_state, returns, message):
  case_loss, params, batch, _ = flax_models.mlp_case()
  options = {}
  if model_state:
    options["model_state"] = {"count": jnp.zeros(())}
    outputs = {
      "triple": lambda loss, s: (loss, s, {"a": loss}),
      "flat": lambda loss, s: (loss, {"a": loss}),
      "other state": lambda loss, s: (loss, ({"other": loss}, {"a": loss})),
    }[returns]
    loss_fn = lambda p, s, b: outputs(case_loss(p, b), s)  # noqa: E731
  else:
    loss_fn = case_loss
  with pytest.raises(ValueError, match=message):
    _pipeline(loss_fn, params, batch, **options)


def test_modules_called_after_the_loss_are_named_as_the_cause():
  """Aux outputs from module calls after the loss's: the split puts them
  after it, so the loss leaves the last stage -- said, with the fix."""
  loss_fn, params, batch, _ = flax_models.mlp_case()

  def with_aux(params, batch):
    loss = loss_fn(params, batch)
    return loss, {"again": loss_fn(params, batch)}  # the model again

  with pytest.raises(ValueError, match="make them before the loss"):
    _pipeline(with_aux, params, batch, num_stages=3, devices=3)
