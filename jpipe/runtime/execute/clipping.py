"""Global-norm gradient clipping over a pipeline's stages (optax's
``clip_by_global_norm`` across stages, devices and processes)."""

import functools

import jax
import jax.numpy as jnp

from jpipe.runtime.build.placement import local_copy, put
from jpipe.runtime.execute.hooks import DriverHooks


def plain_gradient(d) -> bool:
  """Whether driver ``d``'s stream steps read their gradient as
  accumulated: no clipping and no hooks reducing it (data parallel)."""
  return d.clip_global_norm is None and (
    type(d.hooks).reduce_gradient is DriverHooks.reduce_gradient
  )


def global_clip_factors(d, grads: dict, unscale: float = 1.0) -> dict:
  """``{stage: its gradient's factor}`` for this process's synchronous
  steps: ``unscale * min(1, clip / global norm)``, the norm over every
  stage's gradient (``grads``: this process's, reduced, each ``1 /
  unscale`` times the true one: a loss scale) times ``unscale``, summed
  per process and then over processes (every process calls it, in step
  order)."""
  # Every process of a group across processes computes its norm (a
  # program over the group); its lead alone adds it.
  norms = {s: grad_sq_norm(d, s, g) for s, g in sorted(grads.items())}
  led = [s for s in norms if d.transport.leads(s)]
  if not led:
    partial = None
  else:
    device = d.placement[led[0]].device
    partial = sum(put(local_copy(norms[s]), device) for s in led)
  total = d.transport.all_sum(partial)
  return {s: clip_factor(d, s, total, unscale) for s in grads}


def grad_sq_norm(d, s, grads):
  """Squared L2 norm of stage s's gradient (the packed accumulator or
  leaves), f32 on its device; a tied leaf counted by its owner only."""
  replica = d.tied.replica_positions(s)
  if replica:
    grads = [g for p, g in enumerate(grads) if p not in replica]
  return _sq_norm(tuple(grads))


def clip_factor(d, s, total_sq, unscale: float = 1.0):
  """``unscale * min(1, clip / (unscale * sqrt(total_sq)))`` on stage
  s's devices (no clip: ``unscale``); NaN where ``total_sq`` is not
  finite (a step that skips)."""
  clip = jnp.inf if d.clip_global_norm is None else d.clip_global_norm
  factor = _clip_factor(total_sq, clip, unscale, d.skip_nonfinite)
  return d.placement[s].put_replicated(factor)


@jax.jit
def skipped(factor):
  """Whether a step with clip ``factor`` skips (its norm not finite)."""
  return jnp.logical_not(jnp.isfinite(factor))


@jax.jit
def _sq_norm(leaves):
  """Sum of squares of every element of ``leaves``, in f32."""
  return sum(jnp.sum(jnp.square(x.astype(jnp.float32))) for x in leaves)


@functools.partial(jax.jit, static_argnums=3)
def _clip_factor(total_sq, clip, unscale, skip: bool):
  """``optax.clip_by_global_norm``'s factor of the gradient whose
  squared norm is ``total_sq * unscale**2`` (a loss-scaled one's times
  ``unscale``, its true norm) times ``unscale``: ``unscale`` below
  ``clip``, else ``unscale * clip / norm``; with ``skip``, NaN where the
  norm is not finite (the signal a skipping step reads)."""
  norm = jnp.sqrt(total_sq) * unscale
  factor = jnp.where(norm < clip, 1.0, clip / norm) * unscale
  return jnp.where(jnp.isfinite(norm), factor, jnp.nan) if skip else factor
