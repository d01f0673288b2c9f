"""``jpipe.frozen_loss``: params a path pattern finds held as model state
the loss returns unchanged, against one device's training with the same
leaves frozen by the optimizer (``freeze``): equal trained params, the
frozen ones untouched, and neither a gradient nor optimizer state for
them on any stage."""

import jax
import numpy as np
import optax
import pytest

import jpipe
from jpipe.train.pretrained import freeze
from tests.partition import flax_models
from tests.runtime.test_pipeline_sync import (
  _assert_tree_close,
  _microbatch,
  _reference_steps,
)

M = 2


def _pipeline(fl, batch, stages=2, schedule="1f1b", tx=None, has_aux=False):
  return jpipe.Pipeline(
    fl.loss_fn,
    fl.params,
    batch,
    model_state=fl.model_state,
    has_aux=has_aux,
    num_stages=stages,
    schedule=schedule,
    num_microbatches=M,
    optimizer=tx or optax.adamw(0.05, weight_decay=0.1),
  )


@pytest.mark.parametrize("stages, schedule", [(2, "1f1b"), (3, "zbh1")])
def test_a_frozen_tied_embedding_trains_as_one_device_freezing_it(
  stages, schedule
):
  """GPT's embedding (read by the first and the last stage) frozen: the
  rest trains as one device with ``freeze(adamw, "embed/")``, the
  embedding is as it started, and no stage holds it as a param or keeps
  optimizer state for it."""
  loss_fn, params, batch, _ = flax_models.gpt_case()
  tx = optax.adamw(0.05, weight_decay=0.1)
  fl = jpipe.frozen_loss(loss_fn, params, "embed/")
  pipe = _pipeline(fl, batch, stages, schedule, tx)
  assert all("embed" not in name for name in pipe.leaf_names)
  state = pipe.init(fl.params, fl.model_state)
  for _ in range(2):
    state, _ = pipe.step(state, batch)
  saved = pipe.state_dict(state)
  assert "embed" not in str(jax.tree_util.tree_structure(saved["opt_state"]))
  resumed = pipe.load_state_dict(saved)  # (None where a frozen leaf was.)
  _assert_tree_close(pipe.gather_params(resumed), pipe.gather_params(state))
  got = fl.merged(pipe.gather_params(state), pipe.gather_model_state(state))
  want, _ = _reference_steps(
    loss_fn, params, batch, M, freeze(tx, "embed/"), steps=2
  )
  _assert_tree_close(got, want)
  np.testing.assert_array_equal(
    got["params"]["embed"]["embedding"], params["params"]["embed"]["embedding"]
  )


def test_with_the_models_own_state_and_aux_outputs():
  """A ResNet's BatchNorm statistics beside a frozen convolution, and aux
  outputs: statistics, trained params and aux as one device's."""
  loss_fn, params, stats, batch = flax_models.resnet_state_case(num_blocks=2)

  def with_aux(params, stats, batch):
    loss, new = loss_fn(params, stats, batch)
    return loss, (new, {"twice": 2 * loss})

  tx = optax.sgd(0.1)
  fl = jpipe.frozen_loss(
    with_aux, params, "block_0/Conv", model_state=stats, has_aux=True
  )
  pipe = _pipeline(fl, batch, tx=tx, has_aux=True)
  state = pipe.init(fl.params, fl.model_state)
  state, metrics = pipe.step(state, batch)
  got, got_stats = fl.merged(
    pipe.gather_params(state), pipe.gather_model_state(state)
  )
  # One device: the microbatches in order, the statistics carried.
  grads, new_stats, losses = [], stats, []
  for k in range(M):
    mb = _microbatch(batch, k, M)
    (loss, (new_stats, _)), g = jax.value_and_grad(with_aux, has_aux=True)(
      params, new_stats, mb
    )
    grads.append(g)
    losses.append(loss)
  mean = jax.tree.map(lambda *g: sum(g) / M, *grads)
  frozen_tx = freeze(tx, "block_0/Conv")
  updates, _ = frozen_tx.update(mean, frozen_tx.init(params), params)
  _assert_tree_close(got, optax.apply_updates(params, updates))
  _assert_tree_close(got_stats, new_stats)
  twice = float(metrics["aux"]["twice"])
  assert twice == pytest.approx(2 * np.mean(losses), 1e-5)


def test_patterns_that_freeze_nothing_or_everything_are_refused():
  loss_fn, params, _, _ = flax_models.gpt_case()
  with pytest.raises(ValueError, match="no param path matches.*params/embed"):
    jpipe.frozen_loss(loss_fn, params, "^embed/")
  with pytest.raises(ValueError, match="match every param"):
    jpipe.frozen_loss(loss_fn, params, "params/")
  with pytest.raises(ValueError, match="bad parameter path pattern"):
    jpipe.frozen_loss(loss_fn, params, "embed/(")
