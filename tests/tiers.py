"""The test suite's two tiers (BUILD.md, "Tests"): the README's
``python -m pytest -n auto`` runs the default tier, ``-m slow`` the
slow one, and ``.ci/run`` both."""

import pytest


def slow(*values, id=None):
  """One parametrization's values, in the slow tier: the bigger models'
  and the rarer combinations' cases of a test whose smallest case stays
  in the default tier."""
  return pytest.param(*values, marks=pytest.mark.slow, id=id)
