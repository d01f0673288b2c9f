"""The measured time-to-target experiment's pieces: each variant's CLI
overrides form a checked config, and the clock at the target."""

import pytest

from experiments.staleness import time_to_target
from jpipe.train import config_check


def _config(variant):
  return time_to_target.config_with(variant, 20, 10)


@pytest.mark.parametrize(
  "variant", ["gpipe", "1f1b", "ws+wp", "ws+dnag", "ws+nag99"]
)
def test_each_variant_is_a_checked_two_stage_config(variant):
  config = _config(variant)
  config_check.check(config)
  assert config.pipeline.num_stages == 2
  assert config.train.steps == 20 and config.train.eval_every == 10
  if variant in ("gpipe", "1f1b"):
    assert config.schedule.name == variant
    assert not config.staleness.prediction
  else:
    assert config.schedule.name == "async" and config.staleness.stashing
    assert not config.pipeline.recompute
    assert config.staleness.delay_nesterov == {
      "ws+dnag": "adaptive",
      "ws+nag99": "fixed",
    }.get(variant, "")


def test_unknown_variant_is_refused():
  with pytest.raises(Exception, match="unknown"):
    time_to_target.overrides("ws+xx", 20, 10)


def test_clock_at_the_first_evaluation_reaching_the_target():
  rows = [
    {"step": 10, "eval/perplexity": 20.0, "time/train_seconds": 9.0},
    {"step": 20, "eval/perplexity": 11.0, "time/train_seconds": 19.0},
    {"step": 30, "eval/perplexity": 10.0, "time/train_seconds": 29.0},
  ]
  # 29 s over the 29 timed steps: 1 s a step, the first counted at it.
  assert time_to_target.time_to_target(rows, 12.0, 30) == (20, 20.0)
  assert time_to_target.time_to_target(rows, 5.0, 30) == (None, None)


def test_importing_leaves_the_environment_alone():
  # Subprocesses of later tests in this worker inherit os.environ: the
  # script's own XLA flags (2 devices, one thread) are set in __main__.
  import importlib
  import os

  before = dict(os.environ)
  importlib.reload(time_to_target)
  assert dict(os.environ) == before
