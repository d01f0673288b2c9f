"""``config.optimizer``: any optax optimizer by name, with its arguments."""

import os

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from jpipe import staleness
from jpipe.train import (
  base_config,
  config_check,
  config_options,
  optimizers,
  train_lib,
)
from jpipe.train.errors import UsageError


def _config(name, args="", weight_decay=0.0, **more):
  c = base_config.base_config()
  c.data = base_config.image_data()
  c.optimizer.name = name
  c.optimizer.args = args
  c.optimizer.weight_decay = weight_decay
  c.update_from_flattened_dict(more)
  return c


def _updates(tx, steps=3):
  """``tx``'s params after ``steps`` steps on a fixed quadratic."""
  params = {
    "w": jnp.arange(12.0).reshape(3, 4) / 10,
    "b": jnp.ones((4,)),
  }
  state = tx.init(params)
  for k in range(steps):
    grads = jax.tree.map(lambda p, k=k: jnp.sin(p * (k + 1)), params)
    updates, state = tx.update(grads, state, params)
    params = optax.apply_updates(params, updates)
  return params


def test_parse_args_reads_keyword_literals():
  assert optimizers.parse_args("") == {}
  assert optimizers.parse_args("b2=0.98, eps=1e-6,nesterov=True") == {
    "b2": 0.98,
    "eps": 1e-6,
    "nesterov": True,
  }
  assert optimizers.parse_args("decay_rate=0.8,momentum=None") == {
    "decay_rate": 0.8,
    "momentum": None,
  }
  for bad in ("0.98", "b2=", "b2=np.ones(3)"):
    with pytest.raises(UsageError, match="config.optimizer.args"):
      optimizers.parse_args(bad)


@pytest.mark.parametrize(
  "name, args, weight_decay, expected",
  [
    (
      "adafactor",
      "multiply_by_parameter_scale=False",
      0.0,
      optax.adafactor(0.01, multiply_by_parameter_scale=False),
    ),
    ("lamb", "b2=0.98", 0.01, optax.lamb(0.01, b2=0.98, weight_decay=0.01)),
    ("lion", "", 0.1, optax.lion(0.01, weight_decay=0.1)),
    (  # No weight_decay argument of its own: L2 on the gradient.
      "rmsprop",
      "decay=0.95",
      0.01,
      optax.chain(
        optax.add_decayed_weights(0.01), optax.rmsprop(0.01, decay=0.95)
      ),
    ),
    (
      "sgd",
      "nesterov=True",
      0.0,
      optax.sgd(0.01, momentum=0.9, nesterov=True),
    ),
    ("adamw", "", 0.05, optax.adamw(0.01, weight_decay=0.05)),
  ],
)
def test_an_optax_optimizer_by_name_is_that_optimizer(
  name, args, weight_decay, expected
):
  config = _config(name, args, weight_decay, **{"optimizer.momentum": 0.9})
  config_check.check(config)
  built = train_lib.build_optimizer(config, 0.01)
  for a, b in zip(
    jax.tree.leaves(_updates(built)),
    jax.tree.leaves(_updates(expected)),
    strict=True,
  ):
    np.testing.assert_allclose(a, b, rtol=1e-6)


@pytest.mark.parametrize(
  "name, expected",
  [
    ("adamw", lambda mask: optax.adamw(0.01, weight_decay=0.5, mask=mask)),
    (  # L2 on the gradient, masked the same way.
      "adam",
      lambda mask: optax.chain(
        optax.add_decayed_weights(0.5, mask=mask), optax.adam(0.01)
      ),
    ),
  ],
)
def test_no_decay_skips_the_leaves_its_patterns_find(name, expected):
  config = _config(name, weight_decay=0.5, **{"optimizer.no_decay": "^b$"})
  config_check.check(config)
  built = _updates(train_lib.build_optimizer(config, 0.01))
  want = _updates(expected({"w": True, "b": False}))
  for key in ("w", "b"):
    np.testing.assert_allclose(built[key], want[key], rtol=1e-6)
  # Not the unmasked step: "b" would decay.
  unmasked = _updates(expected(None))
  assert not np.allclose(built["b"], unmasked["b"])
  np.testing.assert_allclose(built["w"], unmasked["w"], rtol=1e-6)


def test_gap_aware_takes_the_optimizers_decay_mask():
  """Gap-Aware's decay terms follow no_decay as the optimizer's do (it
  penalised AdamW's decay on every leaf: an anti-decay on the biases)."""
  config = _config(
    "adamw",
    weight_decay=0.5,
    **{
      "optimizer.no_decay": "^b$",
      "schedule.name": "async",
      "staleness.gap_aware": "ga",
    },
  )
  options = config_options.staleness(config, 0.01).gap_aware_options
  params = {"w": jnp.ones((3, 4)), "b": jnp.ones((4,))}
  assert options["weight_decay_mask"](params) == {"w": True, "b": False}
  tx = staleness.gap_aware(train_lib.build_optimizer(config, 0.01), **options)
  stale = jax.tree.map(lambda p: p + 0.3, params)
  zero = jax.tree.map(jnp.zeros_like, params)
  updates, _ = tx.update(zero, tx.init(params), params, stale_params=stale)
  np.testing.assert_allclose(updates["b"], 0.0, atol=1e-7)  # Nothing moves.
  assert float(updates["w"][0, 0]) < 0  # The decay, penalised.


def test_gap_aware_from_grad_trains_from_the_config(tmp_path):
  """FTPipe's Gap-Aware without a stash, from the CLI's config: Adam's
  betas from optimizer.args reach the estimate; it trains."""
  config = _config(
    "adam",
    args="b1=0.8, b2=0.98, eps=1e-6",
    **{
      "schedule.name": "async",
      "staleness.gap_aware": "ga_from_grad",
      "staleness.gap_aware_policy": "almost_last_partition",
      "pipeline.num_stages": 3,
      "optimizer.learning_rate": 0.01,
      "train.steps": 4,
      "train.eval_every": 4,
      "model.kwargs.hidden": (16, 16),
    },
  )
  config_check.check(config)
  options = config_options.staleness(config, 0.01).gap_aware_options
  assert options["adam_betas"] == (0.8, 0.98)
  # FTPipe's Adam Gap-Aware: S decays with Adam's beta2, C adds its eps.
  assert (options["beta"], options["eps"]) == (0.98, 1e-6)
  summary = train_lib.train_and_evaluate(config, str(tmp_path))
  assert np.isfinite(summary["eval"]["accuracy"])
  config.staleness.gap_aware_policy = "all_except_last"
  with pytest.raises(UsageError, match="on stages 2 or more steps late"):
    config_check.check(config)


@pytest.mark.parametrize(
  "fields, message",
  [
    ({"optimizer.name": "adamm"}, "not an optax optimizer"),
    ({"optimizer.name": "chain"}, "not an optax optimizer"),
    ({"optimizer.name": "lamb", "optimizer.args": "beta=1"}, "takes no 'beta'"),
    (
      {"optimizer.name": "adam", "optimizer.args": "learning_rate=1"},
      "takes no 'learning_rate'",
    ),
    (
      {
        "optimizer.name": "adafactor",
        "schedule.name": "async",
        "staleness.gap_aware": "ga",
        "pipeline.recompute": True,
      },
      "Gap-Aware reads the state of",
    ),
    ({"optimizer.clip_norm": -1.0}, "clip_norm"),
    ({"optimizer.no_decay": "bias$"}, "no weight decay to skip"),
    (
      {
        "optimizer.no_decay": "bias$",
        "optimizer.weight_decay": 0.1,
        "optimizer.name": "novograd",
      },
      "takes no weight-decay mask",
    ),
    ({"optimizer.no_decay": "(", "optimizer.weight_decay": 0.1}, "pattern"),
  ],
)
def test_bad_optimizer_fields_are_named(fields, message):
  config = _config("sgd", **fields)
  with pytest.raises(UsageError, match=message):
    config_check.check(config)


def test_adafactor_takes_weight_prediction_from_the_cli(tmp_path):
  """FTPipe's T5 runs Adafactor under weight prediction: the CLI replays
  it (staleness.replay_predictor). With momentum the prediction moves
  the forward's weights, so the run differs from one without it."""
  from tests.train.test_train import _config as small

  def losses(prediction, workdir):
    config = small(
      **{
        "optimizer.name": "adafactor",
        "optimizer.learning_rate": 0.01,
        "optimizer.args": "momentum=0.9",
        "schedule.name": "async",
        "staleness.prediction": prediction,
        "train.steps": 4,
      }
    )
    train_lib.train_and_evaluate(config, str(workdir))
    rows = train_lib.read_metrics(str(workdir))
    return [r["train/loss"] for r in rows if "train/loss" in r]

  predicted = losses("msnag", tmp_path / "msnag")
  plain = losses("", tmp_path / "plain")
  assert len(predicted) == 4 and all(np.isfinite(predicted))
  assert predicted != plain


def test_no_decay_is_counted_and_a_pattern_finding_nothing_stops_the_run(
  tmp_path, capsys
):
  from tests.train.test_train import _config as small

  def config(no_decay):
    return small(
      **{
        "optimizer.name": "adamw",
        "optimizer.weight_decay": 0.1,
        "optimizer.no_decay": no_decay,
        "train.steps": 1,
      }
    )

  with pytest.raises(UsageError, match=r"matches 0 of the \d+ param paths"):
    train_lib.train_and_evaluate(config("^nothing$"), str(tmp_path / "a"))
  assert not os.listdir(tmp_path / "a" / "checkpoints")  # Nothing trained.
  train_lib.train_and_evaluate(config("bias$"), str(tmp_path / "b"))
  assert (
    "No weight decay: 3 of 6 param leaves (bias$)." in capsys.readouterr().out
  )
