"""A scan over layers nested in a scan, read as one scan over every layer.

``nn.remat_scan(Block, lengths=(a, b))`` (flax's O(sqrt(N))-memory stack,
EasyLM's ``remat_scan_lengths``) and a plain ``nn.scan`` inside an
``nn.scan`` stack their params ``[a, b, ...]`` and run them as an outer
scan of length ``a`` whose body -- under ``checkpoint`` for ``remat_scan``
-- is one inner scan of length ``b`` over the outer row's ``[b, ...]``.
``split_layer_scans`` splits the outer scan only: ``a`` nodes of ``b``
layers each, so such a model had at most ``a`` stages.

``nested_scans_as_one`` rewrites such a pair into one scan of length
``a * b`` over the stacked inputs reshaped to ``[a * b, ...]`` (a reshape
of a param: ``_scan_layers`` splits it into rows, row ``i * b + j`` the
layer ``[i, j]``), its body the inner body, under the outer
``checkpoint`` (same policy) per layer when there was one. The function
is the same; the layers then split one per node. A deeper nest has its
two outermost levels flattened (``a * b`` nodes, each a scan over the
rest).

A pair qualifies when both scans run forwards and the outer body is the
inner scan, or a ``checkpoint`` holding equations then the inner scan,
where:
- the inner scan's constants are the same every outer iteration (outer
  constants, carries every layer passes on unchanged -- EasyLM's
  attention mask -- or values computed from those), its carries are the
  outer carries the body updates (each once, returned in the same place),
  and its scanned inputs are rows of the outer ones or computed from them;
- the equations before the inner scan read no updated carry: those
  computing from constants move before the flat scan, those computing
  from an outer row (a layer group's dropout key split into its layers')
  run for every outer row at once (``jax.vmap``), their outputs stacked
  ``[a, b, ...]`` and scanned like the params;
- the outer scan reads no model input other than params as a scanned
  input (model state stacked by layer keeps its rows on the outer axis:
  ``build/state_rows.py``).
Anything else is left as it is.
"""

import dataclasses
from typing import Any

import jax
import jax.extend.core as jcore

_REMAT = "remat2"  # (jax.checkpoint's primitive.)


def nested_scans_as_one(
  closed: jcore.ClosedJaxpr, num_param_leaves: int
) -> jcore.ClosedJaxpr:
  """``closed`` with each qualifying nested pair of scans over params as
  one scan (module doc); ``closed`` itself where none is."""
  jaxpr = closed.jaxpr
  params = set(jaxpr.invars[:num_param_leaves])
  inputs = set(jaxpr.invars[num_param_leaves:])
  eqns, outvars, changed = list(jaxpr.eqns), list(jaxpr.outvars), False
  i = 0
  while i < len(eqns):
    found = _flattened(eqns[i], params, inputs)
    if found is None:
      i += 1
      continue
    flat, same = found
    later = [_renamed(e, same) for e in eqns[i + 1 :]]
    outvars = [same.get(v, v) if _hashable(v) else v for v in outvars]
    eqns = [*eqns[:i], *flat, *later]
    i += len(flat)  # (The flat scan's inputs are no params: done.)
    changed = True
  if not changed:
    return closed
  new = jaxpr.replace(eqns=eqns, outvars=outvars)
  return jcore.ClosedJaxpr(new, closed.consts)


def _flattened(eqn, params: set, inputs: set):
  """``(equations, {outer carry output: its input})``: ``eqn`` (an outer
  scan) as its prologue (below), the reshapes of its scanned inputs, one
  flat scan and the reshapes of its stacked outputs; an outer carry that
  the body returns unchanged (the inner scan reads it as a constant) is
  its input. None when ``eqn`` does not qualify."""
  pair = _match(eqn, params, inputs)
  return None if pair is None else _rewrite(pair)


@dataclasses.dataclass(frozen=True)
class _Pair:
  """A qualifying pair: the outer scan ``eqn``, its ``inner`` scan under
  ``remat`` (or None), the ``moved`` prologue, what the inner scan's
  ``consts`` / ``carry`` / ``xs`` are outside (``_Kinds``), per outer
  body output the inner output it is (``produced``), and the carries the
  body passes on unchanged."""

  eqn: Any
  inner: Any
  remat: Any
  moved: list
  consts: list
  carry: list
  xs: list
  produced: list
  passthrough: set


def _match(eqn, params: set, inputs: set) -> _Pair | None:
  if eqn.primitive.name != "scan":
    return None
  p = eqn.params
  nc, nk = p["num_consts"], p["num_carry"]
  outer_xs = eqn.invars[nc + nk :]
  if p["reverse"] or not outer_xs or p["jaxpr"].consts:
    return None
  if not any(x in params for x in outer_xs if isinstance(x, jcore.Var)):
    return None
  if any(x in inputs and x not in params for x in outer_xs):
    return None  # (Model state or the batch scanned by layer.)
  found = _inner_scan(p["jaxpr"].jaxpr)
  if found is None:
    return None
  inner, origin, remat, prologue = found
  ic, ik = inner.params["num_consts"], inner.params["num_carry"]
  if inner.params["reverse"]:
    return None
  body = p["jaxpr"].jaxpr
  kinds = _Kinds(eqn, body, origin)
  moved = _prologue(prologue, kinds, eqn, remat)
  if moved is None:
    return None
  seen = [kinds.of(v) for v in inner.invars]
  if any(k is None for k in seen):
    return None
  consts, carry, xs = seen[:ic], seen[ic : ic + ik], seen[ic + ik :]
  if any(k[0] != "same" for k in consts) or any(k[0] != "row" for k in xs):
    return None
  # Every carry the body updates is one of the inner scan's, once.
  updated = [j for j in range(nk) if j not in kinds.passthrough]
  if any(k[0] != "carry" for k in carry):
    return None
  if sorted(k[1] for k in carry) != updated:
    return None
  # Outputs: each outer carry returned where the inner returns it; each
  # outer stacked output one of the inner's.
  inner_out = {v: i for i, v in enumerate(inner.outvars)}
  produced = [
    inner_out.get(origin.get(v, v)) if _hashable(v) else None
    for v in body.outvars
  ]
  for m, (_, j) in enumerate(carry):
    if produced[j] != m:
      return None
  if any(i is None or i < ik for i in produced[nk:]):
    return None
  return _Pair(
    eqn, inner, remat, moved, consts, carry, xs, produced, kinds.passthrough
  )


def _rewrite(pair: _Pair):
  """``_flattened``'s equations and renames for a qualifying pair."""
  eqn, inner = pair.eqn, pair.inner
  nc, nk = eqn.params["num_consts"], eqn.params["num_carry"]
  ik = inner.params["num_carry"]
  a, b = eqn.params["length"], inner.params["length"]
  made = list(pair.moved)
  flat_xs = {}
  for _, x in pair.xs:  # [a, b, ...] as [a * b, ...].
    if x not in flat_xs:
      flat_xs[x] = _var((a * b, *x.aval.shape[2:]), x.aval.dtype)
      made.append(_reshape_eqn(x, flat_xs[x], eqn))
  invars = [k[1] for k in pair.consts]
  invars += [eqn.invars[nc + j] for _, j in pair.carry]
  invars += [flat_xs[x] for _, x in pair.xs]
  outvars = [eqn.outvars[j] for _, j in pair.carry]
  # Each inner stacked output [a * b, ...], reshaped to the outer ones.
  readers: list[list] = [[] for _ in inner.outvars[ik:]]
  for j, i in enumerate(pair.produced[nk:]):
    y = eqn.outvars[nk + j]
    if not isinstance(y, jcore.DropVar):
      readers[i - ik].append(y)
  unstacked = []
  for v, ys in zip(inner.outvars[ik:], readers, strict=True):
    aval = jax.core.ShapedArray((a * b, *v.aval.shape[1:]), v.aval.dtype)
    flat = jcore.Var(aval) if ys else jcore.DropVar(aval)
    outvars.append(flat)
    unstacked.extend(_reshape_eqn(flat, y, eqn) for y in ys)
  new = eqn.replace(
    invars=invars,
    outvars=outvars,
    params={
      **inner.params,
      "length": a * b,
      "jaxpr": _under(pair.remat, inner.params["jaxpr"]),
      "unroll": 1,
    },
  )
  same = {
    eqn.outvars[j]: eqn.invars[nc + j]
    for j in pair.passthrough
    if not isinstance(eqn.outvars[j], jcore.DropVar)
  }
  return [*made, new, *unstacked], same


class _Kinds:
  """What a variable of the outer body (or of its checkpoint) is outside
  it: ``("same", v)`` the same value ``v`` every outer iteration (an outer
  constant, a carry the body returns unchanged, a literal, or computed
  from those), ``("carry", j)`` outer carry j, ``("row", v)`` row i of
  ``v`` ``[a, ...]`` in outer iteration i (a scanned input, or computed
  from one); None for anything else."""

  def __init__(self, eqn, body, origin):
    p = eqn.params
    self.nc, self.nk = p["num_consts"], p["num_carry"]
    self.eqn, self.origin = eqn, origin
    self.where = {v: i for i, v in enumerate(body.invars)}
    # (Through a checkpoint: its output is its input, the body's input.)
    self.passthrough = {
      j
      for j in range(self.nk)
      if _through(origin, body.outvars[j]) is body.invars[self.nc + j]
    }
    self.made: dict = {}  # The prologue's outputs.

  def of(self, v):
    if isinstance(v, jcore.Literal):
      return ("same", v)
    if v in self.made:
      return self.made[v]
    i = self.where.get(self.origin.get(v, v))
    if i is None:
      return None
    top = self.eqn.invars[i]
    if i < self.nc:
      return ("same", top)
    if i < self.nc + self.nk:
      j = i - self.nc
      return ("same", top) if j in self.passthrough else ("carry", j)
    return ("row", top)


def _prologue(eqns, kinds: _Kinds, like, remat) -> list | None:
  """The equations before the inner scan, moved before the outer scan
  ``like``: those computing the same value every outer iteration as they
  are, those computing from the outer rows (a layer group's RNG key split
  into its layers' keys) batched over the outer axis (``jax.vmap``), named
  under the scan's module; ``kinds`` learns their outputs. None when one
  reads a carry the body updates, or has effects."""
  prefix = like.source_info.name_stack  # (A body's names are relative.)
  if remat is not None:
    prefix = prefix + remat.source_info.name_stack
  moved, rows = [], []
  for e in eqns:
    seen = [kinds.of(v) for v in e.invars]
    if e.effects or any(k is None or k[0] == "carry" for k in seen):
      return None
    if all(k[0] == "same" for k in seen):
      named = e.source_info.replace(
        name_stack=prefix + e.source_info.name_stack
      )
      moved.append(e.replace(invars=[k[1] for k in seen], source_info=named))
      kinds.made.update((o, ("same", o)) for o in e.outvars)
    else:
      rows.append((e, seen))
      kinds.made.update((o, ("row", None)) for o in e.outvars)
  if rows:
    batched = _batched(rows, kinds, prefix, remat)
    if batched is None:
      return None
    moved.extend(batched)
  return moved


def _batched(rows, kinds: _Kinds, prefix, remat) -> list | None:
  """The per-row equations ``rows`` as equations over every outer row
  (their outputs stacked ``[a, ...]``, recorded in ``kinds``)."""
  inside = {o for e, _ in rows for o in e.outvars}
  args, axes, avals, sub_eqns = {}, [], [], []
  for e, seen in rows:
    invars = []
    for v, k in zip(e.invars, seen, strict=True):
      if isinstance(v, jcore.Literal) or v in inside:
        invars.append(v)
        continue
      top = k[1]
      if top not in args:
        args[top] = _var(v.aval.shape, v.aval.dtype)
        axes.append(0 if k[0] == "row" else None)
        avals.append(jax.ShapeDtypeStruct(top.aval.shape, top.aval.dtype))
      invars.append(args[top])
    sub_eqns.append(e.replace(invars=invars))
  outs = [
    o for e, _ in rows for o in e.outvars if not isinstance(o, jcore.DropVar)
  ]
  # (The checkpoint's names, as the arguments are others.)
  debug = remat.params["jaxpr"].debug_info.with_unknown_names()
  sub = jcore.Jaxpr((), list(args.values()), outs, sub_eqns, debug_info=debug)

  def per_row(*xs):
    return jax.core.eval_jaxpr(sub, (), *xs)

  traced = jax.make_jaxpr(jax.vmap(per_row, in_axes=tuple(axes)))(*avals)
  if traced.consts:
    return None
  rename = dict(zip(traced.jaxpr.invars, args, strict=True))
  made = []
  for e in traced.jaxpr.eqns:
    stack = e.source_info.name_stack
    if str(stack[:1]) == "vmap()":  # (Ours, not the model's.)
      stack = stack[1:]
    named = e.source_info.replace(name_stack=prefix + stack)
    made.append(
      e.replace(
        invars=[rename.get(v, v) if _hashable(v) else v for v in e.invars],
        source_info=named,
      )
    )
  for o, t in zip(outs, traced.jaxpr.outvars, strict=True):
    if not _hashable(t):
      return None  # (A literal: nothing to scan.)
    kinds.made[o] = ("row", rename.get(t, t))
  return made


def _inner_scan(body):
  """``(inner scan eqn, {var inside a checkpoint: the body's var}, the
  checkpoint eqn or None, the equations before the scan)`` when ``body``
  is a scan, or a checkpoint holding equations then a scan; else None."""
  if len(body.eqns) != 1:
    return None
  (only,) = body.eqns
  if only.primitive.name == "scan":
    return only, {}, None, []
  if only.primitive.name != _REMAT:
    return None
  inside = only.params["jaxpr"]
  if not inside.eqns or inside.eqns[-1].primitive.name != "scan":
    return None
  if inside.constvars:
    return None
  origin = dict(zip(inside.invars, only.invars, strict=True))
  # The checkpoint's outputs are the scan's, in its order.
  out = dict(zip(only.outvars, inside.outvars, strict=True))
  *prologue, scan = inside.eqns
  return scan, {**origin, **out}, only, prologue


def _through(origin: dict, v):
  """``v`` followed through ``origin`` (a checkpoint's output to the
  value inside, an input inside to the body's) as far as it goes."""
  for _ in range(3):
    if not _hashable(v) or v not in origin:
      break
    v = origin[v]
  return v


def _hashable(v) -> bool:
  """(A Literal has no hash.)"""
  return not isinstance(v, jcore.Literal)


def _renamed(eqn, same: dict):
  """``eqn`` reading ``same[v]`` wherever it read ``v``."""
  if not same:
    return eqn
  invars = [same.get(v, v) if _hashable(v) else v for v in eqn.invars]
  return eqn.replace(invars=invars)


def _under(remat, body: jcore.ClosedJaxpr) -> jcore.ClosedJaxpr:
  """``body`` under ``remat``'s checkpoint (its policy), per iteration;
  ``body`` when there is none or it is one checkpoint already. (A body
  holding constants of its own keeps no checkpoint -- a checkpoint's
  jaxpr holds none --: the same values, its residuals saved.)"""
  if remat is None or body.consts:
    return body
  inner = body.jaxpr
  if len(inner.eqns) == 1 and inner.eqns[0].primitive.name == _REMAT:
    return body
  invars = [_var(v.aval.shape, v.aval.dtype) for v in inner.invars]
  outvars = [_var(v.aval.shape, v.aval.dtype) for v in inner.outvars]
  checkpoint = jcore.new_jaxpr_eqn(
    invars,
    outvars,
    remat.primitive,
    {**remat.params, "jaxpr": inner},
    inner.effects,
    remat.source_info,
  )
  wrapped = inner.replace(invars=invars, outvars=outvars, eqns=[checkpoint])
  return jcore.ClosedJaxpr(wrapped, ())


def _var(shape, dtype):
  return jcore.Var(jax.core.ShapedArray(shape, dtype))


def _reshape_eqn(x, out, like):
  return jcore.new_jaxpr_eqn(
    [x],
    [out],
    jax.lax.reshape_p,
    {"new_sizes": tuple(out.aval.shape), "dimensions": None, "sharding": None},
    jcore.no_effects,
    like.source_info,
  )
