"""A model whose layers run under ``jax.lax.scan`` trained by the CLI's
loop: checkpointed in the model's stacked layout and resumed under
another stage count."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jpipe.train import train_lib
from jpipe.train.errors import UsageError
from jpipe.train.tasks import Task
from tests.train.test_train import _losses
from tests.train.test_user_task import _config

HERE = "tests.train.test_scanned_task"
LAYERS, WIDTH = 8, 16
SEEN_SHAPES = []  # The params' shapes each evaluation got.


def build_task(config) -> Task:
  """Digits regressed to one-hot targets by ``LAYERS`` residual tanh
  layers under one scan over stacked params."""
  from jpipe.data import digits

  images, labels = digits.load_digits("train", None)
  size = config.data.batch_size
  keys = jax.random.split(jax.random.key(config.seed), 3)
  params = {
    "stem": jax.random.normal(keys[0], (64, WIDTH)) * 0.1,
    "layers": jax.random.normal(keys[1], (LAYERS, WIDTH, WIDTH)) * 0.3,
    "out": jax.random.normal(keys[2], (WIDTH, 10)) * 0.1,
  }

  def apply(params, pixels):
    h = pixels.reshape(pixels.shape[0], -1) @ params["stem"]
    h, _ = jax.lax.scan(
      lambda h, w: (h + jnp.tanh(h @ w), None), h, params["layers"]
    )
    return h @ params["out"]

  def loss_fn(params, batch):
    out = apply(params, batch["pixels"])
    return jnp.mean(jnp.sum(jnp.square(out - batch["target"]), -1))

  def batch_at(step):
    rng = np.random.default_rng([config.seed, step])
    take = rng.permutation(len(labels))[:size]
    return {"pixels": images[take], "target": np.eye(10)[labels[take]]}

  def evaluate(params, model_state):
    del model_state
    SEEN_SHAPES.append(jax.tree.map(np.shape, params))
    return {"loss": float(loss_fn(params, batch_at(0)))}

  return Task("regression", loss_fn, params, None, batch_at, evaluate)


def test_scanned_layers_checkpoint_stacked_and_resume_in_two_stages(
  tmp_path, capsys
):
  def config(stages, steps):
    return _config(
      **{
        "task": f"{HERE}:build_task",
        "pipeline.num_stages": stages,
        "train.steps": steps,
        "optimizer.clip_norm": 0.0,
      }
    )

  resumed, straight = tmp_path / "resumed", tmp_path / "straight"
  train_lib.train_and_evaluate(config(4, 3), str(resumed))
  capsys.readouterr()
  train_lib.train_and_evaluate(config(2, 6), str(resumed))
  assert "Resuming from step 3" in capsys.readouterr().out
  train_lib.train_and_evaluate(config(2, 6), str(straight))
  a, b = _losses(resumed), _losses(straight)
  assert sorted(a) == sorted(b) == [1, 2, 3, 4, 5, 6]
  for step in (4, 5, 6):
    assert a[step] == pytest.approx(b[step], rel=1e-5)
  assert SEEN_SHAPES and all(
    s["layers"] == (LAYERS, WIDTH, WIDTH) for s in SEEN_SHAPES
  )


def test_an_optimizer_mixing_the_scanned_rows_is_one_line(tmp_path):
  """Adafactor's default update clip and parameter scale take an RMS over
  the whole stacked leaf: refused where the rows split between stages,
  with the config's spelling of the row-wise Adafactor, which trains."""
  config = _config(
    **{
      "task": f"{HERE}:build_task",
      "pipeline.num_stages": 2,
      "train.steps": 1,
      "optimizer.name": "adafactor",
      "optimizer.clip_norm": 0.0,
    }
  )
  with pytest.raises(UsageError, match="mixes the rows of 'layers'") as err:
    train_lib.train_and_evaluate(config, str(tmp_path / "refused"))
  message = str(err.value)
  assert "\n" not in message
  fix = message.split("--config.optimizer.args=")[1].strip("')")
  config.optimizer.args = fix
  summary = train_lib.train_and_evaluate(config, str(tmp_path / "runs"))
  assert np.isfinite(summary["eval"]["loss"])
