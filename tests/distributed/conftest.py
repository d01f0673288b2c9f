"""Environment for the processes the distributed tests start."""

import pytest

from tests.distributed.processes import environment


@pytest.fixture(scope="session")
def process_env():
  """``env(**extra)``: ``processes.environment``."""
  return environment
