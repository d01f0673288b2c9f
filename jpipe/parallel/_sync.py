"""How replicas of a stage across pipelines synchronise: the policies.

A policy object is shared by the P pipelines' threads; each pipeline's
driver reaches it through its ``ReplicaHooks`` (``_hooks.py``), once per
stage step. Ranks are pipeline indices; ``step`` is the stage's step
count in the pipeline (SD-Pipe's batch id).

- ``allreduce``: the step applies the mean gradient of all P replicas'
  (SD-Pipe without ``--preduce``): every pipeline waits for the slowest.
- ``preduce``: SD-Pipe's partial reduce: a local step, then the group the
  stage's scheduler hands out averages its weights.
- ``adpsgd``: AD-PSGD: a local step, then the round's random pair
  averages its weights.
- ``hetpipe``: HetPipe: local steps; every ``hetpipe_every`` batches and at
  the epoch's last, a push to the stage's parameter server and a pull.

Every policy ends an epoch as SD-Pipe does (``EpochEnd``): when the last
stage's replicas have taken ``P * batches_per_epoch`` steps together, each
pipeline stops at its next last-stage step and drains; draining steps do
not synchronise (except ``allreduce``, whose pipelines stop together).
"""

import itertools
import threading

from jpipe.parallel._averaging import GroupMean, Rendezvous, device_of
from jpipe.parallel._epoch import EpochEnd
from jpipe.parallel._gossip import GossipPairs
from jpipe.parallel._param_server import (
  ParameterServer,
  hetpipe_syncs,
  server_device,
)
from jpipe.parallel._preduce import (
  AdaptiveWait,
  GraphSyncToken,
  PartialReduceRounds,
  PartialReduceScheduler,
)

SYNC_POLICIES = ("allreduce", "preduce", "adpsgd", "hetpipe")


class SyncPolicy:
  """The shared part of every policy: the epoch's end and averaging."""

  name = ""
  averages = "params"  # What a group averages: "params" or "grads".

  def __init__(
    self, num_pipelines: int, num_stages: int, batches_per_epoch: int
  ):
    self.p = num_pipelines
    self.s = num_stages
    self.mean = GroupMean()
    self.rendezvous = Rendezvous()
    self._epoch = EpochEnd(num_pipelines, batches_per_epoch)
    self._epoch_lock = threading.Lock()
    self.group_sizes = [[] for _ in range(num_stages)]  # per stage
    self._sizes_lock = threading.Lock()

  def possible_groups(self) -> list[tuple[int, ...]]:
    """The groups of two or more ranks this policy may form."""
    return []

  # -- per step (called by a pipeline's thread) --------------------------

  def gradient(self, rank, stage, step, grads, draining):
    return grads

  def params(self, rank, stage, step, params, draining):
    return params

  def last_stage_step(self, rank: int, step: int) -> None:
    """The last stage's step ``step`` of pipeline ``rank`` (epoch count)."""
    with self._epoch_lock:
      self._epoch.arrive(rank, step)
      self._epoch.add(1)

  # -- per epoch --------------------------------------------------------------

  def stop_of(self, rank: int) -> int | None:
    """The last-stage step at which ``rank``'s epoch ends (None: not yet)."""
    with self._epoch_lock:
      return self._epoch.stops.get(rank)

  def start_draining(self, rank: int) -> None:
    """``rank`` drains: nobody waits for it any more."""
    self.rendezvous.leave(rank)

  def finish(self, rank, stage, params):
    """After ``rank``'s drain: the stage's params it keeps."""
    return params

  def abort(self, rank: int) -> None:
    """``rank`` failed: release everyone waiting for it."""
    self.rendezvous.leave(rank)

  def new_epoch(self) -> None:
    self.rendezvous.rejoin_all()
    with self._epoch_lock:
      self._epoch.new_epoch()

  def _average(self, key, members, rank, tree):
    return self.rendezvous.meet(key, members, rank, tree, self.mean)

  def _record_size(self, stage, size):
    with self._sizes_lock:
      self.group_sizes[stage].append(size)

  def reset_group_sizes(self) -> None:
    with self._sizes_lock:
      self.group_sizes = [[] for _ in range(self.s)]

  def mean_group_size(self) -> list[float]:
    """Per stage, the mean size of the groups that averaged (1 = alone)."""
    with self._sizes_lock:
      return [sum(g) / len(g) if g else float("nan") for g in self.group_sizes]


class AllReduce(SyncPolicy):
  name = "allreduce"
  averages = "grads"

  def possible_groups(self):
    return [tuple(range(self.p))] if self.p > 1 else []

  def gradient(self, rank, stage, step, grads, draining):
    self._record_size(stage, self.p)
    return self._average(("grad", stage, step), range(self.p), rank, grads)

  def start_draining(self, rank):
    pass  # Its pipelines stop at the same step and drain in step.


class PartialReduce(SyncPolicy):
  name = "preduce"

  def __init__(
    self,
    num_pipelines,
    num_stages,
    batches_per_epoch,
    *,
    ssp_bound=10,
    pairwise=None,
  ):
    super().__init__(num_pipelines, num_stages, batches_per_epoch)
    token = GraphSyncToken()
    self.schedulers = [
      PartialReduceScheduler(
        PartialReduceRounds(
          num_pipelines,
          ssp_bound=ssp_bound,
          sync_every=batches_per_epoch if s == num_stages - 1 else None,
          key=num_stages - 1 - s,
          token=token,
          pairwise=pairwise,
        )
      )
      for s in range(num_stages)
    ]
    self.waits = [
      [AdaptiveWait() for _ in range(num_stages)] for _ in range(num_pipelines)
    ]

  def possible_groups(self):
    sizes = [2] if self.schedulers[0].rounds.pairwise else range(2, self.p + 1)
    return [g for k in sizes for g in itertools.combinations(range(self.p), k)]

  def params(self, rank, stage, step, params, draining):
    if draining:
      return params
    wait = self.waits[rank][stage]
    group = self.schedulers[stage].get_group(rank, step, wait.ms)
    wait.update(len(group.members))
    self._record_size(stage, len(group.members))
    if len(group.members) == 1:
      return params
    key = ("preduce", stage, group.round, group.members)
    return self._average(key, group.members, rank, params)

  def last_stage_step(self, rank, step):
    pass  # The last stage's scheduler counts (at its rounds).

  def stop_of(self, rank):
    return self.schedulers[-1].should_stop(rank)

  def start_draining(self, rank):
    for scheduler in self.schedulers:
      scheduler.leave(rank)
    super().start_draining(rank)

  def abort(self, rank):
    self.start_draining(rank)

  def new_epoch(self):
    super().new_epoch()
    for scheduler in self.schedulers:
      scheduler.rejoin_all()


class Gossip(SyncPolicy):
  name = "adpsgd"

  def __init__(self, num_pipelines, num_stages, batches_per_epoch, *, seed=0):
    super().__init__(num_pipelines, num_stages, batches_per_epoch)
    # One shared shuffle stream per stage, drawn in round order.
    self.pairs = [GossipPairs(num_pipelines, seed) for _ in range(num_stages)]
    self._pairs_lock = threading.Lock()

  def possible_groups(self):
    return list(itertools.combinations(range(self.p), 2))

  def params(self, rank, stage, step, params, draining):
    if draining:
      return params
    with self._pairs_lock:
      pair = self.pairs[stage].partner_group(rank, step)
    self._record_size(stage, 2)
    return self._average(("adpsgd", stage, step, pair), pair, rank, params)


class HetPipe(SyncPolicy):
  name = "hetpipe"

  def __init__(self, num_pipelines, num_stages, batches_per_epoch, *, every=10):
    super().__init__(num_pipelines, num_stages, batches_per_epoch)
    if every < 1:
      raise ValueError(f"hetpipe_every must be >= 1 batches, got {every}")
    self.every = every
    self.servers = [None] * num_stages
    self.bases = {}  # (rank, stage) -> its last pull (rank's thread only)

  def start(self, stage_params):
    """Each stage's server from pipeline 0's initial params (every
    pipeline starts from the same)."""
    device = server_device()
    self.servers = [ParameterServer(p, self.p, device) for p in stage_params]
    self.bases = {}

  def _push_pull(self, rank, stage, params):
    device = device_of(params)
    base = self.bases.get((rank, stage), None)
    if base is None:  # First push: from the common start.
      base = self.servers[stage].initial_on(device)
    new = self.servers[stage].push_pull(params, base, device)
    self.bases[(rank, stage)] = new
    self._record_size(stage, 1)
    return new

  def params(self, rank, stage, step, params, draining):
    # ``step`` counts from 0: batch id ``step + 1`` was just applied.
    if draining or not hetpipe_syncs(step + 1, self.every, last=False):
      return params
    return self._push_pull(rank, stage, params)

  def finish(self, rank, stage, params):
    return self._push_pull(rank, stage, params)


def make_policy(name, num_pipelines, num_stages, batches_per_epoch, **options):
  """A policy by name; ``options``: ``ssp_bound``, ``pairwise`` (preduce),
  ``seed`` (adpsgd), ``every`` (hetpipe)."""
  classes = {c.name: c for c in (AllReduce, PartialReduce, Gossip, HetPipe)}
  if name not in classes:
    raise ValueError(f"unknown sync policy {name!r}: one of {SYNC_POLICIES}")
  return classes[name](num_pipelines, num_stages, batches_per_epoch, **options)
