"""``skip_nonfinite_steps``: a step whose gradient holds a NaN or an
infinity leaves every stage as it was (``optax.apply_if_finite`` on one
device, which a pipeline refuses: its check spans the stages), and says
so; a finite step is the plain one."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jpipe
from tests.partition import flax_models
from tests.runtime.test_pipeline_sync import _reference_steps


def _pipeline(loss_fn, params, batch, **options):
  return jpipe.Pipeline(
    loss_fn,
    params,
    batch,
    num_stages=2,
    devices=jax.devices()[:2],
    num_microbatches=2,
    optimizer=optax.adam(1e-2),
    skip_nonfinite_steps=True,
    **{"schedule": "1f1b", **options},
  )


def _same(a, b):
  for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


@pytest.mark.parametrize("schedule", ["1f1b", "gpipe"])
def test_a_nonfinite_step_changes_nothing_and_says_so(schedule):
  loss_fn, params, batch, _ = flax_models.CASES["gpt_tied"]()

  # A microbatch holding a token -1 makes its loss, so every gradient of
  # the step, NaN (on the last stage; the other stages' too, through the
  # cotangents).
  def poisoned(p, b):
    return loss_fn(p, b) * jnp.where(jnp.any(b["tokens"] < 0), jnp.nan, 1.0)

  pipe = _pipeline(poisoned, params, batch, schedule=schedule)
  start = pipe.init(params)
  bad = {"tokens": batch["tokens"].at[-1, 0].set(-1)}
  state, metrics = pipe.step(start, bad)
  assert bool(metrics["step_skipped"])
  _same(pipe.state_dict(state)["params"], pipe.state_dict(start)["params"])
  _same(
    pipe.state_dict(state)["opt_state"], pipe.state_dict(start)["opt_state"]
  )
  # Then a finite step: as if the skipped one had not been.
  state, metrics = pipe.step(state, batch)
  assert not bool(metrics["step_skipped"])
  expected, _ = _reference_steps(loss_fn, params, batch, 2, optax.adam(1e-2))
  for x, y in zip(
    jax.tree.leaves(pipe.gather_params(state)),
    jax.tree.leaves(expected),
    strict=True,
  ):
    np.testing.assert_allclose(x, y, rtol=1e-5, atol=1e-6)


def test_with_clipping_a_finite_step_is_the_clipped_one():
  loss_fn, params, batch, _ = flax_models.CASES["mlp"]()
  pipe = _pipeline(loss_fn, params, batch, clip_global_norm=0.05)
  state, metrics = pipe.step(pipe.init(params), batch)
  assert not bool(metrics["step_skipped"])
  tx = optax.chain(optax.clip_by_global_norm(0.05), optax.adam(1e-2))
  expected, _ = _reference_steps(loss_fn, params, batch, 2, tx)
  for x, y in zip(
    jax.tree.leaves(pipe.gather_params(state)),
    jax.tree.leaves(expected),
    strict=True,
  ):
    np.testing.assert_allclose(x, y, rtol=1e-5, atol=1e-6)


def test_streams_are_refused():
  loss_fn, params, batch, _ = flax_models.CASES["mlp"]()
  with pytest.raises(ValueError, match="skip_nonfinite_steps needs a synch"):
    _pipeline(loss_fn, params, batch, schedule="async")
