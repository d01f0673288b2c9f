"""Several pipelines in data parallel (SD-Pipe) and their sync policies.

``DataParallelPipelines`` runs P copies of one partitioned pipeline on
disjoint devices, each at its own pace, and synchronises the replicas of
each stage by a policy: "allreduce" (gradients, every step), "preduce"
(SD-Pipe's partial reduce: groups from arrival order average weights),
"adpsgd" (AD-PSGD's random pairs) or "hetpipe" (HetPipe's parameter
server). The scheduler, pairing and server rules are plain classes here,
usable and testable without devices. Across processes
(``python -m jpipe.launch``) a pipeline may lie in one process or span
several (``placement="stage"``: SD-Pipe's process per stage); process 0
serves the schedulers, the epoch's end and the servers to the others;
averaging is a collective over the group's devices in whichever
processes hold them, or, where pipelines span processes, point-to-point
pulls and a mean on each member's device (``PeerMean``).
"""

from jpipe.parallel._averaging import GroupMean, PeerMean, Rendezvous, Roster
from jpipe.parallel._epoch import EpochEnd, StopCalls
from jpipe.parallel._free_running import EpochReport
from jpipe.parallel._gossip import GossipPairs
from jpipe.parallel._hetero import (
  HETERO_PROBABILITY,
  Heterogeneity,
  parse_slowdown,
)
from jpipe.parallel._param_server import (
  ParameterServer,
  hetpipe_syncs,
  push_pull,
)
from jpipe.parallel._pipelines import PLACEMENTS, DataParallelPipelines
from jpipe.parallel._pipelines_state import mean_trees
from jpipe.parallel._preduce import (
  AdaptiveWait,
  GraphSyncToken,
  Group,
  PartialReduceRounds,
  PartialReduceScheduler,
)
from jpipe.parallel._sync import SYNC_POLICIES, make_policy

__all__ = [
  "HETERO_PROBABILITY",
  "PLACEMENTS",
  "SYNC_POLICIES",
  "AdaptiveWait",
  "DataParallelPipelines",
  "EpochEnd",
  "EpochReport",
  "GossipPairs",
  "GraphSyncToken",
  "Group",
  "GroupMean",
  "Heterogeneity",
  "ParameterServer",
  "PeerMean",
  "PartialReduceRounds",
  "PartialReduceScheduler",
  "Rendezvous",
  "Roster",
  "StopCalls",
  "hetpipe_syncs",
  "make_policy",
  "mean_trees",
  "parse_slowdown",
  "push_pull",
]
