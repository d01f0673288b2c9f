"""The caller's mesh axes, each of size 1, for tracing their code.

Code written for SPMD names mesh axes as it runs: ``jax.lax.
with_sharding_constraint(x, P("data", None))``, and under an ``Explicit``
mesh (``jax.make_mesh``'s default) ``jnp.dot(x, w, out_sharding=P("data",
None))``, ``jax.sharding.reshard``, and constraints that assert the type
of their input. Each needs a mesh with those axes in context while it
traces ("requires a non-empty mesh in context"), and the asserts need the
inputs typed as the caller typed them; yet the pipeline runs every stage
on devices of its own choosing, with no mesh set, on plain arrays
(``runtime/build/user_mesh.py``).

So a pipeline call records the caller's mesh with every axis of size 1
(names and types kept: a one-device mesh) and the specs of the arrays it
was given (``calling_from``); the places that trace a user's function do
so in ``caller_axes()``, their inputs ``typed`` with those specs. On a
mesh whose axes all have size 1 every annotation holds trivially: the
jaxpr computes what the model computes, and runs on any one device on
plain arrays.
"""

import contextlib
import contextvars
import dataclasses
from typing import Any

import jax
from jax.sharding import NamedSharding


@dataclasses.dataclass(frozen=True, eq=False)
class _Caller:
  mesh: jax.sharding.Mesh  # The caller's axes at size 1, on one device.
  # id(array given) -> (the array, kept alive; its spec on the caller's mesh).
  specs: dict[int, tuple[Any, Any]]


_CALLER = contextvars.ContextVar("jpipe_caller_axes", default=None)


@contextlib.contextmanager
def calling_from(mesh: jax.sharding.Mesh, specs: dict[int, tuple[Any, Any]]):
  """Within: ``caller_axes()`` traces under ``mesh`` (the caller's axes,
  each of size 1), and ``typed`` gives the arrays in ``specs`` (``id`` ->
  (array, PartitionSpec)) their caller's type."""
  token = _CALLER.set(_Caller(mesh, specs))
  try:
    yield
  finally:
    _CALLER.reset(token)


@contextlib.contextmanager
def caller_axes():
  """Traces within see the recorded caller's axes, each of size 1 (no
  mesh where none is recorded)."""
  caller = _CALLER.get()
  if caller is None:
    yield
    return
  with jax.sharding.use_abstract_mesh(caller.mesh.abstract_mesh):
    yield


def keep_type(source, derived):
  """``derived`` (rows of ``source``: a microbatch of a batch leaf),
  recorded with ``source``'s spec; returned."""
  caller = _CALLER.get()
  if caller is not None and id(source) in caller.specs:
    caller.specs[id(derived)] = (derived, caller.specs[id(source)][1])
  return derived


def typed(leaf):
  """``leaf`` as its caller typed it (a ``ShapeDtypeStruct`` sharded on
  the caller's axes at size 1), for a trace in ``caller_axes()``;
  ``leaf`` itself where no type was recorded."""
  caller = _CALLER.get()
  if caller is None or id(leaf) not in caller.specs:
    return leaf
  spec = caller.specs[id(leaf)][1]
  sharding = NamedSharding(caller.mesh, spec)
  return jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=sharding)
