"""Import boundaries: jpipe.staleness needs only jax and optax; packages
use each other's public names only."""

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


def test_packages_use_each_others_public_names_only():
  # A module under jpipe/<a>/ may import jpipe.<b>._private only when
  # a == b: the layers talk through each package's __init__.
  import ast
  import pathlib

  root = pathlib.Path(ROOT) / "jpipe"
  offenders = []
  for path in root.rglob("*.py"):
    package = path.relative_to(root).parts[0]
    for node in ast.walk(ast.parse(path.read_text())):
      if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
        # ``from jpipe.b import _private`` names the module too.
        names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
      elif isinstance(node, ast.Import):
        names = [a.name for a in node.names]
      else:
        continue
      for name in names:
        parts = name.split(".")
        if parts[0] != "jpipe" or len(parts) < 3:
          continue
        if parts[1] != package and parts[2].startswith("_"):
          offenders.append(f"{path.relative_to(ROOT)}: {name}")
  assert not offenders, offenders


def test_runtime_build_never_imports_execute():
  """``jpipe.runtime.build`` decides and builds; ``execute`` runs calls
  and may use what was built, never the other way (ARCHITECTURE.md)."""
  import ast
  import pathlib

  build = pathlib.Path(ROOT) / "jpipe" / "runtime" / "build"
  offenders = []
  for path in build.rglob("*.py"):
    for node in ast.walk(ast.parse(path.read_text())):
      if isinstance(node, ast.ImportFrom) and node.module:
        names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
      elif isinstance(node, ast.Import):
        names = [a.name for a in node.names]
      else:
        continue
      bad = [n for n in names if n.startswith("jpipe.runtime.execute")]
      bad += [n for n in names if n.startswith("jpipe.runtime._")]
      offenders += [f"{path.name}: {n}" for n in bad]
  assert not offenders, offenders
