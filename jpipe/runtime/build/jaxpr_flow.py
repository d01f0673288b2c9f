"""Forward data-flow analysis over a jaxpr, for a lattice of facts.

The optimizer checks follow a traced update from its inputs to its
outputs: which inputs each output reads (``optimizer_locality``), and
whether it keeps a scanned leaf's rows apart (``row_locality``). Both
walk the same structure -- equations in order, through jit, custom
derivatives, remat, cond, while and scan -- and differ only in the facts
they carry and in how a primitive combines them: a ``Lattice``.
"""

from collections.abc import Sequence
from typing import Any, Protocol

from jax.extend import core as jex_core


class Lattice(Protocol):
  """The facts an analysis carries per value.

  Attributes:
    bottom: the fact of a value that reads nothing (a literal, a
      constant).
  """

  bottom: Any

  def join(self, a, b):
    """The fact of a value that may be either (commutative, idempotent)."""

  def influence(self, fact):
    """What a value of ``fact`` passes on where it only shapes another
    value (a cond's index, a loop's trip count, a scan's iteration over
    axis 0, an operand of a primitive the analysis does not know)."""

  def equation(self, eqn, ins: list) -> list | None:
    """The facts of a first-order equation's outputs from its inputs',
    or None where the analysis has no rule of its own."""


def flow(closed_jaxpr, in_facts: Sequence, lattice: Lattice) -> list:
  """The facts of ``closed_jaxpr``'s outputs from those of its inputs
  (its constants read nothing)."""
  return _closed(closed_jaxpr, list(in_facts), lattice)


def _closed(j, ins: Sequence, lattice: Lattice) -> list:
  jaxpr = j.jaxpr if isinstance(j, jex_core.ClosedJaxpr) else j
  env = {v: lattice.bottom for v in jaxpr.constvars}
  env.update(zip(jaxpr.invars, ins, strict=True))

  def read(v):
    return (
      env.get(v, lattice.bottom)
      if isinstance(v, jex_core.Var)
      else (lattice.bottom)
    )

  for eqn in jaxpr.eqns:
    outs = _equation(eqn, [read(v) for v in eqn.invars], lattice)
    env.update(zip(eqn.outvars, outs, strict=True))
  return [read(v) for v in jaxpr.outvars]


def _join_all(facts, lattice: Lattice):
  out = lattice.bottom
  for f in facts:
    out = lattice.join(out, f)
  return out


def _equation(eqn, ins: list, lattice: Lattice) -> list:
  """One equation's output facts: the structural primitives followed
  inside, the lattice's own rules, else every output influenced by
  every input."""
  name, params = eqn.primitive.name, eqn.params
  if name == "cond":  # invars: (index, *operands)
    index = lattice.influence(ins[0])
    outs = [_closed(b, ins[1:], lattice) for b in params["branches"]]
    return [
      lattice.join(index, _join_all(o, lattice))
      for o in zip(*outs, strict=True)
    ]
  if name == "while":
    return _while(params, ins, lattice)
  if name == "scan":
    return _scan(params, ins, lattice)
  own = lattice.equation(eqn, ins)
  if own is not None:
    return own
  subs = [p for p in params.values() if _is_jaxpr(p)]
  if len(subs) == 1 and _arity(subs[0]) == (len(ins), len(eqn.outvars)):
    # jit, custom_jvp_call, custom_vjp_call, remat, closed_call: the
    # inner jaxpr is the equation, input for input.
    return _closed(subs[0], ins, lattice)
  every = _join_all((lattice.influence(f) for f in ins), lattice)
  return [every] * len(eqn.outvars)


def _is_jaxpr(p) -> bool:
  return isinstance(p, jex_core.ClosedJaxpr | jex_core.Jaxpr)


def _arity(j) -> tuple[int, int]:
  jaxpr = j.jaxpr if isinstance(j, jex_core.ClosedJaxpr) else j
  return len(jaxpr.invars), len(jaxpr.outvars)


def _fixed_point(step, carry: list, lattice: Lattice) -> list:
  """The least carry facts closed under ``step`` (each carry holds what
  its initial value and every iteration feed it)."""
  while True:
    new = [lattice.join(c, n) for c, n in zip(carry, step(carry), strict=True)]
    if new == carry:
      return carry
    carry = new


def _while(params, ins: list, lattice: Lattice) -> list:
  nc, nb = params["cond_nconsts"], params["body_nconsts"]
  cond_consts, body_consts, init = ins[:nc], ins[nc : nc + nb], ins[nc + nb :]

  def step(carry):
    flow = _closed(params["body_jaxpr"], [*body_consts, *carry], lattice)
    # The trip count (the predicate's inputs) shapes every result.
    (pred,) = _closed(params["cond_jaxpr"], [*cond_consts, *carry], lattice)
    trips = lattice.influence(pred)
    return [lattice.join(f, trips) for f in flow]

  return _fixed_point(step, list(init), lattice)


def _scan(params, ins: list, lattice: Lattice) -> list:
  """A scan's iterations run along axis 0 of its xs and stack its ys
  there: both pass through ``influence``."""
  nc, ncarry = params["num_consts"], params["num_carry"]
  consts, init, xs = ins[:nc], ins[nc : nc + ncarry], ins[nc + ncarry :]
  xs = [lattice.influence(x) for x in xs]
  body = params["jaxpr"]
  carry = _fixed_point(
    lambda c: _closed(body, [*consts, *c, *xs], lattice)[:ncarry],
    list(init),
    lattice,
  )
  ys = _closed(body, [*consts, *carry, *xs], lattice)[ncarry:]
  return [*carry, *(lattice.influence(y) for y in ys)]
