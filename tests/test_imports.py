"""Import boundaries: jpipe.staleness needs only jax and optax."""

import doctest
import os
import subprocess
import sys

import pytest

import jpipe.staleness._gap_aware
import jpipe.staleness._replay_prediction
import jpipe.staleness._weight_prediction

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_staleness_loads_no_flax_or_tfds():
  code = (
    "import sys, jpipe.staleness\n"
    "heavy = [m for m in sys.modules if m.split('.')[0] in\n"
    "         ('flax', 'tensorflow_datasets', 'tensorflow', 'orbax')\n"
    "         or m.startswith(('jpipe.runtime', 'jpipe.data', 'jpipe.models'))]\n"
    "assert not heavy, heavy\n"
  )
  env = dict(os.environ, PYTHONPATH=ROOT)
  subprocess.run([sys.executable, "-c", code], check=True, env=env, cwd=ROOT)


@pytest.mark.parametrize(
  "module",
  [
    jpipe.staleness._gap_aware,
    jpipe.staleness._replay_prediction,
    jpipe.staleness._weight_prediction,
  ],
)
def test_docstring_examples(module):
  result = doctest.testmod(module, optionflags=doctest.ELLIPSIS)
  assert result.attempted > 0
  assert result.failed == 0
