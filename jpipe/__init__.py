"""jpipe: pipeline model-parallel training in JAX.

Subpackages are imported on demand so that ``import jpipe.staleness`` stays
light (jax + optax only).
"""

__version__ = "0.1.0"
