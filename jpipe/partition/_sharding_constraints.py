"""A model's sharding constraints dropped: the pipeline places its values.

Models written for SPMD annotate activations with ``jax.lax.
with_sharding_constraint(x, NamedSharding(mesh, spec))`` (t5x, MaxText's
``nn.with_logical_constraint`` under a mesh). In a stage's program, placed
on that stage's devices, a constraint over the whole mesh is an error
("incompatible devices"), and it would say nothing true there anyway: the
pipeline decides where each stage's values live. A constraint changes no
value, so ``drop_sharding_constraints`` replaces each by its input, in
control-flow and remat bodies too.
"""

import jax.extend.core as jcore

_CONSTRAINTS = ("sharding_constraint",)


def drop_sharding_constraints(closed: jcore.ClosedJaxpr) -> jcore.ClosedJaxpr:
  """``closed`` without sharding constraints (the same object when it
  has none)."""
  jaxpr = _drop(closed.jaxpr)
  if jaxpr is closed.jaxpr:
    return closed
  return jcore.ClosedJaxpr(jaxpr, closed.consts)


def _has(jaxpr) -> bool:
  return any(
    e.primitive.name in _CONSTRAINTS
    or any(_has(j) for j in jcore.jaxprs_in_params(e.params))
    for e in jaxpr.eqns
  )


def _drop(jaxpr):
  if not _has(jaxpr):
    return jaxpr
  renamed = {}  # A constraint's output -> its input.

  def read(atom):
    return renamed.get(atom, atom) if isinstance(atom, jcore.Var) else atom

  eqns = []
  for eqn in jaxpr.eqns:
    invars = [read(v) for v in eqn.invars]
    if eqn.primitive.name in _CONSTRAINTS:
      for out, x in zip(eqn.outvars, invars, strict=True):
        renamed[out] = x
      continue
    params = {k: _in_param(v) for k, v in eqn.params.items()}
    eqns.append(eqn.replace(invars=invars, params=params))
  return jaxpr.replace(eqns=eqns, outvars=[read(v) for v in jaxpr.outvars])


def _in_param(value):
  """A primitive's parameter with the jaxprs in it rewritten (a body, a
  tuple of branches); anything else as it is."""
  if isinstance(value, jcore.ClosedJaxpr):
    jaxpr = _drop(value.jaxpr)
    return (
      value if jaxpr is value.jaxpr else jcore.ClosedJaxpr(jaxpr, value.consts)
    )
  if isinstance(value, jcore.Jaxpr):
    return _drop(value)
  if isinstance(value, tuple) and any(
    isinstance(v, (jcore.ClosedJaxpr, jcore.Jaxpr)) for v in value
  ):
    return tuple(_in_param(v) for v in value)
  return value
