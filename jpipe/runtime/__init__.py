"""The pipeline runtime: stages on devices, driven by a schedule."""

from jpipe.partition import MemoryLimitError
from jpipe.runtime._builder import PipelineBuilder
from jpipe.runtime._frozen_loss import FrozenLoss, frozen_loss
from jpipe.runtime._gather import trees_everywhere
from jpipe.runtime._nnx_loss import NnxLoss, array_variables, nnx_loss
from jpipe.runtime._pipeline import Pipeline
from jpipe.runtime._pipeline_state import PipelineState
from jpipe.runtime._slowdown import (
  RANDOM_DELAY_PROBABILITY,
  DeviceSlowdowns,
  Slowdown,
  parse_slowdowns,
)
from jpipe.runtime._stacked import HeldRows
from jpipe.runtime.build.auto_schedule import auto_plan, rank_for_plan
from jpipe.runtime.build.grad_dtype import check_grad_accum_dtype
from jpipe.runtime.build.key_arrays import is_key
from jpipe.runtime.build.loss_scale import DynamicLossScale, LossScaleState
from jpipe.runtime.build.memory import (
  StageMemory,
  format_bytes,
  partitioner_memory_model,
)
from jpipe.runtime.build.optimizer_locality import OptimizerError
from jpipe.runtime.build.options import (
  GAP_AWARE_POLICIES,
  Staleness,
  check_staleness_options,
)
from jpipe.runtime.build.partitioning import (
  REPLICA_ROUTINGS,
  Partitioning,
  partition_of,
  with_partition,
)
from jpipe.runtime.build.placement import even_rows, rows_for_speeds
from jpipe.runtime.build.transport import PullLinks, TransferTimes
from jpipe.runtime.build.user_mesh import outside_user_mesh
from jpipe.runtime.execute.hooks import DriverHooks
from jpipe.runtime.optax_layout import opt_state_from_optax, opt_state_to_optax

__all__ = [
  "RANDOM_DELAY_PROBABILITY",
  "REPLICA_ROUTINGS",
  "DeviceSlowdowns",
  "DriverHooks",
  "DynamicLossScale",
  "LossScaleState",
  "GAP_AWARE_POLICIES",
  "HeldRows",
  "opt_state_from_optax",
  "opt_state_to_optax",
  "MemoryLimitError",
  "FrozenLoss",
  "NnxLoss",
  "OptimizerError",
  "Partitioning",
  "Pipeline",
  "PipelineBuilder",
  "PipelineState",
  "PullLinks",
  "TransferTimes",
  "Slowdown",
  "StageMemory",
  "Staleness",
  "auto_plan",
  "rank_for_plan",
  "check_grad_accum_dtype",
  "check_staleness_options",
  "even_rows",
  "format_bytes",
  "array_variables",
  "is_key",
  "frozen_loss",
  "nnx_loss",
  "outside_user_mesh",
  "partitioner_memory_model",
  "parse_slowdowns",
  "partition_of",
  "rows_for_speeds",
  "trees_everywhere",
  "with_partition",
]
