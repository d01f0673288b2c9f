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

The objects every pipeline shares (schedulers, the epoch's end, the
meetings' roster, HetPipe's servers) come from a hub (``_hub.py``): plain
objects in one process, process 0's across processes; averaging is a
collective over the group's devices wherever they are.

Every policy ends an epoch as SD-Pipe does (``EpochEnd``): when the last
stage's replicas have taken ``P * batches_per_epoch`` steps together, each
pipeline stops at its next last-stage step and drains; draining steps do
not synchronise (except ``allreduce``, whose pipelines stop together). A
stop request (``cut_epoch``) ends it early: every pipeline stops after
its calls under way.
"""

import itertools
import threading

import jax
import numpy as np

from jpipe.parallel._averaging import (
  GroupMean,
  PeerMean,
  Rendezvous,
  Roster,
  device_of,
)
from jpipe.parallel._epoch import SharedEpochEnd, StopCalls
from jpipe.parallel._gossip import GossipPairs
from jpipe.parallel._hub import LocalHub
from jpipe.parallel._param_server import ParameterServer, hetpipe_syncs
from jpipe.parallel._preduce import (
  PAIRWISE_ABOVE,
  AdaptiveWait,
  GraphSyncToken,
  PartialReduceRounds,
  PartialReduceScheduler,
)

SYNC_POLICIES = ("allreduce", "preduce", "adpsgd", "hetpipe")


class SyncPolicy:
  """The shared part of every policy: the epoch's end and averaging.

  Args:
    num_pipelines, num_stages: P and S.
    batches_per_epoch: batches per pipeline in an epoch, on average.
    hub: where shared objects live (default: this process).
  """

  name = ""
  averages = "params"  # What a group averages: "params" or "grads".
  stops_together = False  # Every pipeline stops an epoch at one call.
  # DataParallelPipelines' argument -> this class's keyword argument.
  pipelines_options: dict[str, str] = {}

  def __init__(
    self,
    num_pipelines: int,
    num_stages: int,
    batches_per_epoch: int,
    *,
    hub=None,
  ):
    self.p = num_pipelines
    self.s = num_stages
    self.hub = LocalHub() if hub is None else hub
    self.mean = GroupMean()
    self.peers: PeerMean | None = None  # (``exchange_by_pulls``)
    self._epochs = 0  # Epochs begun (every process counts alike).
    self.rendezvous = Rendezvous(self.hub.share("roster", Roster))
    self._epoch = self.hub.share(
      "epoch", lambda: SharedEpochEnd(num_pipelines, batches_per_epoch)
    )
    self._stops = self.hub.share(
      "stop calls", lambda: StopCalls(num_pipelines, self.stops_together)
    )
    # rank -> per stage, its device (``place``); per stage, the ranks
    # whose replica of it this process runs.
    self.devices: dict[int, tuple] = {}
    self.local: list[frozenset] = [frozenset(range(num_pipelines))] * num_stages
    self.group_sizes = [[] for _ in range(num_stages)]  # this process's
    self._sizes_lock = threading.Lock()

  def place(self, devices: dict[int, tuple]) -> None:
    """Every pipeline's stage devices, ``{rank: (device per stage)}``."""
    self.devices = dict(devices)
    me = jax.process_index()
    self.local = [
      frozenset(
        r for r, ds in self.devices.items() if ds[s].process_index == me
      )
      for s in range(self.s)
    ]

  def exchange_by_pulls(self, links) -> None:
    """Averages every group by point-to-point pulls and a program per
    member (``PeerMean`` over ``links``, a ``jpipe.runtime.PullLinks``)
    instead of a collective, which across processes runs through gloo
    even for the devices of one process: for pipelines that span
    processes."""
    self.peers = PeerMean(links)

  def start(self, stage_params) -> None:
    """Before the first step, with the initial params per stage (every
    pipeline starts from them; host or device arrays): what the policy
    serves (nothing here)."""

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
    self._epoch.step(rank, step)

  # -- per epoch --------------------------------------------------------------

  def stop_of(self, rank: int) -> int | None:
    """The last-stage step at which ``rank``'s epoch ends (None: not yet)."""
    return self._epoch.stop_of(rank)

  def may_run(self, rank: int, call: int) -> bool:
    """Whether pipeline ``rank`` makes its call ``call`` of the epoch
    (asked before each by every process that runs a part of it)."""
    return self._stops.grant(rank, call)

  def stop_feeding(self, rank: int) -> None:
    """The process of ``rank``'s last stage saw its stop: fixes the calls
    each of its processes makes (``StopCalls``)."""
    self._stops.stop(rank)

  def cut_epoch(self) -> None:
    """Ends the epoch under way early, for every pipeline (a stop
    request; any process may ask): each stops after its calls under way
    and drains (``StopCalls.cut``)."""
    self._stops.cut()

  def start_draining(self, rank: int, stages) -> None:
    """``rank`` drains ``stages`` (this process's): nobody waits for
    them any more."""
    self.rendezvous.leave(rank, stages)

  def finish(self, rank, stage, params):
    """After ``rank``'s drain: the stage's params it keeps."""
    return params

  def abort(self, rank: int) -> None:
    """``rank`` failed: release everyone waiting for it."""
    self.rendezvous.leave(rank, range(self.s))

  def new_epoch(self, batches: int | None = None) -> None:
    """Resets the shared objects (by their owner: across processes,
    process 0, while the others wait at a barrier); ``batches``: the
    epoch's batches per pipeline on average, where not
    ``batches_per_epoch`` (the rest of an epoch cut short)."""
    self._epochs += 1
    if self.hub.owner:
      self.rendezvous.rejoin_all()
      self._epoch.new_epoch(batches)
      self._stops.new_epoch()

  def _average(self, key, stage, members, rank, tree):
    def combine(trees, came):
      devices = {r: self.devices[r][stage] for r in came}
      here = [r for r in came if r in self.local[stage]]
      if self.peers is not None:
        return self.peers((self._epochs, key), trees, here, came, devices)
      return self.mean(trees, [devices[r] for r in came])

    return self.rendezvous.meet(
      key, stage, members, rank, tree, combine, self.local[stage]
    )

  def _record_size(self, stage, size):
    with self._sizes_lock:
      self.group_sizes[stage].append(size)

  def reset_group_sizes(self) -> None:
    with self._sizes_lock:
      self.group_sizes = [[] for _ in range(self.s)]

  def group_size_sums(self) -> list[tuple[int, int]]:
    """Per stage, (sum of sizes, number of groups) of this process's
    members' groups."""
    with self._sizes_lock:
      return [(sum(g), len(g)) for g in self.group_sizes]

  def mean_group_size(self) -> list[float]:
    """Per stage, the mean size of the groups that averaged (1 = alone),
    over this process's pipelines."""
    return [t / n if n else float("nan") for t, n in self.group_size_sums()]


class AllReduce(SyncPolicy):
  name = "allreduce"
  averages = "grads"
  stops_together = True

  def possible_groups(self):
    return [tuple(range(self.p))] if self.p > 1 else []

  def gradient(self, rank, stage, step, grads, draining):
    self._record_size(stage, self.p)
    key = ("grad", stage, step)
    return self._average(key, stage, range(self.p), rank, grads)

  def start_draining(self, rank, stages):
    pass  # Its pipelines stop at the same step and drain in step.


class PartialReduce(SyncPolicy):
  name = "preduce"
  pipelines_options = {"ssp_bound": "ssp_bound", "pairwise": "pairwise"}

  def __init__(
    self,
    num_pipelines,
    num_stages,
    batches_per_epoch,
    *,
    ssp_bound=10,
    pairwise=None,
    **shared,
  ):
    super().__init__(num_pipelines, num_stages, batches_per_epoch, **shared)
    self.pairwise = (
      num_pipelines > PAIRWISE_ABOVE if pairwise is None else pairwise
    )
    token = GraphSyncToken()  # Used where the schedulers are built.

    def scheduler(s):
      return PartialReduceScheduler(
        PartialReduceRounds(
          num_pipelines,
          ssp_bound=ssp_bound,
          sync_every=batches_per_epoch if s == num_stages - 1 else None,
          key=num_stages - 1 - s,
          token=token,
          pairwise=self.pairwise,
        )
      )

    self.schedulers = [
      self.hub.share(f"scheduler/{s}", lambda s=s: scheduler(s))
      for s in range(num_stages)
    ]
    self.waits = {
      r: [AdaptiveWait() for _ in range(num_stages)]
      for r in range(num_pipelines)
    }

  def possible_groups(self):
    sizes = [2] if self.pairwise else range(2, self.p + 1)
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
    return self._average(key, stage, group.members, rank, params)

  def last_stage_step(self, rank, step):
    pass  # The last stage's scheduler counts (at its rounds).

  def stop_of(self, rank):
    return self.schedulers[-1].should_stop(rank)

  def start_draining(self, rank, stages):
    for s in stages:
      self.schedulers[s].leave(rank)
    super().start_draining(rank, stages)

  def abort(self, rank):
    self.start_draining(rank, range(self.s))

  def new_epoch(self, batches=None):
    super().new_epoch(batches)
    if self.hub.owner:
      for scheduler in self.schedulers:
        scheduler.rejoin_all(batches)


class Gossip(SyncPolicy):
  """AD-PSGD's pairs. Rounds count each pipeline's steps of a stage from
  the epoch's start: pipelines stop an epoch at different batches, so a
  count across epochs would pair a pipeline with a partner that already
  passed that round (and wait for it forever). Every epoch draws its own
  shuffles from the shared seed."""

  pipelines_options = {"gossip_seed": "seed"}

  name = "adpsgd"

  def __init__(
    self, num_pipelines, num_stages, batches_per_epoch, *, seed=0, **shared
  ):
    super().__init__(num_pipelines, num_stages, batches_per_epoch, **shared)
    self.seed = seed
    self.epoch = 0
    self._new_pairs()
    self._pairs_lock = threading.Lock()

  def _new_pairs(self):
    # One shared shuffle stream per stage and epoch, drawn in round order.
    self.pairs = [
      GossipPairs(self.p, [self.seed, self.epoch, s]) for s in range(self.s)
    ]
    self._first_step = {}  # (rank, stage) -> its first step this epoch

  def possible_groups(self):
    return list(itertools.combinations(range(self.p), 2))

  def params(self, rank, stage, step, params, draining):
    if draining:
      return params
    with self._pairs_lock:
      first = self._first_step.setdefault((rank, stage), step)
      pair = self.pairs[stage].partner_group(rank, step - first)
    self._record_size(stage, 2)
    key = ("adpsgd", self.epoch, stage, step - first, pair)
    return self._average(key, stage, pair, rank, params)

  def new_epoch(self, batches=None):
    super().new_epoch(batches)
    with self._pairs_lock:
      self.epoch += 1
      self._new_pairs()


class HetPipe(SyncPolicy):
  name = "hetpipe"
  pipelines_options = {"hetpipe_every": "every"}

  def __init__(
    self, num_pipelines, num_stages, batches_per_epoch, *, every=10, **shared
  ):
    super().__init__(num_pipelines, num_stages, batches_per_epoch, **shared)
    if every < 1:
      raise ValueError(f"hetpipe_every must be >= 1 batches, got {every}")
    self.every = every
    self.servers = [None] * num_stages
    self.bases = {}  # (rank, stage) -> its last pull (rank's thread only)

  def start(self, stage_params):
    """Each stage's server from the initial params (every pipeline
    starts from them); across processes, process 0's serve every
    pipeline."""
    self.servers = [
      self.hub.share(f"server/{s}", lambda p=p: ParameterServer(p, self.p))
      for s, p in enumerate(stage_params)
    ]
    self.bases = {}

  def _push_pull(self, rank, stage, params):
    device = device_of(params)
    server = self.servers[stage]
    base = self.bases.get((rank, stage), None)
    if base is None:  # First push: from the common start.
      base = server.initial_host()
    # Host arrays travel (the server computes in host memory; across
    # processes process 0's serves, through the hub).
    leaves, treedef = jax.tree.flatten(params)
    pulled = server.push_pull_host(
      [np.asarray(x) for x in leaves],
      [np.asarray(x) for x in jax.tree.leaves(base)],
    )
    new = jax.tree.unflatten(
      treedef, [jax.device_put(x, device) for x in pulled]
    )
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


def _policy_class(name):
  classes = {c.name: c for c in (AllReduce, PartialReduce, Gossip, HetPipe)}
  if name not in classes:
    raise ValueError(f"unknown sync policy {name!r}: one of {SYNC_POLICIES}")
  return classes[name]


def make_policy(name, num_pipelines, num_stages, batches_per_epoch, **options):
  """A policy by name; ``options``: ``ssp_bound``, ``pairwise`` (preduce),
  ``seed`` (adpsgd), ``every`` (hetpipe); ``hub`` (any, see
  ``SyncPolicy``)."""
  return _policy_class(name)(
    num_pipelines, num_stages, batches_per_epoch, **options
  )


def policy_options(name, **arguments) -> dict:
  """The keyword arguments policy ``name`` takes, from
  ``DataParallelPipelines``' arguments (each class names its own)."""
  wanted = _policy_class(name).pipelines_options
  return {kw: arguments[arg] for arg, kw in wanted.items()}
