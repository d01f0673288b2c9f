"""Module paths of a jaxpr's equations, and where glue outside modules goes.

A path is a tuple of name-stack components (``("Model", "block_0",
"fc1")``). Lifted transforms (``nn.scan``, ``nn.remat``) record their
equation at the caller's scope and the module path only inside the body,
relative to it; ``eqn_scope`` appends the body's common prefix.
"""

import os

import jax.extend.core as jcore


def components(name_stack) -> tuple[str, ...]:
  """A name stack as a tuple of its non-empty components."""
  return tuple(p for p in str(name_stack).split("/") if p)


def eqn_scope(eqn) -> tuple[str, ...]:
  """The equation's module path: its own, then the common prefix of its
  bodies' equations' (relative) paths."""
  outer = components(eqn.source_info.name_stack)
  inner = [
    components(e.source_info.name_stack)
    for j in jcore.jaxprs_in_params(eqn.params)
    for e in j.eqns
  ]
  inner = [s for s in inner if s]
  if inner:
    outer = outer + tuple(os.path.commonprefix(inner))
  return outer


def nested_paths(jaxpr, *, glue: bool = False) -> list[tuple[str, ...]]:
  """Module paths of ``jaxpr``'s equations, one with bodies (a jit, a
  scan) replaced by its bodies' equations' paths under its own; with
  ``glue``, ``()`` for each equation outside any module too."""
  out = []
  for e in jaxpr.eqns:
    own = components(e.source_info.name_stack)
    below = [
      own + s
      for j in jcore.jaxprs_in_params(e.params)
      for s in nested_paths(j, glue=glue)
    ]
    out.extend(below or ([own] if own or glue else []))
  return out


def inputs_glue_joins_next(eqns, scopes) -> list[tuple[str, ...]]:
  """``scopes`` (one per equation of ``eqns``; ``()`` for glue) with glue
  that reads only the function's inputs (a token sliced from the batch, a
  mask made from it) scoped as the module call after it: it is work for
  that call, not for the one before (which may sit on a later stage: a
  decoding loop's next position slices its token after the last layer
  ran). Glue reading a module's results keeps joining the run before it
  (``run_keys``)."""
  scopes = list(scopes)
  made = set()  # Values some module call's work depends on.
  glue = []  # Equations of the current run of glue reading inputs only.
  for i, eqn in enumerate(eqns):
    reads_made = any(isinstance(v, jcore.Var) and v in made for v in eqn.invars)
    if scopes[i] and glue:
      for j in glue:
        scopes[j] = scopes[i]
    if scopes[i] or reads_made:
      made.update(eqn.outvars)
      glue = []
    else:
      glue.append(i)
  return scopes


def run_keys(scopes, depth: int) -> list[str | None]:
  """Per equation, the node key its path gives at ``depth`` (its first
  ``depth`` components joined by "/"), the key before it for glue (the
  first key for leading glue); all None where no equation has a path."""
  keys = ["/".join(s[:depth]) if s else None for s in scopes]
  first = next((k for k in keys if k is not None), None)
  out, current = [], first
  for key in keys:
    current = key if key is not None else current
    out.append(current)
  return out
