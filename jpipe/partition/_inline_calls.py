"""Nested ``jax.jit`` calls opened so that the partitioner can cut in them.

A loss written as ``jax.jit(loss_fn)``, or one calling ``jax.jit(model.
apply)``, traces to one ``jit`` equation holding every module call: one
node, nothing to split. A nested jit is only a compilation boundary (the
pipeline compiles each stage's program itself), so ``inline_module_calls``
replaces a ``jit`` equation whose body calls modules of two or more paths
by its body's equations, their name stacks under the call's, recursively.
Jits inside one module (jax.numpy's own helpers, a jitted attention
kernel) stay whole, as do ``remat`` (split per node by
``_checkpoint_split`` instead, keeping its policy), ``scan``, ``cond`` and
``while`` (they change what runs, not only where it compiles).
"""

import jax.extend.core as jcore

from jpipe.partition._checkpoint_split import REMAT
from jpipe.partition._scopes import nested_paths

_CALLS = ("jit", "pjit")  # (The primitive's name before jax 0.7: pjit.)


def inline_module_calls(closed: jcore.ClosedJaxpr) -> jcore.ClosedJaxpr:
  """``closed`` with every ``jit`` equation that spans module paths
  replaced by its body (the same function of the same inputs)."""
  jaxpr, consts = _inline(closed.jaxpr, list(closed.consts))
  if jaxpr is closed.jaxpr:
    return closed
  return jcore.ClosedJaxpr(jaxpr, consts)


def _opens(eqn) -> bool:
  """Whether ``eqn`` is a jit call whose body calls modules of two or
  more paths."""
  if eqn.primitive.name not in _CALLS:
    return False
  return len(set(nested_paths(eqn.params["jaxpr"].jaxpr))) > 1


def inline_calls_reading(jaxpr, consts, watched):
  """``(jaxpr, consts)`` with every ``jit`` call that reads one of the
  ``watched`` vars replaced by its body, nested ones too (so each read of
  them is an equation of ``jaxpr`` itself: ``dynamic_index_in_dim``'s
  slice)."""
  watched = set(watched)

  def reads(eqn) -> bool:
    return eqn.primitive.name in _CALLS and any(
      isinstance(v, jcore.Var) and v in watched for v in eqn.invars
    )

  while any(reads(e) for e in jaxpr.eqns):
    jaxpr, consts = _inline(jaxpr, consts, reads)
  return jaxpr, consts


def _inline(jaxpr, consts, opens=_opens):
  """``(jaxpr, consts)`` with the calls ``opens`` picks inlined (the same
  objects when there is none)."""
  if not any(opens(e) for e in jaxpr.eqns):
    return jaxpr, consts
  constvars, eqns = list(jaxpr.constvars), []
  renamed = {}  # An opened call's output -> the atom that holds it.

  def read(atom):
    return renamed.get(atom, atom) if isinstance(atom, jcore.Var) else atom

  for eqn in jaxpr.eqns:
    invars = [read(v) for v in eqn.invars]
    if not opens(eqn):
      eqns.append(eqn.replace(invars=invars))
      continue
    body = eqn.params["jaxpr"]
    inner, inner_consts = _inline(body.jaxpr, list(body.consts), opens)
    env = dict(zip(inner.invars, invars, strict=True))
    for var, value in zip(inner.constvars, inner_consts, strict=True):
      env[var] = jcore.Var(var.aval)
      constvars.append(env[var])
      consts.append(value)
    # The body's results made by its own equations are written straight
    # to the call's output variables.
    direct = {}
    for got, out in zip(inner.outvars, eqn.outvars, strict=True):
      if (
        isinstance(got, jcore.Var)
        and got not in env
        and got not in direct
        and not isinstance(out, jcore.DropVar)
      ):
        direct[got] = out
    for e in inner.eqns:
      outs = []
      for v in e.outvars:
        if not isinstance(v, jcore.DropVar):
          env[v] = direct.get(v) or jcore.Var(v.aval)
          v = env[v]
        outs.append(v)
      eqns.append(
        e.replace(
          invars=[
            env.get(a, a) if isinstance(a, jcore.Var) else a for a in e.invars
          ],
          outvars=outs,
          source_info=e.source_info.replace(
            name_stack=eqn.source_info.name_stack + e.source_info.name_stack
          ),
        )
      )
    for got, out in zip(inner.outvars, eqn.outvars, strict=True):
      held = env.get(got, got) if isinstance(got, jcore.Var) else got
      if not isinstance(out, jcore.DropVar) and held is not out:
        renamed[out] = held
  return (
    jaxpr.replace(
      constvars=constvars, eqns=eqns, outvars=[read(v) for v in jaxpr.outvars]
    ),
    consts,
  )


def enclosing_equations(closed: jcore.ClosedJaxpr) -> list[tuple[str, int]]:
  """``(primitive, module paths)`` of ``closed``'s equations whose bodies
  call modules of two or more paths (``cond``, ``while``, ``scan``, ...:
  module calls no cut separates), the most paths first. A checkpoint is
  no such equation (``_checkpoint_split`` splits it per node): the
  equations in its body are looked at instead."""
  out = []

  def visit(eqns):
    for e in eqns:
      if e.primitive.name in REMAT:
        visit(e.params["jaxpr"].eqns)
        continue
      paths = {
        s for j in jcore.jaxprs_in_params(e.params) for s in nested_paths(j)
      }
      if len(paths) > 1:
        name = e.primitive.name
        if name == "scan" and e.params.get("reverse"):
          name = "reverse_scan"  # (Not split by layer: named apart.)
        out.append((name, len(paths)))

  visit(closed.jaxpr.eqns)
  return sorted(out, key=lambda item: -item[1])
