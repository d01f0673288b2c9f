"""The pipeline's work kept out of a mesh its caller has set.

Code written for SPMD sets a mesh for everything it runs (``jax.set_mesh
(mesh)``, as a context or globally). Under it every ``jax.jit`` call is
checked against the mesh's devices, so the pipeline's programs, each
placed on its own stage's devices, fail ("Received incompatible devices
for jitted computation"), and a model's ``nn.with_logical_constraint``
traces to constraints over the whole mesh. The pipeline places stages
itself: ``outside_user_mesh`` runs a class's public methods with no mesh
set (the caller's is back on return), which also makes the model's
logical constraints the no-ops they are without a mesh.
"""

import functools
import inspect

import jax


def _mesh_set() -> bool:
  return not (
    jax.sharding.get_abstract_mesh().empty and jax.sharding.get_mesh().empty
  )


def without_mesh(fn):
  """``fn`` run with no mesh set (as it is where none is)."""

  @functools.wraps(fn)
  def run(*args, **kwargs):
    if not _mesh_set():  # (The common case: nothing to swap.)
      return fn(*args, **kwargs)
    with jax.set_mesh(None):
      return fn(*args, **kwargs)

  return run


def outside_user_mesh(cls):
  """Class decorator: ``__init__`` and every public method of ``cls``
  (its bases' too) run ``without_mesh``; properties are left as they
  are (they compute nothing on devices)."""
  for name in ["__init__", *dir(cls)]:
    if name.startswith("_") and name != "__init__":
      continue
    attr = inspect.getattr_static(cls, name)
    if inspect.isfunction(attr):
      setattr(cls, name, without_mesh(attr))
  return cls
