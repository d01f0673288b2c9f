"""``Pipeline.param_norms``: each stage's parameter L2 norm, all its
leaves together (the divergence check names the stage whose params grew
most by it), against NumPy over the leaves each stage holds."""

import jax
import numpy as np
import optax
import pytest

import jpipe
from tests.partition import flax_models


def _reference(pipe, params) -> list[float]:
  """Per stage, sqrt of the sum of squares of its leaves, in float64
  (the leaves as ``jax.tree.leaves`` orders them, as the trace does)."""
  leaves = [np.asarray(x, np.float64) for x in jax.tree.leaves(params)]
  return [
    float(np.sqrt(sum(np.sum(leaves[i] ** 2) for i in spec.param_leaves)))
    for spec in pipe.stages.specs
  ]


@pytest.mark.parametrize("schedule", ["1f1b", "async"])
def test_each_stages_norm_is_that_of_its_own_leaves(schedule):
  loss_fn, params, batch, _ = flax_models.mlp_case()
  pipe = jpipe.Pipeline(
    loss_fn,
    params,
    batch,
    num_stages=3,
    devices=jax.devices()[:3],
    schedule=schedule,
    num_microbatches=2,
    optimizer=optax.sgd(0.1),
  )
  state = pipe.init(params)
  norms = pipe.param_norms(state)
  np.testing.assert_allclose(norms, _reference(pipe, params), rtol=1e-6)
  # After a step (the stream drained: what gather_params reads).
  state, _ = pipe.step(state, batch)
  if schedule == "async":
    state, _ = pipe.flush(state)
  now = pipe.gather_params(state)
  np.testing.assert_allclose(
    pipe.param_norms(state), _reference(pipe, now), rtol=1e-6
  )
  assert pipe.param_norms(state) != norms  # (The step moved them.)
