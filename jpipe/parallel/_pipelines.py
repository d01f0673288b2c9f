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
``step`` calls (an epoch's end is fixed in calls, ``StopCalls``).
Process 0 serves the shared objects (``_hub.py``); the averaging
collectives run over the group's devices in whichever processes hold
them. Every process calls every method, in the same order; lists of
states are this process's pipelines' (``ranks``).
"""

import dataclasses
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np

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


@dataclasses.dataclass
class EpochReport:
  """What an epoch of free-running pipelines did (every pipeline's, also
  across processes).

  Attributes:
    batches: per pipeline, the batches (``step`` calls) it ran.
    steps: per pipeline, its last stage's optimizer steps so far.
    losses: per pipeline, each call's mean loss.
    aux: per pipeline, the mean over its calls of each aux output of the
      loss (``has_aux``), flat in ``jax.tree.leaves`` order (lists for
      arrays); empty lists without aux outputs.
    seconds: wall-clock seconds of the epoch (all pipelines drained).
    pipeline_seconds: per pipeline, seconds until it had drained.
    delayed_seconds: per pipeline, injected delay so far (all its stages).
    mean_group_size: per stage, the mean size of the averaging groups so
      far (P for allreduce, 2 for adpsgd, 1 for hetpipe's pushes).
  """

  batches: list[int]
  steps: list[int]
  losses: list[list[float]]
  seconds: float
  pipeline_seconds: list[float]
  delayed_seconds: list[float]
  mean_group_size: list[float]
  aux: list[list] = dataclasses.field(default_factory=list)


@outside_user_mesh  # (A caller's jax.set_mesh.)
class DataParallelPipelines(ConsensusStateMethods):
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
    batches_per_epoch: batches per pipeline in an epoch, on average: the
      epoch ends when the last stages' replicas have taken P times this
      many steps (``run_epoch``).
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

  # -- free-running epochs ---------------------------------------------------

  def run_epoch(
    self,
    states,
    batch_at: Callable[[int, int], Any],
    *,
    max_batches: int | None = None,
  ) -> tuple[list[PipelineState], EpochReport]:
    """Every pipeline trains at its own pace until the epoch ends.

    Args:
      states: the pipelines' states.
      batch_at: ``batch_at(pipeline, i)``: that pipeline's i-th batch of
        the epoch (a pipeline's own shard of the data).
      max_batches: a bound on any pipeline's batches (default 4x
        ``batches_per_epoch``; the epoch normally ends first).

    Returns:
      The drained states and an ``EpochReport``.
    """
    limit = max_batches or 4 * self.batches_per_epoch
    # Every process has finished the last epoch before the owner of the
    # shared objects resets them, and before anyone starts.
    self.hub.barrier("epoch done")
    self.policy.new_epoch()
    self.hub.barrier("epoch reset")
    for hooks in self.hooks:
      hooks.draining = False
    n = len(self.pipelines)
    losses = [[] for _ in range(n)]
    auxes = [[] for _ in range(n)]  # Per pipeline, each call's flat aux.
    batches = [0] * n
    ended = [0.0] * n
    start = time.perf_counter()

    def train(i):
      p, pipe, state, pending = self.ranks[i], self.pipelines[i], states[i], []
      reports = self.reporter[p] == jax.process_index()
      while batches[i] < limit:
        if reports and self.policy.stop_of(p) is not None:
          self.policy.stop_feeding(p)
        if not self.policy.may_run(p, batches[i]):
          break
        state, metrics = pipe.step(state, batch_at(p, batches[i]))
        batches[i] += 1
        if "loss" in metrics:
          pending.append((metrics["loss"], metrics.get("aux")))
        if len(pending) > 2:  # Stay at most two calls ahead of the devices.
          _take(pending.pop(0), losses[i], auxes[i])
      self.hooks[i].draining = True
      self.policy.start_draining(p, self.stages_here[p])
      state, _ = pipe.flush(state)
      state = self._finish(pipe, p, state)
      jax.block_until_ready([x for x in state.stage_params if x is not None])
      for taken in pending:
        _take(taken, losses[i], auxes[i])
      ended[i] = time.perf_counter() - start
      return state, None

    states, _ = self._each(train)
    seconds = time.perf_counter() - start
    aux = [_mean_leaves(a) for a in auxes]
    return states, self._epoch_report(batches, losses, aux, ended, seconds)

  def _epoch_report(self, batches, losses, aux, ended, seconds) -> EpochReport:
    """The epoch's ``EpochReport``, on every process: each pipeline's
    figures from the process of its last stage (where it steps last),
    its injected delays summed over its processes."""
    me = jax.process_index()
    mine = {
      "reports": [
        [p, batches[i], self.hooks[i].steps[-1], losses[i], ended[i], aux[i]]
        for i, p in enumerate(self.ranks)
        if self.reporter[p] == me
      ],
      "delayed": [
        [p, h.delayed_seconds]
        for p, h in zip(self.ranks, self.hooks, strict=True)
      ],
      "sizes": self.policy.group_size_sums(),
      "seconds": seconds,
    }
    everyone = self.hub.all_gather("epoch report", mine)
    reports = {r[0]: r[1:] for e in everyone for r in e["reports"]}
    delayed = [0.0] * self.num_pipelines
    for e in everyone:
      for p, d in e["delayed"]:
        delayed[p] += d
    sizes = [
      (
        sum(e["sizes"][s][0] for e in everyone),
        sum(e["sizes"][s][1] for e in everyone),
      )
      for s in range(self.num_stages)
    ]
    ranks = range(self.num_pipelines)
    return EpochReport(
      batches=[reports[p][0] for p in ranks],
      steps=[reports[p][1] for p in ranks],
      losses=[reports[p][2] for p in ranks],
      seconds=max(e["seconds"] for e in everyone),
      pipeline_seconds=[reports[p][3] for p in ranks],
      delayed_seconds=delayed,
      mean_group_size=[t / c if c else float("nan") for t, c in sizes],
      aux=[reports[p][4] for p in ranks],
    )

  def _finish(self, pipe, p, state):
    """The policy's end-of-epoch sync of pipeline p (HetPipe's last push),
    into its drained state (unchanged where the policy keeps the params)."""
    params = tuple(
      self.policy.finish(p, s, leaves) if s in self.stages_here[p] else leaves
      for s, leaves in enumerate(state.stage_params)
    )
    if all(a is b for a, b in zip(params, state.stage_params, strict=True)):
      return state
    return pipe.with_stage_params(state, params)


def _take(taken, losses: list, auxes: list) -> None:
  """A call's (loss, aux) as floats (waits for them) onto the lists."""
  loss, aux = taken
  losses.append(float(loss))
  if aux is not None:
    auxes.append([np.asarray(x, np.float64) for x in jax.tree.leaves(aux)])


def _mean_leaves(calls: list) -> list:
  """Each flat aux leaf's mean over the calls (JSON-ready lists)."""
  if not calls:
    return []
  return [
    np.mean(np.stack(leaf), axis=0).tolist()
    for leaf in zip(*calls, strict=True)
  ]


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
