"""The user's own code named in a config: ``package.module:name``.

``config.task`` names a function building a Task and ``config.model.name``
may name a Flax module class; both are imported the way Python imports
anything (the working directory and ``PYTHONPATH`` come first), so a file
``my_task.py`` next to the command is ``my_task:build_task``. Every way
the name can be wrong is one line naming the config key and the fix.
"""

import difflib
import importlib

from jpipe.train.errors import UsageError


def is_import_path(name: str) -> bool:
  """Whether a config value names code by import path (has a colon)."""
  return ":" in name


def load(path: str, key: str, *, want: str):
  """The object ``path`` ("package.module:attribute") names.

  Args:
    path: the import path.
    key: the config key it came from (``config.task``), for errors.
    want: what it should be, for errors ("a function returning a
      jpipe.train.Task").

  Raises:
    UsageError: a path without a colon, a module that does not import, a
      missing attribute or one that is not callable.
  """
  module_name, _, attribute = path.partition(":")
  if not module_name or not attribute or ":" in attribute:
    raise UsageError(
      f"config.{key}={path!r}: write package.module:name, e.g. "
      f"my_task:build_task for {want} in my_task.py"
    )
  try:
    module = importlib.import_module(module_name)
  except ModuleNotFoundError as e:
    if e.name and module_name.startswith(e.name):  # The module itself.
      raise UsageError(
        f"config.{key}={path!r}: no module {e.name!r} on the import path; "
        f"run from the directory holding it or add that directory to "
        f"PYTHONPATH"
      ) from None
    raise UsageError(  # A module it imports is missing.
      f"config.{key}={path!r}: importing {module_name} failed: {e}; "
      f"install what it imports"
    ) from None
  except Exception as e:  # Its own code raised while importing.
    raise UsageError(
      f"config.{key}={path!r}: importing {module_name} raised "
      f"{type(e).__name__}: {e}"
    ) from e
  value = getattr(module, attribute, None)
  if value is None:
    names = [
      n
      for n, v in vars(module).items()
      if not n.startswith("_") and callable(v)
    ]
    close = difflib.get_close_matches(attribute, names, n=2)
    hint = f"; did you mean {' or '.join(close)}?" if close else ""
    where = getattr(module, "__file__", None) or module_name
    raise UsageError(
      f"config.{key}={path!r}: {where} defines no {attribute!r}{hint}"
    )
  if not callable(value):
    raise UsageError(
      f"config.{key}={path!r} is a {type(value).__name__}, not {want}"
    )
  return value
