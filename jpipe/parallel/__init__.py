"""Several pipelines in data parallel (SD-Pipe) and their sync policies.

``DataParallelPipelines`` runs P copies of one partitioned pipeline on
disjoint devices, each at its own pace, and synchronises the replicas of
each stage by a policy: "allreduce" (gradients, every step), "preduce"
(SD-Pipe's partial reduce: groups from arrival order average weights),
"adpsgd" (AD-PSGD's random pairs) or "hetpipe" (HetPipe's parameter
server). The scheduler, pairing and server rules are plain classes here,
usable and testable without devices. Across processes (one or more
pipelines per process, ``python -m jpipe.launch``) process 0 serves the
schedulers, the epoch's end and the servers to the others; averaging is a
collective over the group's devices in whichever processes hold them.
"""

from jpipe.parallel._averaging import GroupMean, Rendezvous, Roster
from jpipe.parallel._epoch import EpochEnd
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
from jpipe.parallel._pipelines import DataParallelPipelines, EpochReport
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
  "PartialReduceRounds",
  "PartialReduceScheduler",
  "Rendezvous",
  "Roster",
  "hetpipe_syncs",
  "make_policy",
  "parse_slowdown",
  "push_pull",
]
