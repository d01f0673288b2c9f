"""A jaxpr traced on the caller's axes, retyped to plain arrays.

Under an ``Explicit`` mesh a value's type carries its sharding
(``f32[16@data,8]``), and equations carry the shardings they produce
(``dot_general[out_sharding=...]``, ``broadcast_in_dim[sharding=...]``,
``reshard``). A loss traced on the caller's axes at size 1
(``_caller_axes``) has such types; the pipeline's stages run it on plain
arrays (no mesh), where a typed value meeting a differently typed one is
an error ("select cases must have the same shardings") though every axis
has size 1. ``plain_types`` rewrites the jaxpr as the same computation on
plain arrays: every variable and literal retyped, sharding parameters
dropped, ``reshard`` / ``mesh_cast`` replaced by their input, in nested
bodies too, and the derivative rules a ``custom_jvp`` / ``custom_vjp``
traces later (on the types of the trace) retyped as they are traced.
"""

import functools

import jax.extend.core as jcore
from jax.extend import linear_util as lu
from jax.sharding import AbstractMesh, NamedSharding
from jax.sharding import PartitionSpec as P

_IDENTITIES = ("reshard", "mesh_cast")
_THUNKS = ("jvp_jaxpr_fun", "fwd_jaxpr_thunk")
_EMPTY = AbstractMesh((), ())


def plain_types(closed: jcore.ClosedJaxpr) -> jcore.ClosedJaxpr:
  """``closed`` on plain arrays (the same object when nothing in it is
  typed on a mesh)."""
  if not _typed_jaxpr(closed.jaxpr):
    return closed
  return jcore.ClosedJaxpr(_plain_jaxpr(closed.jaxpr), closed.consts)


def _typed(aval) -> bool:
  sharding = getattr(aval, "sharding", None)
  return sharding is not None and not sharding.mesh.empty


def _typed_jaxpr(jaxpr) -> bool:
  if any(_typed(v.aval) for v in (*jaxpr.constvars, *jaxpr.invars)):
    return True
  for eqn in jaxpr.eqns:
    if any(_typed(v.aval) for v in eqn.outvars) or any(
      _sharding_param(v) for v in eqn.params.values()
    ):
      return True
    if any(_typed_jaxpr(j) for j in jcore.jaxprs_in_params(eqn.params)):
      return True
  return False


def _sharding_param(value) -> bool:
  return isinstance(value, NamedSharding) and not value.mesh.empty


def _plain_aval(aval):
  if not _typed(aval):
    return aval
  return aval.update(sharding=NamedSharding(_EMPTY, P(*[None] * aval.ndim)))


def _plain_jaxpr(jaxpr: jcore.Jaxpr) -> jcore.Jaxpr:
  new = {}

  def var(v):
    if isinstance(v, jcore.Literal):
      return jcore.Literal(v.val, _plain_aval(v.aval))
    if isinstance(v, jcore.DropVar) or not _typed(v.aval):
      return new.get(v, v)
    if v not in new:
      new[v] = jcore.Var(_plain_aval(v.aval))
    return new[v]

  constvars = [var(v) for v in jaxpr.constvars]
  invars = [var(v) for v in jaxpr.invars]
  eqns = []
  for eqn in jaxpr.eqns:
    ins = [var(v) for v in eqn.invars]
    if eqn.primitive.name in _IDENTITIES:
      for out, x in zip(eqn.outvars, ins, strict=True):
        new[out] = x
      continue
    params = {k: _plain_param(k, v) for k, v in eqn.params.items()}
    outs = [var(v) for v in eqn.outvars]
    eqns.append(eqn.replace(invars=ins, outvars=outs, params=params))
  outvars = [var(v) for v in jaxpr.outvars]
  return jaxpr.replace(
    constvars=constvars, invars=invars, eqns=eqns, outvars=outvars
  )


def _plain_param(key, value):
  """A primitive's parameter on plain arrays: shardings dropped (None:
  the operands' own), bodies retyped, derivative thunks wrapped."""
  if _sharding_param(value):
    return None
  if isinstance(value, AbstractMesh) and not value.empty:
    return _EMPTY  # (jit's ctx_mesh.)
  if key in _THUNKS and isinstance(value, lu.WrappedFun):
    return _plain_thunk(value)
  if isinstance(value, jcore.ClosedJaxpr):
    if not _typed_jaxpr(value.jaxpr):
      return value
    return jcore.ClosedJaxpr(_plain_jaxpr(value.jaxpr), value.consts)
  if isinstance(value, jcore.Jaxpr):
    return _plain_jaxpr(value) if _typed_jaxpr(value) else value
  if isinstance(value, tuple) and any(
    isinstance(v, (jcore.ClosedJaxpr, jcore.Jaxpr)) or _sharding_param(v)
    for v in value
  ):
    return tuple(_plain_param(key, v) for v in value)
  return value


def _plain_thunk(thunk: lu.WrappedFun) -> lu.WrappedFun:
  """A ``custom_jvp``'s jvp / ``custom_vjp``'s fwd thunk whose jaxpr (its
  first result, traced on the types of the trace) comes back plain."""

  @functools.cache
  def traced(*zeros):
    jaxpr, *rest = thunk.call_wrapped(*zeros)
    return (_plain_jaxpr(jaxpr) if _typed_jaxpr(jaxpr) else jaxpr, *rest)

  return lu.wrap_init(traced, debug_info=thunk.debug_info)
