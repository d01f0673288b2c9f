"""A slice of a concatenation read from the part it selects.

A scan over layers split into iterations (``_scan_layers``) concatenates
its iterations' stacked outputs (``ys``) and slices its non-param scanned
inputs row by row. Where such a concatenation is sliced back into rows --
a decoding cache stacked per layer, passed to the stages as rows
(``runtime/execute/generation.py``), or the input rows stacked for the
scan -- the slice of row k is row k itself: ``forward_rows`` reads the
part directly, so each row stays on the stage of its layer, and drops
the concatenations and slices nothing reads any more.
"""

import jax.extend.core as jcore


def forward_rows(jaxpr):
  """``(jaxpr, kept)``: ``jaxpr`` with every full-row slice along axis 0
  of a ``concatenate`` along axis 0 replaced by the operand it selects,
  and the slices and concatenations left unread removed; ``kept`` the
  indices (into ``jaxpr.eqns``) of the equations kept, in order (the
  same jaxpr and every index when nothing changed)."""
  parts = {}  # A concatenation's result -> [(start, stop, operand)].
  renamed = {}
  moved = {}  # A transpose's result -> (its operand, its permutation).
  for eqn in jaxpr.eqns:
    name = eqn.primitive.name
    if name == "transpose":
      x, perm = eqn.invars[0], tuple(eqn.params["permutation"])
      x = renamed.get(x, x)
      if x in moved and _composed(moved[x][1], perm) == tuple(range(len(perm))):
        # (A transpose undone: a stacked leaf's layer axis moved to the
        # model's place and back for the scan.)
        renamed[eqn.outvars[0]] = moved[x][0]
      else:
        moved[eqn.outvars[0]] = x, perm
    elif name == "concatenate" and eqn.params["dimension"] == 0:
      start, runs = 0, []
      for x in eqn.invars:
        stop = start + x.aval.shape[0]
        runs.append((start, stop, x))
        start = stop
      parts[eqn.outvars[0]] = runs
    elif name == "slice" and renamed.get(eqn.invars[0], eqn.invars[0]) in parts:
      operand = renamed.get(eqn.invars[0], eqn.invars[0])
      part = _selected(eqn, parts[operand])
      if part is not None:
        renamed[eqn.outvars[0]] = renamed.get(part, part)
  if not renamed:
    return jaxpr, tuple(range(len(jaxpr.eqns)))

  def read(atom):
    return renamed.get(atom, atom) if isinstance(atom, jcore.Var) else atom

  eqns = [e.replace(invars=[read(v) for v in e.invars]) for e in jaxpr.eqns]
  outvars = [read(v) for v in jaxpr.outvars]
  kept = _live(eqns, outvars)
  return (
    jaxpr.replace(eqns=[eqns[i] for i in kept], outvars=outvars),
    kept,
  )


def _composed(first, then) -> tuple[int, ...]:
  """The permutation of transposing by ``first``, then by ``then``."""
  return tuple(first[d] for d in then)


def _selected(eqn, runs):
  """The operand a slice selects whole (every other axis whole, unit
  strides), or None."""
  p = eqn.params
  start, limit = p["start_indices"], p["limit_indices"]
  shape = eqn.invars[0].aval.shape
  if p["strides"] is not None and any(s != 1 for s in p["strides"]):
    return None
  if (
    tuple(start[1:]) != (0,) * (len(shape) - 1) or tuple(limit[1:]) != shape[1:]
  ):
    return None
  for begin, end, x in runs:
    if (begin, end) == (start[0], limit[0]):
      return x
  return None


def _live(eqns, outvars) -> tuple[int, ...]:
  """Indices of the equations to keep: all but the slices and
  concatenations whose results nothing reads (the forwarded rows')."""
  read = {v for v in outvars if isinstance(v, jcore.Var)}
  kept = []
  for i in range(len(eqns) - 1, -1, -1):
    e = eqns[i]
    removable = e.primitive.name in ("slice", "concatenate", "transpose")
    if removable and not any(v in read for v in e.outvars):
      continue
    kept.append(i)
    read.update(v for v in e.invars if isinstance(v, jcore.Var))
  return tuple(reversed(kept))
