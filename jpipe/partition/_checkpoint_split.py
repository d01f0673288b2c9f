"""A ``jax.checkpoint`` holding several nodes' module calls, one per node.

A loss wrapped whole in ``jax.checkpoint`` (or a model in ``nn.remat``)
traces to one ``remat`` equation holding every module call: one node,
nothing to split; a rematted block is one node at every depth, so a cut
inside it (two large blocks, four stages) is not there to choose. Remat
only trades memory for recomputation: it changes what backward keeps, not
what anything computes. So at a depth where a checkpoint's body holds the
work of several nodes, ``split_checkpoints`` replaces it by one
checkpoint per node's run of its equations, each with the original's
policy (``save_only_these_names``, ...) and ``prevent_cse``: the same
function, rematerialized per node (what a rematted stage keeps is its
pieces' inputs, as per-block remat keeps each block's). A checkpoint whose
work is one node's stays as it is, so remat is split only as far as the
cut needs. Nested checkpoints split first.
"""

import dataclasses

import jax.extend.core as jcore

from jpipe.partition._scopes import (
  components,
  eqn_scope,
  inputs_glue_joins_next,
  run_keys,
)

# A checkpoint's primitive name (jax's, then older jax's).
REMAT = ("remat2", "checkpoint")


def deep_paths(jaxpr, scopes) -> list[tuple[str, ...]]:
  """The module paths ``split_checkpoints`` can cut at: each equation's
  scope, a checkpoint's replaced by those of its body's equations (full
  paths, nested checkpoints followed)."""
  out = []
  for eqn, scope in zip(jaxpr.eqns, scopes, strict=True):
    if _splittable(eqn):
      out.extend(_body_paths(eqn, ()))
    else:
      out.append(scope)
  return out


@dataclasses.dataclass(frozen=True)
class SplitCheckpoints:
  """``split_checkpoints``' result.

  Attributes:
    closed_jaxpr: the same function, checkpoints split per node.
    paths: every equation's full module path (a piece: its run's).
    origin: per equation, the index of the equation it is (or is a piece
      of) in the input.
  """

  closed_jaxpr: jcore.ClosedJaxpr
  paths: tuple[tuple[str, ...], ...]
  origin: tuple[int, ...]


def split_checkpoints(
  closed: jcore.ClosedJaxpr, scopes, depth: int, strip: int
) -> SplitCheckpoints:
  """``closed`` with every checkpoint whose body's work spans nodes at
  ``depth`` replaced by one checkpoint per node's run (see the module
  doc). ``scopes``: each top-level equation's full module path; a key
  is a path's ``depth`` components after its first ``strip`` (the root
  module's name, where one module holds everything)."""
  body = _expand(closed.jaxpr, list(scopes), depth, strip)
  if body is None:
    n = len(closed.jaxpr.eqns)
    return SplitCheckpoints(closed, tuple(scopes), tuple(range(n)))
  eqns, paths, origin, outvars = body
  jaxpr = closed.jaxpr.replace(eqns=eqns, outvars=outvars)
  return SplitCheckpoints(
    jcore.ClosedJaxpr(jaxpr, closed.consts), tuple(paths), tuple(origin)
  )


def _splittable(eqn) -> bool:
  return eqn.primitive.name in REMAT


def _body_paths(eqn, base) -> list[tuple[str, ...]]:
  """Full paths of a checkpoint's body's equations, nested ones' bodies
  followed (``base``: the path the checkpoint's name stack is under)."""
  inner = base + components(eqn.source_info.name_stack)
  out = []
  for e in eqn.params["jaxpr"].eqns:
    if _splittable(e):
      out.extend(_body_paths(e, inner))
    else:
      out.append(inner + eqn_scope(e))
  return out


def _expand(jaxpr, paths, depth, strip):
  """``(eqns, paths, origin, outvars)`` of ``jaxpr`` with its splittable
  checkpoints split (``paths``: its equations' full paths); None when
  none is."""
  eqns, out_paths, origin = [], [], []
  renamed = {}  # A split checkpoint's output -> the atom that holds it.

  def read(atom):
    return renamed.get(atom, atom) if isinstance(atom, jcore.Var) else atom

  changed = False
  for i, (eqn, path) in enumerate(zip(jaxpr.eqns, paths, strict=True)):
    if renamed:
      eqn = eqn.replace(invars=[read(v) for v in eqn.invars])
    pieces = _pieces(eqn, path, depth, strip) if _splittable(eqn) else None
    if pieces is None:
      eqns.append(eqn)
      out_paths.append(path)
      origin.append(i)
      continue
    changed = True
    piece_eqns, piece_paths, piece_renamed = pieces
    eqns.extend(piece_eqns)
    out_paths.extend(piece_paths)
    origin.extend([i] * len(piece_eqns))
    renamed.update(piece_renamed)
  if not changed:
    return None
  return eqns, out_paths, origin, [read(v) for v in jaxpr.outvars]


def _pieces(eqn, path, depth, strip):
  """``(eqns, paths, renamed)``: checkpoint ``eqn`` as one checkpoint per
  node's run of its body (``renamed``: its outputs now held elsewhere);
  None when its body's work is one node's."""
  body = eqn.params["jaxpr"]
  base = path[: len(path) - len(eqn_scope(eqn))] + components(
    eqn.source_info.name_stack
  )
  inner_paths = [base + eqn_scope(e) for e in body.eqns]
  expanded = _expand(body, inner_paths, depth, strip)
  if expanded is None:
    body_eqns, outvars = list(body.eqns), list(body.outvars)
  else:
    body_eqns, inner_paths, _, outvars = expanded
  scopes = inputs_glue_joins_next(body_eqns, [p[strip:] for p in inner_paths])
  keys = run_keys(scopes, depth)
  if len(set(keys)) <= 1:
    return None
  runs = [[0]]
  for i in range(1, len(body_eqns)):
    if keys[i] == keys[i - 1]:
      runs[-1].append(i)
    else:
      runs.append([i])
  run_paths = [_run_path([inner_paths[i] for i in run], strip) for run in runs]
  eqns, renamed = _wire(eqn, body.invars, body_eqns, outvars, runs)
  return eqns, run_paths, renamed


def _wire(eqn, invars, body_eqns, outvars, runs):
  """``(eqns, renamed)``: the runs of ``body_eqns`` as checkpoint
  equations of their own, reading and writing the enclosing jaxpr's
  values (``renamed``: ``eqn``'s outputs now held elsewhere)."""
  run_of = {}
  for r, run in enumerate(runs):
    for i in run:
      for v in body_eqns[i].outvars:
        run_of[v] = r
  # Per run, the body values read after it (by later runs or as outputs).
  needed = [set() for _ in runs]
  later = {v for v in outvars if isinstance(v, jcore.Var)}
  for r in range(len(runs) - 1, -1, -1):
    needed[r] = set(later)
    for i in runs[r]:
      later.update(v for v in body_eqns[i].invars if isinstance(v, jcore.Var))
  env = dict(zip(invars, eqn.invars, strict=True))
  # Outputs made by a run are written straight to the call's variables.
  direct = {}
  for got, out in zip(outvars, eqn.outvars, strict=True):
    if got in run_of and got not in direct and not _dropped(out):
      direct[got] = out
  new_eqns = []
  # (The checkpoint's own names, as the pieces' arguments are others.)
  debug = eqn.params["jaxpr"].debug_info.with_unknown_names()
  for r, run in enumerate(runs):
    run_eqns = [body_eqns[i] for i in run]
    reads = _unique(
      v
      for e in run_eqns
      for v in e.invars
      if isinstance(v, jcore.Var) and run_of.get(v) != r
    )
    outs = _unique(
      v
      for e in run_eqns
      for v in e.outvars
      if not _dropped(v) and v in needed[r]
    )
    effects = frozenset().union(*(e.effects for e in run_eqns))
    piece = jcore.Jaxpr([], reads, outs, run_eqns, effects, debug)
    held = [direct.get(v) or jcore.Var(v.aval) for v in outs]
    env.update(zip(outs, held, strict=True))
    new_eqns.append(
      jcore.new_jaxpr_eqn(
        [env[v] for v in reads],
        held,
        eqn.primitive,
        {**eqn.params, "jaxpr": piece},
        effects,
        eqn.source_info,
        eqn.ctx,
      )
    )
  renamed = {}
  for got, out in zip(outvars, eqn.outvars, strict=True):
    value = env.get(got, got) if isinstance(got, jcore.Var) else got
    if not _dropped(out) and value is not out:
      renamed[out] = value
  return new_eqns, renamed


def _run_path(paths, strip) -> tuple[str, ...]:
  """A run's path: the longest prefix its module calls' paths share (its
  glue's, outside any module, left out)."""
  paths = [p for p in paths if len(p) > strip] or paths
  longest = max(paths, key=len)
  common = []
  for k, part in enumerate(longest):
    if any(len(p) > k and p[k] != part for p in paths):
      break
    common.append(part)
  return tuple(common)


def _dropped(v) -> bool:
  return isinstance(v, jcore.DropVar)


def _unique(values) -> list:
  return list(dict.fromkeys(values))
