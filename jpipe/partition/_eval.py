"""Evaluating a jaxpr equation by equation, into an environment.

Stage functions run a subset of the traced model's equations, and a
split backward runs two subsets of its own: both evaluate equations one
at a time, as ``jax.core.eval_jaxpr`` does for a whole jaxpr.
"""

import jax.extend.core as jcore


def read(env, v):
  """The value of ``v``: a literal's own, else ``env``'s."""
  return v.val if isinstance(v, jcore.Literal) else env[v]


def eval_eqn(eqn, env):
  """Evaluates one jaxpr equation into ``env`` (as jax.core.eval_jaxpr)."""
  invals = [read(env, v) for v in eqn.invars]
  bind_params = eqn.primitive.get_bind_params(eqn.params)
  ctx = getattr(getattr(eqn, "ctx", None), "manager", None)
  if ctx is not None:
    with ctx:
      out = eqn.primitive.bind(*invals, **bind_params)
  else:
    out = eqn.primitive.bind(*invals, **bind_params)
  outs = out if eqn.primitive.multiple_results else [out]
  for v, x in zip(eqn.outvars, outs, strict=True):
    if not isinstance(v, jcore.DropVar):
      env[v] = x
