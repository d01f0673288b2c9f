"""The pipeline runtime: stages on devices, driven by a schedule."""

from jpipe.runtime._driver import DriverHooks
from jpipe.runtime._memory import MemoryLimitError, StageMemory, format_bytes
from jpipe.runtime._options import (
  GAP_AWARE_POLICIES,
  Staleness,
  check_staleness_options,
)
from jpipe.runtime._pipeline import Pipeline, PipelineState

__all__ = [
  "DriverHooks",
  "GAP_AWARE_POLICIES",
  "MemoryLimitError",
  "Pipeline",
  "PipelineState",
  "StageMemory",
  "Staleness",
  "check_staleness_options",
  "format_bytes",
]
