"""Glue computed from the function's inputs alone moves next to its reader.

A loss may prepare inputs outside any module: the params cast to the
compute dtype at its top (jmp's ``cast_to_compute``, T5X's master
weights: ``p16 = tree.map(lambda w: w.astype(bf16), p32)``), a mask or
position ids made from the batch, labels one-hot encoded for the loss at
the end. Traced, those equations come first, before any module call, and
glue joins the call after it: every cast would sit on the first stage,
which would then hold every param, its gradient and its optimizer state,
and send each later stage its weights every microbatch (an outside check
found 100 KB of weights crossing for 4 KB of activations, and the later
stages holding none). Moved to just before the first equation reading
them (in program order, a chain of them together), they join that call:
each weight's cast goes to its layer's stage. The equations are pure and
read only the function's inputs (or each other), so any place before
their first reader computes the same values.
"""

import jax.extend.core as jcore


def sink_input_glue(
  closed: jcore.ClosedJaxpr, scopes, fixed
) -> tuple[jcore.ClosedJaxpr, list[int]]:
  """``(closed reordered, the new order of its equations)``: each
  equation outside any module (``scopes[i]`` empty) that reads only the
  function's inputs (or such equations' results) moved to just before
  its first reader; one read by no equation (an output), or ``fixed[i]``
  (a scan's split iterations' own), stays. Without a module call (plain
  JAX code: all glue) nothing moves."""
  jaxpr = closed.jaxpr
  eqns = list(jaxpr.eqns)
  n = len(eqns)
  if not any(scopes):
    return closed, list(range(n))
  available = set(jaxpr.invars) | set(jaxpr.constvars)
  movable = [False] * n
  for i, eqn in enumerate(eqns):
    if (
      not scopes[i]
      and not fixed[i]
      and not eqn.effects
      and all(_ready(v, available) for v in eqn.invars)
    ):
      movable[i] = True
      available.update(eqn.outvars)
  if not any(movable):
    return closed, list(range(n))
  first_reader = {}  # var -> the first equation reading it
  for i, eqn in enumerate(eqns):
    for v in eqn.invars:
      if isinstance(v, jcore.Var):
        first_reader.setdefault(v, i)
  # Where each movable equation goes: before its first reader, or (that
  # reader movable too) where that one goes. Readers come later: resolved
  # from the end.
  target = [None] * n
  for i in reversed(range(n)):
    if not movable[i]:
      continue
    readers = [first_reader[v] for v in eqns[i].outvars if v in first_reader]
    if not readers or any(v in jaxpr.outvars for v in eqns[i].outvars):
      continue  # (An output, or read by none: stays.)
    target[i] = min(j if target[j] is None else target[j] for j in readers)
  if all(t is None for t in target):
    return closed, list(range(n))
  before = {}  # position -> the equations moved to just before it
  for i, to in enumerate(target):
    if to is not None:
      before.setdefault(to, []).append(i)
  order = []
  for j in range(n):
    order.extend(before.get(j, ()))
    if target[j] is None:
      order.append(j)
  reordered = jaxpr.replace(eqns=[eqns[i] for i in order])
  return jcore.ClosedJaxpr(reordered, closed.consts), order


def _ready(v, available) -> bool:
  """Whether operand ``v`` is a literal or an available variable."""
  return not isinstance(v, jcore.Var) or v in available
