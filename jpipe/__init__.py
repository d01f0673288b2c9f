"""jpipe: pipeline model-parallel training in JAX.

Subpackages are imported on demand so that ``import jpipe.staleness`` stays
light (jax + optax only); ``jpipe.Pipeline`` loads the runtime when first
used.
"""

__version__ = "0.1.0"


_SUBPACKAGES = (
  "data",
  "models",
  "parallel",
  "partition",
  "runtime",
  "schedule",
  "staleness",
)


def __getattr__(name):
  if name in _SUBPACKAGES:  # jpipe.partition etc. without importing them first
    import importlib

    return importlib.import_module(f"jpipe.{name}")
  if name in (
    "Pipeline",
    "PipelineBuilder",
    "PipelineState",
    "MemoryLimitError",
    "OptimizerError",
    "nnx_loss",
    "frozen_loss",
  ):
    from jpipe import runtime

    return getattr(runtime, name)
  raise AttributeError(f"module 'jpipe' has no attribute {name!r}")
