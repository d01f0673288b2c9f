"""Automatic partitioning: trace a model, split it into stages, build them."""

from jpipe.partition._contiguous import ContiguousSolution, solve_contiguous
from jpipe.partition._stages import Stages, StageSpec
from jpipe.partition._trace import TracedModel, trace

__all__ = [
  "ContiguousSolution",
  "StageSpec",
  "Stages",
  "TracedModel",
  "solve_contiguous",
  "trace",
]
