"""The run description: the config resolved once (jpipe.train.run)."""

import pytest

from configs import default as default_config
from configs import dynpipe, sdpipe
from jpipe.train import run as run_lib
from jpipe.train.errors import UsageError


def test_each_config_kind_gets_its_mode():
  assert run_lib.describe(default_config.get_config()).mode == "pipeline"
  assert run_lib.describe(sdpipe.get_config()).data_parallel
  assert run_lib.describe(dynpipe.get_config()).dynamic
  assert set(run_lib.MODES) == {"pipeline", "data_parallel", "dynamic"}


@pytest.mark.parametrize(
  "schedule, m, step_every, expected",
  # async: ceil(m / step_every) steps; 2bw: m / minibatch; else one.
  [
    ("gpipe", 8, 1, 1),
    ("async", 8, 1, 8),
    ("async", 8, 3, 3),
    ("2bw", 8, 4, 2),
  ],
)
def test_steps_per_call_follows_the_schedule(schedule, m, step_every, expected):
  config = default_config.get_config()
  config.schedule.name = schedule
  config.pipeline.num_microbatches = m
  config.schedule.step_every = step_every
  config.pipeline.recompute = True
  run = run_lib.describe(config)
  assert run.steps_per_call == expected == run_lib.steps_per_call(config)
  assert run.steps == config.train.steps


def test_the_fingerprint_ignores_the_partition_but_not_the_model():
  config = default_config.get_config()
  before = run_lib.describe(config).fingerprint
  config.pipeline.num_stages = 1
  config.pipeline.partition = "mixed"
  assert run_lib.describe(config).fingerprint == before
  config.optimizer.name = "sgd" if config.optimizer.name != "sgd" else "adam"
  assert run_lib.describe(config).fingerprint != before


def test_an_invalid_config_is_refused_before_anything_is_resolved():
  config = default_config.get_config()
  config.pipeline.num_microbatches = 0
  with pytest.raises(UsageError, match="num_microbatches: must be >= 1"):
    run_lib.describe(config)
