"""The caller's mesh and their arrays' types, for tracing their code.

Code written for SPMD names mesh axes as it runs: ``jax.lax.
with_sharding_constraint(x, P("data", None))``, and under an ``Explicit``
mesh (``jax.make_mesh``'s default) ``jnp.dot(x, w, out_sharding=P("data",
None))``, ``jax.sharding.reshard``, constraints that assert the type of
their input, and arrays it closes over typed on the mesh. Each needs the
mesh in context while it traces ("requires a non-empty mesh in
context"), and the asserts need the inputs typed as the caller typed
them; yet the pipeline runs every stage on devices of its own choosing,
with no mesh set, on plain arrays (``runtime/build/user_mesh.py``).

So a pipeline call records the caller's mesh (``calling_from``), and the
plain copies of the caller's typed arrays remember their specs
(``remember_type``); the places that trace a user's function
do so in ``caller_axes(inputs)`` (the mesh's abstract form: no device
work), their inputs typed with those specs, and every annotation checks as
it does for the caller. The jaxpr is then retyped to plain arrays
(``_plain_types``) for the stages.
"""

import contextlib
import contextvars
import dataclasses
import math
import weakref
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np
from jax._src import config  # (No public form of this option.)
from jax.sharding import AbstractMesh, NamedSharding
from jax.sharding import PartitionSpec as P


@dataclasses.dataclass(frozen=True, eq=False)
class _Caller:
  mesh: Any  # The caller's mesh (a Mesh; an AbstractMesh where only that).
  # id(value) -> (the value, kept alive; its spec): rows of a typed array
  # made during the call that cannot be remembered (ShapeDtypeStructs).
  derived: dict[int, tuple[Any, Any]]


_CALLER = contextvars.ContextVar("jpipe_caller_axes", default=None)
# id(plain copy) -> (its caller's mesh, its spec), for the copy's lifetime:
# a pipeline built later from it (a DynamicPipeline's next plan) traces
# it as its caller typed it.
_TYPES: dict[int, tuple[Any, Any]] = {}


def remember_type(array, mesh, spec) -> None:
  """Records that ``array`` (a plain copy of a caller's typed array) was
  typed ``spec`` on ``mesh``, for as long as it lives."""
  key = id(array)
  _TYPES[key] = (mesh, spec)
  weakref.finalize(array, _TYPES.pop, key, None)


def _type_of(caller, leaf):
  """(mesh, spec) its caller typed ``leaf`` with, or None."""
  if caller is not None and id(leaf) in caller.derived:
    return caller.mesh, caller.derived[id(leaf)][1]
  return _TYPES.get(id(leaf))


@contextlib.contextmanager
def calling_from(mesh):
  """Within: ``caller_axes()`` traces under ``mesh`` (the caller's)."""
  token = _CALLER.set(_Caller(mesh, {}))
  try:
    yield
  finally:
    _CALLER.reset(token)


@contextlib.contextmanager
def caller_axes(leaves: Sequence[Any] = ()):
  """Traces within see the recorded caller's mesh (abstract); yields
  ``leaves`` as the caller typed them (``ShapeDtypeStruct``s sharded on
  it; replicated where no spec is recorded). Where a leaf's shape does
  not divide over its spec's axes (a microbatch of fewer rows than the
  "data" axis has devices), the mesh's axes at size 1 instead: every
  annotation still traces, but an array the function closes over typed
  on the caller's mesh cannot meet them. No mesh, ``leaves`` as they
  are, where none is recorded."""
  caller = _CALLER.get()
  types = [_type_of(caller, leaf) for leaf in leaves]
  if caller is None and not any(types):
    yield list(leaves)
    return
  mesh = caller.mesh if caller is not None else next(filter(None, types))[0]
  mesh = _abstract(mesh)
  specs = [
    None if t is None or _abstract(t[0]) != mesh else (None, t[1])
    for t in types
  ]
  uneven = [
    (np.shape(leaf), s[1])
    for leaf, s in zip(leaves, specs, strict=True)
    if s is not None and not _divides(np.shape(leaf), s[1], mesh)
  ]
  if uneven:
    full = mesh
    mesh = AbstractMesh(
      (1,) * len(mesh.axis_names), mesh.axis_names, axis_types=mesh.axis_types
    )
  typed = [
    jax.ShapeDtypeStruct(
      leaf.shape,
      leaf.dtype,
      # (Replicated where no spec was recorded: as an unsharded array
      # enters the caller's own jit under their mesh.)
      sharding=NamedSharding(mesh, P() if s is None else s[1]),
    )
    if hasattr(leaf, "shape") and hasattr(leaf, "dtype")
    else leaf
    for leaf, s in zip(leaves, specs, strict=True)
  ]
  try:
    # (At size 1, axes come off the types, as the types of an even
    # split carry them: a 1-row microbatch's gather resolves.)
    with config.remove_size_one_mesh_axis_from_type(bool(uneven)):
      with jax.sharding.use_abstract_mesh(mesh):
        yield typed
  except ValueError as e:
    if not uneven:
      raise
    shape, spec = uneven[0]
    why = (
      f"a microbatch leaf of shape {shape} does not divide over its spec "
      f"{spec}, so the function is traced on the mesh's axes at size 1"
    )
    if "aval mesh" in str(e):
      raise ValueError(
        f"the function closes over an array typed on the caller's mesh "
        f"({dict(full.shape)}), and {why}, where that array cannot be "
        "used: use fewer microbatches (rows that divide over the axes), or "
        "pass the array in params or the batch"
      ) from e
    if "device-varying" in str(e):  # (Size-1 axes vary over nothing.)
      raise ValueError(
        f"{why}, where a shard_map's collectives cannot trace: use fewer "
        f"microbatches (rows that divide over the caller's mesh, "
        f"{dict(full.shape)})"
      ) from e
    raise


def _divides(shape, spec, mesh) -> bool:
  """Whether each dimension of ``shape`` divides over the axes ``spec``
  shards it on."""
  for dim, axes in zip(shape, spec, strict=False):
    if axes is None:
      continue
    axes = axes if isinstance(axes, tuple) else (axes,)
    if dim % math.prod(mesh.shape[a] for a in axes):
      return False
  return True


def _abstract(mesh):
  return getattr(mesh, "abstract_mesh", mesh)


def keep_type(source, derived):
  """``derived`` (rows of ``source``: a microbatch of a batch leaf),
  recorded with ``source``'s type; returned."""
  caller = _CALLER.get()
  typed = _type_of(caller, source)
  if typed is None:
    return derived
  try:
    remember_type(derived, *typed)
  except TypeError:  # (Not weakly referable: for this call.)
    if caller is not None:
      caller.derived[id(derived)] = (derived, typed[1])
  return derived
