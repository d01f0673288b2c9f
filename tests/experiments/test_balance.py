"""The load-balancing experiment's pieces: each run's config is a checked
DynPipe config on PipeDream's hybrid VGG plan, and the phases' means."""

import math
import os

import pytest

from experiments.dynpipe import balance
from jpipe.train import config_check


@pytest.mark.parametrize("run", sorted(balance.RUNS))
def test_each_run_is_a_checked_dynamic_config(run):
  config = balance.config_for(run, 60, 4, 60.0, "1:4:16:44")
  config_check.check(config)
  assert config.dynamic.enabled and config.dynamic.inject == "1:4:16:44"
  assert config.pipeline.partition == "pipedream_hybrid"
  assert config.pipeline.replica_routing == balance.RUNS[run]["routing"]
  assert config.dynamic.policy == balance.RUNS[run]["policy"]
  # The split (SPMD) run needs microbatches divisible by the 3 replicas.
  size = config.data.batch_size // config.pipeline.num_microbatches
  assert size % 3 == 0


def test_phase_means_take_the_windows_ending_in_it():
  windows = {4: 1.0, 8: 2.0, 12: 4.0, 16: 8.0}
  assert balance.phase_seconds(windows, 4, 12) == pytest.approx(3.0)
  assert math.isnan(balance.phase_seconds(windows, 16, 20))  # None there.


def test_importing_leaves_the_environment_alone():
  import importlib

  before = dict(os.environ)
  importlib.reload(balance)
  assert dict(os.environ) == before
