"""The compile settings tests run under (tests/quick_compiles.py): quick
by default, in process and for the processes a test starts; a
``compute_bound`` test with XLA's optimisations on, and its processes."""

import os
import subprocess
import sys

import jax
import pytest

from tests.distributed.processes import environment
from tests.quick_compiles import NO_OPTIMIZATIONS, QUICK_COMPILE_FLAGS

_CHILD_READS = (
  "import jax; print(jax.config.read('jax_disable_most_optimizations'))"
)


def _childs_setting(env) -> str:
  done = subprocess.run(
    [sys.executable, "-c", _CHILD_READS],
    env=env,
    capture_output=True,
    text=True,
    timeout=60,
    check=True,
  )
  return done.stdout.strip()


def test_a_test_compiles_quickly_and_so_do_its_processes():
  assert jax.config.read("jax_disable_most_optimizations")
  assert all(f in os.environ["XLA_FLAGS"].split() for f in QUICK_COMPILE_FLAGS)
  assert _childs_setting(environment()) == "True"


@pytest.mark.compute_bound
def test_a_compute_bound_test_and_its_processes_optimise():
  assert not jax.config.read("jax_disable_most_optimizations")
  assert os.environ[NO_OPTIMIZATIONS] == "0"
  assert _childs_setting(environment()) == "False"
  # The flags stay: only the optimisations change.
  assert all(f in os.environ["XLA_FLAGS"].split() for f in QUICK_COMPILE_FLAGS)
