"""Glue computed from the params (and the batch) alone moves next to its
reader.

A loss may prepare its params outside any module: cast to the compute
dtype at its top (jmp's ``cast_to_compute``, T5X's master weights:
``p16 = tree.map(lambda w: w.astype(bf16), p32)``), scaled, reshaped.
Traced, those equations come first, before any module call, and glue
that reads only the inputs joins the call after it: every cast would sit
on the first stage, which would then hold every param, its gradient and
its optimizer state, and send each later stage its weights every
microbatch (an outside check found 100 KB of weights crossing for 4 KB
of activations, and the later stages holding none). Moved to just before
the first equation reading them (a chain of them together), they join
that call: each weight's cast goes to its layer's stage. The equations
are pure and read only the function's inputs (or each other), so any
place before their readers computes the same values. Glue of the batch
alone (a mask, position ids) keeps joining the call after it, as it did.
"""

import jax.extend.core as jcore


def sink_input_glue(
  closed: jcore.ClosedJaxpr, scopes, fixed, num_param_leaves: int
) -> tuple[jcore.ClosedJaxpr, list[int]]:
  """``(closed reordered, the new order of its equations)``: each
  equation outside any module (``scopes[i]`` empty) that reads only the
  function's inputs (or such equations' results), a param among them
  (the first ``num_param_leaves`` inputs), moved to just before its
  first reader; one read by no equation (an output), or ``fixed[i]`` (a
  scan's split iterations' own), stays. Glue of the batch alone stays
  where it is (it joins the call after it: ``_scopes``), so the plans of
  models without such casts are as they were. Without a module call
  (plain JAX code: all glue) nothing moves."""
  jaxpr = closed.jaxpr
  eqns = list(jaxpr.eqns)
  n = len(eqns)
  if not any(scopes):
    return closed, list(range(n))
  inputs = set(jaxpr.invars) | set(jaxpr.constvars)
  of_params = set(jaxpr.invars[:num_param_leaves])  # (and glue of them)
  movable = [False] * n
  for i, eqn in enumerate(eqns):
    reads = [v for v in eqn.invars if isinstance(v, jcore.Var)]
    if (
      not scopes[i]
      and not fixed[i]
      and not eqn.effects
      and all(v in inputs or v in of_params for v in reads)
      and any(v in of_params for v in reads)
    ):
      movable[i] = True
      of_params.update(eqn.outvars)
  if not any(movable):
    return closed, list(range(n))
  readers_of = {}  # var -> the equations reading it
  for i, eqn in enumerate(eqns):
    for v in eqn.invars:
      if isinstance(v, jcore.Var):
        readers_of.setdefault(v, []).append(i)
  # Where each movable equation goes: before the earliest place any of its
  # readers ends up (a movable reader may itself move down, past another
  # reader: every reader counts). Readers come later: resolved from the
  # end.
  target = [None] * n
  for i in reversed(range(n)):
    if not movable[i]:
      continue
    readers = [j for v in eqns[i].outvars for j in readers_of.get(v, ())]
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
