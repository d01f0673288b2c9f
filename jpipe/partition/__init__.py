"""Automatic partitioning: trace a model, split it into stages, build them."""

from jpipe.partition._acyclic import AcyclicSolution, solve_acyclic
from jpipe.partition._caller_axes import (
  caller_axes,
  calling_from,
  keep_type,
  remember_type,
)
from jpipe.partition._contiguous import ContiguousSolution, solve_contiguous
from jpipe.partition._cost_model import (
  GraphCosts,
  MemoryBudget,
  MemoryLimitError,
  MemoryModel,
  StageBytes,
  TooFewNodes,
)
from jpipe.partition._follow import follow_plan
from jpipe.partition._granularity import (
  Granularity,
  choose_depth,
  min_max_split,
)
from jpipe.partition._graph_txt import (
  PIPEDREAM_PROFILES,
  ProfileGraph,
  load_pipedream_profile,
  profile_path,
)
from jpipe.partition._mixed import MixedSolution, solve_mixed
from jpipe.partition._pipedream import solve_pipedream
from jpipe.partition._pipedream_memory import pipedream_stage_memory
from jpipe.partition._plain_types import plain_array, typed_on_mesh
from jpipe.partition._plan import (
  METHODS,
  Plan,
  plan_from_boundaries,
  plan_from_pipedream,
  plan_traced,
  stage_memory_bytes,
  steady_state_delay,
  traced_profile_graph,
)
from jpipe.partition._profile import NodeCosts, profile_nodes
from jpipe.partition._report import plot_plan, print_plan_table
from jpipe.partition._scan_layers import (
  ParamLayout,
  axis_moved_first,
  merge_leading,
  move_axis,
  split_leading,
)
from jpipe.partition._split import Split, SplitMismatch
from jpipe.partition._stages import (
  Stages,
  StageSpec,
  default_residual_own_bytes,
)
from jpipe.partition._trace import (
  LossOutputError,
  TracedModel,
  trace,
  with_model_state,
)

__all__ = [
  "ParamLayout",
  "move_axis",
  "merge_leading",
  "split_leading",
  "axis_moved_first",
  "METHODS",
  "AcyclicSolution",
  "PIPEDREAM_PROFILES",
  "ContiguousSolution",
  "Granularity",
  "LossOutputError",
  "GraphCosts",
  "MemoryBudget",
  "MemoryLimitError",
  "MemoryModel",
  "MixedSolution",
  "NodeCosts",
  "Plan",
  "ProfileGraph",
  "Split",
  "SplitMismatch",
  "StageSpec",
  "Stages",
  "default_residual_own_bytes",
  "caller_axes",
  "calling_from",
  "keep_type",
  "remember_type",
  "plain_array",
  "typed_on_mesh",
  "TracedModel",
  "choose_depth",
  "follow_plan",
  "load_pipedream_profile",
  "min_max_split",
  "plan_from_boundaries",
  "plan_from_pipedream",
  "plan_traced",
  "pipedream_stage_memory",
  "traced_profile_graph",
  "StageBytes",
  "TooFewNodes",
  "stage_memory_bytes",
  "plot_plan",
  "print_plan_table",
  "profile_nodes",
  "profile_path",
  "solve_acyclic",
  "solve_contiguous",
  "solve_mixed",
  "solve_pipedream",
  "steady_state_delay",
  "trace",
  "with_model_state",
]
