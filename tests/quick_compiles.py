"""The XLA settings every test runs under, in process and in the
processes tests start: quick compiles.

The suite is compile-bound on 2 cores (BUILD.md, "Tests"), and the tests
check what programs compute, not how fast they run. Two settings cut
XLA:CPU's compile time of a small training step 3.3x (0.74 s to 0.22 s;
a seed config's ``:small`` training 38 s to 20 s): most optimisations off
(``NO_OPTIMIZATIONS``, set by ``tests/conftest.py``) and the
older elemental emitters instead of the MLIR fusion emitters (the flag
below); a third, one LLVM module per program instead of several compiled
on threads, cuts another 8-17% of a compile-bound test's CPU seconds.
Both sides of every comparison compile alike; a test about what XLA's
optimisations do turns them back on (``xla_optimizations``).

Not every test is compile-bound: tens of steps of convolutions run
slower unoptimised than optimising them costs (pipedream_vgg16's
``:small`` 30 steps on a 2-1-1 plan: 48.7 CPU-seconds quick, 35.2 with
the optimisations; a T5 seed's 20 steps: 45.2 quick, 63.3 with them).
Such a test is marked ``compute_bound`` (``tests/conftest.py``): the
optimisations on in process and in the processes it starts, the
flags as for every test.
"""

import os

# Flags of jaxlib 0.10-0.11 (pyproject's range): XLA refuses unknown
# flags, so re-check them when the range moves.
ELEMENTAL_EMITTERS = "--xla_cpu_use_fusion_emitters=false"
# One LLVM module a program, not several compiled on threads: the suite
# keeps every core busy already, and the split costs CPU (2026-12-01,
# paired, cold cache: the t5 config's 2-step training 29.6 / 28.1 ->
# 24.8 / 22.8 CPU-seconds, the GNMT seed's :small 40.4 / 41.9 -> 36.6 /
# 38.7).
ONE_CODEGEN_MODULE = "--xla_cpu_parallel_codegen_split_count=1"
QUICK_COMPILE_FLAGS = (ELEMENTAL_EMITTERS, ONE_CODEGEN_MODULE)
DEVICE_COUNT_FLAG = "--xla_force_host_platform_device_count"
# jax's ``jax_disable_most_optimizations``, from the environment.
NO_OPTIMIZATIONS = "JAX_DISABLE_MOST_OPTIMIZATIONS"


def with_quick_compiles(flags: str) -> str:
  """``XLA_FLAGS`` ``flags`` with the quick-compile flags added (a flag
  ``flags`` already sets keeps its value)."""
  kept = flags.split()
  named = {f.split("=")[0] for f in kept}
  return " ".join(
    kept + [f for f in QUICK_COMPILE_FLAGS if f.split("=")[0] not in named]
  )


def without_device_count(flags: str) -> str:
  """``XLA_FLAGS`` ``flags`` without a fake CPU device count (for a
  process that sets its own, as ``jpipe.launch``'s do)."""
  return " ".join(f for f in flags.split() if DEVICE_COUNT_FLAG not in f)


def elemental_emitters() -> bool:
  """Whether this process compiles with XLA:CPU's elemental emitters."""
  return ELEMENTAL_EMITTERS in os.environ.get("XLA_FLAGS", "").split()


def production_compiles(env: dict) -> dict:
  """Environment ``env`` for a process that compiles as a user's would
  (XLA's defaults): for a check of bits that XLA's optimisations decide."""
  flags = env.get("XLA_FLAGS", "").split()
  return dict(
    env,
    XLA_FLAGS=" ".join(f for f in flags if f not in QUICK_COMPILE_FLAGS),
    **{NO_OPTIMIZATIONS: "0"},
  )
