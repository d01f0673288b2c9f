"""The dtype a stage sums its microbatch gradients in (``grad_accum_dtype``).

By default a step's microbatch gradients are summed in the params' dtype,
as one device accumulating in a loop would: with bfloat16 params that sum
keeps 8 bits of mantissa, so a microbatch's small gradient beside a large
running sum is lost (in bfloat16, 1.0 + 0.003 is 1.0; the error grows
with the number of microbatches). ``grad_accum_dtype="float32"``
(DeepSpeed's ``grad_accum_dtype``) widens every floating gradient leaf as
it enters the accumulator: each backward's gradient is computed in the
params' dtype, then cast and added in float32, the tied leaves' sums and
the replicas' reductions travel in it, and the optimizer receives it (its
update is cast back to the params' dtype by ``optax.apply_updates``).
"""

from typing import Any

import jax
import jax.numpy as jnp


def check_grad_accum_dtype(value: Any) -> jnp.dtype | None:
  """``value`` ("float32", ``jnp.float32``, ...) as a floating dtype, or
  None (None or "": the params' own dtypes); a ValueError names a bad one."""
  if value is None or (isinstance(value, str) and not value.strip()):
    return None
  try:
    dtype = jnp.dtype(value.strip() if isinstance(value, str) else value)
  except TypeError:
    dtype = None
  if dtype is None or not jnp.issubdtype(dtype, jnp.floating):
    raise ValueError(
      f"grad_accum_dtype={value!r} is not a floating dtype: use 'float32' "
      "(sums bfloat16 / float16 gradients in float32), 'bfloat16', "
      "'float16', or None (the params' own dtypes)"
    )
  if dtype == jnp.float64 and not jax.config.jax_enable_x64:
    raise ValueError(
      "grad_accum_dtype='float64' needs 64-bit JAX (jax.config.update("
      "'jax_enable_x64', True)); else use 'float32'"
    )
  return dtype


def cast_floating(x, dtype):
  """``x`` in ``dtype`` where both are floating, else as it is (a float0
  gradient, a count, a key; ``dtype`` None)."""
  have = getattr(x, "dtype", None)
  if (
    dtype is None
    or have is None
    or have == dtype
    or not jnp.issubdtype(have, jnp.floating)
    or not jnp.issubdtype(dtype, jnp.floating)
  ):
    return x
  return x.astype(dtype)


def gradient_dtype(param_dtype, accum_dtype) -> jnp.dtype:
  """The dtype a leaf of ``param_dtype`` is accumulated in: ``accum_dtype``
  for a floating leaf (None: its own), any other as it is."""
  if accum_dtype is None or not jnp.issubdtype(param_dtype, jnp.floating):
    return param_dtype
  return jnp.dtype(accum_dtype)


def gradient_avals(param_avals, accum_dtype):
  """The accumulated gradient's shapes and dtypes for params'
  ``param_avals`` (any pytree of avals or arrays; ``gradient_dtype`` per
  leaf), in its structure."""
  return jax.tree.map(
    lambda a: jax.ShapeDtypeStruct(
      a.shape, gradient_dtype(a.dtype, accum_dtype)
    ),
    param_avals,
  )


def promoted_state(update, state, params, grads, extra=None):
  """An optax ``state`` (``tx.init(params)``'s) in the dtypes one step on
  gradients of ``grads``' dtypes leaves it in (traceable; ``grads``: avals
  or arrays; ``extra``: more keyword arguments of ``update``).

  Gradients wider than the params promote the state that follows them
  (SGD's momentum, optax Adam's first moment: bfloat16 zeros become
  float32 after one step on one device); counts, keys, Adam's second
  moment (optax keeps it in the params' dtype) and ``mu_dtype``-fixed
  moments stay. Kept from the start, a stored state has one layout (and the
  initial zeros are the same numbers in either dtype)."""
  extra = extra or {}
  for _ in range(3):  # (A fixed point: the dtypes a step keeps.)
    after = jax.eval_shape(
      lambda g, st, p, kw: update(g, st, p, **kw)[1],
      grads,
      state,
      params,
      extra,
    )
    promoted = jax.tree.map(
      lambda x, a: cast_floating(x, getattr(a, "dtype", None)), state, after
    )
    if _dtypes(promoted) == _dtypes(state):
      break
    state = promoted
  return state


def _dtypes(tree) -> list:
  """The dtypes of a tree's leaves."""
  return [getattr(x, "dtype", None) for x in jax.tree.leaves(tree)]
