"""Jitted ``jax.grad`` / ``jax.value_and_grad`` for the tests' plain-JAX
references.

Op by op, a Flax model's gradient compiles each primitive on its own: 3-4x
the CPU of one jitted program on the suite's small models (dropout_scan
2.0 s against 0.5 s), and a reference called per microbatch pays it every
time. The arithmetic is the same; jitting changes when it runs, not what
it computes. Cached per function and options (a loop's calls trace once);
bounded, since the cached closures hold their models.
"""

import functools

import jax


@functools.lru_cache(maxsize=32)
def value_and_grad(fn, *args, **options):
  """``jax.jit(jax.value_and_grad(fn, ...))``, cached."""
  return jax.jit(jax.value_and_grad(fn, *args, **options))


@functools.lru_cache(maxsize=32)
def grad(fn, *args, **options):
  """``jax.jit(jax.grad(fn, ...))``, cached."""
  return jax.jit(jax.grad(fn, *args, **options))
