"""P pipelines in data parallel: SD-Pipe's pipelined data parallelism.

``DataParallelPipelines`` builds P copies of one partitioned pipeline on
disjoint devices (pipeline p on ``devices[p*D:(p+1)*D]``, D = devices per
pipeline), each its own ``jpipe.Pipeline`` with its own stream, and joins
their stages' replicas by a sync policy (``_sync.py``). Each pipeline runs
in its own host thread, so one pipeline's delays or waits never stall
another's dispatch; the policy decides who waits for whom.

In one process a pipeline's stages share its thread: a delay injected
before one of its stages' work holds back the dispatch of its other
stages too (in SD-Pipe each stage is its own process). In 1F1B's steady
state a stage's delay stalls its pipeline anyway, so pipelines still
progress at the pace of their own devices.

Across processes (``jpipe.distributed.initialize`` first, e.g. under
``python -m jpipe.launch``) every process builds the same object over the
global ``jax.devices()``: every pipeline, as every process builds a
multi-process ``jpipe.Pipeline``, and runs (feeds, in a thread each) the
pipelines of which it holds a stage (``ranks``). A pipeline may lie in
one process or span several, down to SD-Pipe's one process per stage:
each of its processes runs its own stages, and they make the same
``step`` calls (an epoch's end is fixed in calls, ``StopCalls``). The
free-running epochs themselves: ``_free_running.py``.
Process 0 serves the shared objects (``_hub.py``); the averaging
collectives run over the group's devices in whichever processes hold
them. Every process calls every method, in the same order; lists of
states are this process's pipelines' (``ranks``).
"""

import threading
from collections.abc import Sequence
from typing import Any

import jax

from jpipe.parallel._free_running import FreeRunningEpochs
from jpipe.parallel._hetero import Heterogeneity
from jpipe.parallel._hooks import ReplicaHooks
from jpipe.parallel._hub import make_hub
from jpipe.parallel._pipelines_state import ConsensusStateMethods, leaf_aval
from jpipe.parallel._sync import SYNC_POLICIES, make_policy, policy_options
from jpipe.runtime import (
  Pipeline,
  PipelineBuilder,
  PipelineState,
  PullLinks,
  outside_user_mesh,
)


@outside_user_mesh  # (A caller's jax.set_mesh.)
class DataParallelPipelines(FreeRunningEpochs, ConsensusStateMethods):
  """P pipelines of S stages, their stages' replicas synchronised.

  Args:
    build: builds each pipeline (``jpipe.PipelineBuilder``: the model, an
      example batch of one pipeline's and ``jpipe.Pipeline``'s options
      but ``devices``). Pipeline 0 is partitioned; the others are built
      for its plan.
    pipelines: P.
    sync: "allreduce", "preduce", "adpsgd" or "hetpipe" (see
      ``jpipe.parallel``).
    devices: all pipelines' devices (default ``jax.devices()``); each
      pipeline gets ``len(devices) // pipelines`` of them (``placement``).
    placement: "pipeline": pipeline p on consecutive devices (one process
      per pipeline, or several, under the launcher); "stage": the s-th
      block of ``pipelines`` devices holds every pipeline's s-th device,
      so each process of ``pipelines`` devices runs one stage of every
      pipeline (SD-Pipe's placement: a process per stage).
    batches_per_epoch: the last stage's optimizer steps per pipeline in
      an epoch, on average: the epoch ends when the last stages' replicas
      have taken P times this many steps (``run_epoch``). A synchronous
      schedule steps once per batch, a stream ``ceil(num_microbatches /
      step_every)`` times (``2bw``: ``num_microbatches // step_every``):
      an epoch of B batches per pipeline is B times that (the training
      CLI scales it so).
    hetero: simulated delays (``Heterogeneity``; None: none).
    ssp_bound: preduce: rounds between graph-sync rounds.
    pairwise: preduce: hand out pairs (default: beyond 8 pipelines).
    gossip_seed: adpsgd: the shared shuffle seed.
    hetpipe_every: hetpipe: batches between pushes.
  """

  def __init__(
    self,
    build: PipelineBuilder,
    *,
    pipelines: int,
    sync: str = "allreduce",
    devices: Sequence[Any] | None = None,
    placement: str = "pipeline",
    batches_per_epoch: int = 100,
    hetero: Heterogeneity | None = None,
    ssp_bound: int = 10,
    pairwise: bool | None = None,
    gossip_seed: int = 0,
    hetpipe_every: int = 10,
  ):
    devices = list(jax.devices() if devices is None else devices)
    per = _devices_per_pipeline(sync, pipelines, devices, build.options)
    devices = _placed(devices, pipelines, per, placement)
    self.num_pipelines, self.devices_per_pipeline = pipelines, per
    self.sync, self.batches_per_epoch = sync, batches_per_epoch
    self.hub = make_hub()
    self.hetero = hetero or Heterogeneity()
    hooks = [ReplicaHooks(p, self.hetero) for p in range(pipelines)]
    groups = [devices[p * per : (p + 1) * per] for p in range(pipelines)]
    # Every pipeline, in every process (module docstring).
    self.all_pipelines = _replica_pipelines(build, groups, hooks)
    self.plan = self.all_pipelines[0].plan
    self.num_stages = self.all_pipelines[0].stages.num_stages
    stage_devices = self._find_own_stages(groups, devices)
    self.hooks = [hooks[p] for p in self.ranks]
    self._params_template = jax.tree.map(leaf_aval, build.params)
    self._idle: dict[int, PipelineState] = {}  # pipelines run elsewhere
    self._consensus_calls = 0
    knobs = dict(
      ssp_bound=ssp_bound, pairwise=pairwise, gossip_seed=gossip_seed
    )
    self._start_sync(stage_devices, hooks, hetpipe_every=hetpipe_every, **knobs)

  def _start_sync(self, stage_devices, hooks, **arguments) -> None:
    """The sync policy (``sync`` with the arguments it takes), told where
    every stage runs and bound to each pipeline's hooks."""
    self.policy = make_policy(
      self.sync,
      self.num_pipelines,
      self.num_stages,
      self.batches_per_epoch,
      hub=self.hub,
      **policy_options(self.sync, **arguments),
    )
    self.policy.place(stage_devices)
    self._exchange_across_processes(stage_devices)
    per = self.devices_per_pipeline
    for p, h in enumerate(hooks):
      h.bind(self.policy, [p * per + ds[0] for ds in self.plan.stage_devices])

  def _find_own_stages(self, groups, devices) -> dict:
    """Per pipeline, the stages this process runs (``stages_here``), the
    process of its last stage (``reporter``: it reports its figures), and
    the pipelines this process feeds (``ranks``, ``pipelines``); returns
    ``{pipeline: each stage's device}``, pipeline p on ``groups[p]``."""
    stage_devices = {
      p: tuple(group[ds[0]] for ds in self.plan.stage_devices)
      for p, group in enumerate(groups)
    }
    # (Device ids per pipeline: what a run prints; "stage" placement
    # interleaves them.)
    self.stage_device_ids = {
      p: tuple(d.id for d in ds) for p, ds in stage_devices.items()
    }
    me = jax.process_index()
    self.stages_here = {
      p: tuple(s for s, d in enumerate(ds) if d.process_index == me)
      for p, ds in stage_devices.items()
    }
    self.reporter = [ds[-1].process_index for ds in stage_devices.values()]
    self.ranks = tuple(
      p for p in range(self.num_pipelines) if self.stages_here[p]
    )
    if not self.ranks:
      raise ValueError(
        f"process {me} runs no stage of the {self.num_pipelines} pipelines "
        f"(devices {[d.id for d in devices]}): give every process some of "
        "the devices, or start fewer processes"
      )
    self.pipelines = [self.all_pipelines[p] for p in self.ranks]
    return stage_devices

  def _exchange_across_processes(self, stage_devices) -> None:
    """Where a pipeline spans processes: the replicas exchange by pulls,
    and every transfer waits for its arrival on the host."""
    if all(
      len({d.process_index for d in ds}) == 1 for ds in stage_devices.values()
    ):
      return
    # Nothing dispatched may wait for another process: a collective
    # across processes would wait for a peer whose compute it holds up
    # (``PeerMean``), a program reading a transfer for a pipeline whose
    # compute it holds up (``Transport.wait_for_arrivals``).
    if self.all_pipelines[0].transport.kind != "pull":
      self.hub.close()
      raise ValueError(
        "pipelines spanning processes need the 'pull' transport: a "
        "'collective' transfer waits inside a program for the other "
        "process, which stalls that process's other pipelines; leave "
        "transport at its default"
      )
    self.policy.exchange_by_pulls(PullLinks())
    for pipe in self.all_pipelines:
      pipe.transport.wait_for_arrivals()

  def close(self) -> None:
    """Stops serving the shared objects (process 0 across processes)."""
    self.hub.close()

  def compile_groups(self, states) -> int:
    """Compiles, ahead of training, the averaging program of every group
    the policy may form (else each compiles when it first forms, inside
    the timed run). Returns how many were compiled."""
    del states  # (The shapes are the plan's.)
    if self.policy.peers is not None:
      return 0  # Averaged by pulls (``PeerMean``): no collective.
    first = self.all_pipelines[0]
    count = 0
    for s, avals in enumerate(first.stage_param_avals()):
      params = [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in avals]
      tree = params
      if self.policy.averages == "grads" and s not in first.tied.stages:
        tree = first.gradient_avals(s, params)
      for group in self.policy.possible_groups():
        if self.policy.local[s].isdisjoint(group):
          continue  # Other processes' replicas only.
        devices = [self.policy.devices[r][s] for r in group]
        self.policy.mean.compile(devices, tree)
        count += 1
    return count

  def reset_statistics(self) -> None:
    """Forgets the group sizes and injected delays so far (e.g. those of
    a warm-up call)."""
    self.policy.reset_group_sizes()
    for hooks in self.hooks:
      hooks.delayed_seconds = 0.0

  # -- lockstep calls --------------------------------------------------------

  def step(self, states, batches):
    """Each of this process's pipelines' ``step`` on its batch
    (``batches``: one per pipeline in ``ranks``), concurrently (one
    thread each); returns (states, per-pipeline metrics)."""
    return self._each(lambda i: self.pipelines[i].step(states[i], batches[i]))

  def flush(self, states):
    """Drains every pipeline (asynchronous schedules)."""
    return self._each(lambda i: self.pipelines[i].flush(states[i]))

  def _each(self, fn):
    """``fn(i)`` for each local pipeline i, one thread each."""
    return _in_threads(fn, self.ranks, self.policy.abort)


def _in_threads(fn, ranks, abort):
  """``fn(i)`` for each i of ``ranks`` (pipeline ``ranks[i]``), one
  thread each; returns the first and second items of each result. A
  pipeline's error aborts it (``abort(rank)``: the others stop waiting
  for it) and is re-raised here, in the caller."""
  results = [None] * len(ranks)
  errors = []

  def work(i):
    try:
      results[i] = fn(i)
    except BaseException as e:  # Re-raised below, in the caller.
      errors.append(e)
      abort(ranks[i])

  threads = [
    threading.Thread(target=work, args=(i,), name=f"pipeline-{p}")
    for i, p in enumerate(ranks)
  ]
  for t in threads:
    t.start()
  for t in threads:
    t.join()
  if errors:
    raise errors[0]
  return [r[0] for r in results], [r[1] for r in results]


def _devices_per_pipeline(sync, pipelines, devices, options) -> int:
  """Devices each pipeline gets; bad counts refused, naming the fix."""
  if sync not in SYNC_POLICIES:
    raise ValueError(f"unknown sync {sync!r}: one of {SYNC_POLICIES}")
  if not isinstance(pipelines, int) or pipelines < 1:
    raise ValueError(f"pipelines must be an int >= 1, got {pipelines!r}")
  per = len(devices) // pipelines
  if per < 1:
    raise ValueError(
      f"{pipelines} pipelines need at least {pipelines} devices, got "
      f"{len(devices)}: use fewer pipelines (or more devices, e.g. "
      "XLA_FLAGS=--xla_force_host_platform_device_count=8 on CPU)"
    )
  if options.get("devices") is not None:
    raise ValueError(
      "the builder has devices: pass them to DataParallelPipelines, which "
      "places each pipeline on its own"
    )
  return per


PLACEMENTS = ("pipeline", "stage")


def _placed(devices, pipelines, per, placement) -> list:
  """``devices`` ordered so that pipeline p takes ``[p*per:(p+1)*per]``:
  as given ("pipeline"), or the s-th of every pipeline from the s-th
  block of ``pipelines`` devices ("stage")."""
  if placement not in PLACEMENTS:
    raise ValueError(f"unknown placement {placement!r}: one of {PLACEMENTS}")
  if placement == "pipeline":
    return devices
  return [
    devices[s * pipelines + p] for p in range(pipelines) for s in range(per)
  ]


def _replica_pipelines(build, devices, hooks) -> list[Pipeline]:
  """Every pipeline, on ``devices[i]`` with ``hooks[i]``: the first
  partitions the model, the others run its plan."""
  first = build(devices=devices[0], hooks=hooks[0])
  if any(len(ds) > 1 for ds in first.plan.stage_devices):
    raise ValueError(
      "a stage replicated inside a pipeline (a pipedream_hybrid plan) "
      "cannot also be replicated across pipelines: partition with "
      "'contiguous' or 'pipedream' and let the pipelines be the replicas"
    )
  return [first] + [
    build(first.plan, devices=ds, hooks=h)
    for ds, h in zip(devices[1:], hooks[1:], strict=True)
  ]
