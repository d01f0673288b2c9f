"""``config.optimizer.freeze`` in every loop mode (one pipeline, one that
re-partitions, two in data parallel): the frozen leaves are held as model
state (``jpipe.Pipeline(frozen=)``), keep their initial values through
training and a resume, the checkpoint keeps the whole params (read by
``init_from`` as any other), and the trained leaves move."""

import re

import numpy as np
import pytest

from jpipe.train import pretrained, tasks, train_lib
from tests.tiers import slow
from tests.train.test_train import _config, _small_sdpipe_config

FROZEN = "^layer_0/"


def _pipeline(steps, **overrides):
  return _config(
    **{
      "train.steps": steps,
      "train.checkpoint_every": 2,
      "optimizer.freeze": FROZEN,
      **overrides,
    }
  )


def _dynamic(steps):
  return _pipeline(
    steps, **{"dynamic.enabled": True, "dynamic.policy": "static"}
  )


def _data_parallel(steps):
  config = _small_sdpipe_config(steps)
  config.optimizer.freeze = FROZEN
  config.train.checkpoint_every = 2
  return config


@pytest.mark.parametrize(
  "make",
  [_pipeline, slow(_dynamic, id="dynamic"), slow(_data_parallel, id="sdpipe")],
  ids=lambda f: getattr(f, "__name__", str(f)).strip("_"),
)
def test_frozen_leaves_keep_their_values_through_training_and_a_resume(
  tmp_path, capsys, make
):
  workdir = str(tmp_path)
  train_lib.train_and_evaluate(make(2), workdir)
  train_lib.train_and_evaluate(make(4), workdir)
  out = capsys.readouterr().out
  assert "Frozen: 2 of" in out
  assert re.search("Resuming from (step|epoch) 2", out)
  initial = tasks.build_task(make(4)).params
  trained = pretrained.load_params(workdir, initial)
  before, after = (pretrained.flat_paths(t) for t in (initial, trained))
  assert any(p.startswith("layer_0/") for p in before)
  for path, x in after.items():
    same = np.array_equal(np.asarray(x), np.asarray(before[path]))
    assert same == path.startswith("layer_0/"), path


def test_resuming_with_other_frozen_leaves_is_refused(tmp_path):
  train_lib.train_and_evaluate(_pipeline(2), str(tmp_path))
  with pytest.raises(ValueError, match="freeze"):
    train_lib.train_and_evaluate(
      _pipeline(4, **{"optimizer.freeze": "^head/"}), str(tmp_path)
    )
