"""A traced loss retyped to plain arrays, its sharding annotations dropped.

The pipeline decides where each stage's values live, on devices of its
own choosing with no mesh set; a model's sharding annotations say nothing
true there. A constraint over the whole mesh (``jax.lax.
with_sharding_constraint(x, NamedSharding(mesh, spec))``: t5x, MaxText's
``nn.with_logical_constraint`` under a mesh) is an error in a stage's
program ("incompatible devices"). Under an ``Explicit`` mesh a value's
type also carries its sharding (``f32[16@data,8]``), and equations carry
the shardings they produce (``dot_general[out_sharding=...]``,
``broadcast_in_dim[sharding=...]``, ``reshard``): a loss traced on the
caller's mesh (``_caller_axes``) has such types, and in a stage's program
a typed value meeting a differently typed one is an error ("select cases
must have the same shardings").

``plain_types`` rewrites the jaxpr as the same computation on plain
arrays: sharding constraints, ``reshard`` and ``mesh_cast`` replaced by
their input (none changes a value), every variable and literal retyped,
sharding parameters dropped, the mesh taken out of each equation's context
(evaluating it enters that again), in nested bodies too, and the
derivative rules a ``custom_jvp`` / ``custom_vjp`` traces later (on the
types of the trace) retyped as they are traced; constants typed on a mesh
(arrays the loss closes over) are made plain arrays on one device. A
``shard_map`` becomes the same function of the global arrays, its body
(with its collectives that check manual-axis types swapped for the
unchecked ones, and ``pvary`` dropped) vmapped over the mesh axes it maps
(``_shard_map_emulation``).
"""

import functools

import jax
import jax.extend.core as jcore
import numpy as np
from jax.extend import linear_util as lu
from jax.sharding import AbstractMesh, AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

from jpipe.partition._shard_map_emulation import UNCHECKED, emulated

_IDENTITIES = ("sharding_constraint", "reshard", "mesh_cast", "pvary")
_THUNKS = ("jvp_jaxpr_fun", "fwd_jaxpr_thunk")
_EMPTY = AbstractMesh((), ())
# (A plain value's manual-axis type: no axes it varies over.)
_NO_MANUAL_AXES = jax.core.ShapedArray((), np.float32).manual_axis_type


def plain_types(closed: jcore.ClosedJaxpr) -> jcore.ClosedJaxpr:
  """``closed`` on plain arrays with no sharding annotations, its
  constants too (the same object when it has none)."""
  if not _typed_jaxpr(closed.jaxpr):
    return closed
  return _plain_closed(closed)


def typed_on_mesh(x) -> bool:
  """Whether ``x`` is an array typed on an ``Explicit`` mesh."""
  # (The sharding first: ~10x cheaper than the type, and only an array
  # on a NamedSharding can be typed on a mesh.)
  return (
    isinstance(x, jax.Array)
    and isinstance(x.sharding, jax.sharding.NamedSharding)
    and AxisType.Explicit in jax.typeof(x).sharding.mesh.axis_types
  )


def plain_array(x: jax.Array, k: int = 0) -> jax.Array:
  """``x`` (typed on a mesh) whole on the k-th of its addressable devices
  (modulo their number), typed plain."""
  devices = sorted(x.sharding.addressable_devices, key=lambda d: d.id)
  mesh = x.sharding.mesh
  one = jax.sharding.Mesh(
    np.array([devices[k % len(devices)]]).reshape((1,) * len(mesh.axis_names)),
    mesh.axis_names,
    axis_types=mesh.axis_types,
  )
  # (On a one-device mesh its one shard is the whole, typed plain.)
  return jax.device_put(x, NamedSharding(one, P())).addressable_shards[0].data


def _plain_closed(closed: jcore.ClosedJaxpr) -> jcore.ClosedJaxpr:
  consts = [plain_array(c) if typed_on_mesh(c) else c for c in closed.consts]
  return jcore.ClosedJaxpr(_plain_jaxpr(closed.jaxpr), consts)


def _typed(aval) -> bool:
  sharding = getattr(aval, "sharding", None)
  return sharding is not None and not sharding.mesh.empty


def _manual(aval) -> bool:
  """Whether ``aval`` varies over manual axes (inside a ``shard_map``)."""
  mat = getattr(aval, "manual_axis_type", _NO_MANUAL_AXES)
  return mat is not _NO_MANUAL_AXES and not mat.empty


def _typed_jaxpr(jaxpr) -> bool:
  if any(_typed(v.aval) for v in (*jaxpr.constvars, *jaxpr.invars)):
    return True
  for eqn in jaxpr.eqns:
    if (
      eqn.primitive.name in _IDENTITIES
      or eqn.primitive.name == "shard_map"
      or _meshed(eqn)
      or any(_typed(v.aval) for v in eqn.outvars)
      or any(_sharding_param(v) for v in eqn.params.values())
    ):
      return True
    if any(_typed_jaxpr(j) for j in jcore.jaxprs_in_params(eqn.params)):
      return True
  return False


def _meshed(eqn) -> bool:
  """Whether ``eqn`` was traced in a mesh context (which evaluating it
  enters again: its outputs typed on that mesh)."""
  ctx = getattr(eqn, "ctx", None)
  mesh = getattr(ctx, "cur_abstract_mesh", None)
  return mesh is not None and not mesh.empty


def _without_mesh(ctx):
  """``ctx`` (an equation's context) with no mesh in it."""
  metadata = ctx.xla_metadata
  return type(ctx)._create(
    ctx.compute_type,
    ctx.threefry_partitionable,
    _EMPTY,
    ctx.remove_size_one_mesh_axis,
    None if metadata is None else tuple(sorted(metadata.items())),
  )


def _sharding_param(value) -> bool:
  return isinstance(value, NamedSharding) and not value.mesh.empty


def _plain_aval(aval):
  if not (_typed(aval) or _manual(aval)):
    return aval
  return aval.update(
    sharding=NamedSharding(_EMPTY, P(*[None] * aval.ndim)),
    manual_axis_type=_NO_MANUAL_AXES,
  )


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
    outs = [var(v) for v in eqn.outvars]
    if eqn.primitive.name == "shard_map":  # (Its body per shard, vmapped.)
      body = _plain_jaxpr(eqn.params["jaxpr"])
      eqn = emulated(eqn.replace(invars=ins, outvars=outs), body)
    elif eqn.primitive.name in UNCHECKED:  # (In a shard_map's body.)
      primitive, params = UNCHECKED[eqn.primitive.name]
      eqn = eqn.replace(
        primitive=primitive, invars=ins, outvars=outs, params=params(eqn.params)
      )
    else:
      params = {k: _plain_param(k, v) for k, v in eqn.params.items()}
      eqn = eqn.replace(invars=ins, outvars=outs, params=params)
    if _meshed(eqn):
      eqn = eqn.replace(ctx=_without_mesh(eqn.ctx))
    eqns.append(eqn)
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
    return _plain_closed(value) if _typed_jaxpr(value.jaxpr) else value
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
