"""Module-path name scopes for Flax NNX, which (unlike linen) pushes none.

While :func:`nnx_module_scopes` is active, every call of an NNX module
whose path is known runs inside ``jax.named_scope`` of its path relative to
the calling module, so traced equations carry paths such as
``blocks[0]/linear``: a level per module, and a list or dict of modules
(``nnx.List``, ``nnx.Dict``: never called itself) is no level of its own
-- its items are, named by their index, as linen's ``layers_0`` are. Paths
are learnt from the roots given, from every
module ``nnx.merge`` builds (the usual ``nnx.split`` / ``nnx.merge`` loss
functions) and from the copies NNX transforms (``nnx.remat``,
``nnx.scan``, ...) rebuild inside of a module passed in (through
``nnx.graphlib``'s ``flatten`` / ``unflatten``, where this Flax has them).
The module classes' ``__call__`` are wrapped only inside the context and
restored afterwards.
"""

import contextlib
import functools
import sys
from typing import Any


@contextlib.contextmanager
def nnx_module_scopes(*roots: Any):
  """Context: NNX module calls push their module path as a name scope."""
  nnx = sys.modules.get("flax.nnx")
  if nnx is None:  # NNX not in use: nothing to scope.
    yield
    return
  import jax

  paths: dict[int, tuple] = {}
  levels: set[tuple] = set()  # Paths of modules that are a level.
  containers = tuple(
    getattr(nnx, name) for name in ("List", "Dict") if hasattr(nnx, name)
  )
  active: list[tuple] = []
  originals: dict[type, tuple[Any, bool]] = {}

  def wrap(cls):
    if cls in originals or "__call__" not in dir(cls):
      return
    original = cls.__call__
    originals[cls] = (original, "__call__" in cls.__dict__)

    @functools.wraps(original)
    def call(self, *args, **kwargs):
      path = paths.get(id(self))
      if not path:
        return original(self, *args, **kwargs)
      parent = active[-1] if active else ()
      start = len(parent) if path[: len(parent)] == parent else 0
      active.append(path)
      try:
        with jax.named_scope(_scope_name(path, start, levels)):
          return original(self, *args, **kwargs)
      finally:
        active.pop()

    cls.__call__ = call

  keep = []  # Registered modules stay alive, so no id is reused.

  def register(root, prefix=()):
    if not isinstance(root, nnx.Module):
      return
    keep.append(root)
    for path, module in nnx.iter_modules(root):
      paths[id(module)] = prefix + tuple(path)
      if not isinstance(module, containers):
        levels.add(prefix + tuple(path))
      wrap(type(module))

  # NNX transforms (nnx.remat, nnx.scan, nnx.vmap, ...) flatten the
  # modules passed in and rebuild fresh copies inside: a copy rebuilt from
  # the graph a registered module was last flattened to gets its path.
  graphlib = sys.modules.get("flax.nnx.graphlib")
  hooks = graphlib is not None and all(
    callable(getattr(graphlib, n, None)) for n in ("flatten", "unflatten")
  )
  if hooks:
    original_flatten, original_unflatten = graphlib.flatten, graphlib.unflatten
    flattened: dict[Any, tuple] = {}

    @functools.wraps(original_flatten)
    def flatten(node, *args, **kwargs):
      out = original_flatten(node, *args, **kwargs)
      path = paths.get(id(node))
      if path is not None and isinstance(out, tuple) and out:
        with contextlib.suppress(TypeError):  # An unhashable graphdef.
          flattened[out[0]] = path
      return out

    @functools.wraps(original_unflatten)
    def unflatten(graphdef, *args, **kwargs):
      out = original_unflatten(graphdef, *args, **kwargs)
      try:
        path = flattened.get(graphdef)
      except TypeError:
        path = None
      if path is not None:
        register(out, path)
      return out

  original_merge = nnx.merge

  @functools.wraps(original_merge)
  def merge(*args, **kwargs):
    out = original_merge(*args, **kwargs)
    for item in out if isinstance(out, tuple) else (out,):
      register(item)
    return out

  for root in roots:
    register(root)
  nnx.merge = merge
  if hooks:
    graphlib.flatten, graphlib.unflatten = flatten, unflatten
  try:
    yield
  finally:
    nnx.merge = original_merge
    if hooks:
      graphlib.flatten, graphlib.unflatten = (
        original_flatten,
        original_unflatten,
      )
    for cls, (original, own) in originals.items():
      if own:
        cls.__call__ = original
      else:
        del cls.__call__


def _scope_name(path: tuple, start: int, levels: set) -> str:
  """``path[start:]`` as a name scope: one component per module on it
  (``levels``: their paths), a container's key appended to its name
  (``("blocks", 0, "linear")`` is ``blocks[0]/linear`` where ``blocks``
  is a list)."""
  names, name = [], ""
  for i in range(start, len(path)):
    part = str(path[i])
    name = f"{name}[{part}]" if name else part
    if path[: i + 1] in levels or i == len(path) - 1:
      names.append(name)
      name = ""
  return "/".join(names)
