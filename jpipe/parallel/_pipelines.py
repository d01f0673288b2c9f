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
global ``jax.devices()`` and runs the pipelines whose devices it holds
(one or more per process, as many in each; a pipeline may not span
processes). Process 0 serves the shared objects (``_hub.py``); the
averaging collectives run over the group's devices in whichever
processes hold them. Every process calls every method, in the same
order; lists of states are this process's pipelines' (``ranks``).
"""

import dataclasses
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np

from jpipe import distributed
from jpipe.parallel._hetero import Heterogeneity
from jpipe.parallel._hooks import ReplicaHooks
from jpipe.parallel._hub import make_hub
from jpipe.parallel._sync import SYNC_POLICIES, make_policy, policy_options
from jpipe.runtime import Pipeline, PipelineState, with_partition


@dataclasses.dataclass
class EpochReport:
  """What an epoch of free-running pipelines did (every pipeline's, also
  across processes).

  Attributes:
    batches: per pipeline, the batches (``step`` calls) it ran.
    steps: per pipeline, its last stage's optimizer steps so far.
    losses: per pipeline, each call's mean loss.
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


class DataParallelPipelines:
  """P pipelines of S stages, their stages' replicas synchronised.

  Args:
    loss_fn, params, example_batch: as ``jpipe.Pipeline`` (the example
      batch is one pipeline's).
    pipelines: P.
    sync: "allreduce", "preduce", "adpsgd" or "hetpipe" (see
      ``jpipe.parallel``).
    devices: all pipelines' devices (default ``jax.devices()``); each
      pipeline gets ``len(devices) // pipelines`` consecutive ones.
    batches_per_epoch: batches per pipeline in an epoch, on average: the
      epoch ends when the last stages' replicas have taken P times this
      many steps (``run_epoch``).
    hetero: simulated delays (``Heterogeneity``; None: none).
    ssp_bound: preduce: rounds between graph-sync rounds.
    pairwise: preduce: hand out pairs (default: beyond 8 pipelines).
    gossip_seed: adpsgd: the shared shuffle seed.
    hetpipe_every: hetpipe: batches between pushes.
    **pipeline_options: ``jpipe.Pipeline``'s other arguments (schedule,
      num_stages, num_microbatches, optimizer, partition...). Pipeline 0 is
      partitioned; the others reuse its plan.
  """

  def __init__(
    self,
    loss_fn: Callable[..., jax.Array],
    params: Any,
    example_batch: Any,
    *,
    pipelines: int,
    sync: str = "allreduce",
    devices: Sequence[Any] | None = None,
    batches_per_epoch: int = 100,
    hetero: Heterogeneity | None = None,
    ssp_bound: int = 10,
    pairwise: bool | None = None,
    gossip_seed: int = 0,
    hetpipe_every: int = 10,
    **pipeline_options,
  ):
    devices = list(jax.devices() if devices is None else devices)
    per = _devices_per_pipeline(sync, pipelines, devices, pipeline_options)
    self.num_pipelines = pipelines
    self.devices_per_pipeline = per
    self.ranks = _local_ranks(devices, pipelines, per)
    self.hub = make_hub()
    self.hetero = hetero or Heterogeneity()
    self.hooks = [ReplicaHooks(p, self.hetero) for p in self.ranks]
    self.pipelines = _replica_pipelines(
      loss_fn,
      params,
      example_batch,
      [devices[p * per : (p + 1) * per] for p in self.ranks],
      self.hooks,
      pipeline_options,
    )
    self.plan = plan = self.pipelines[0].plan
    self.num_stages = self.pipelines[0].stages.num_stages
    self.sync = sync
    self.policy = make_policy(
      sync,
      pipelines,
      self.num_stages,
      batches_per_epoch,
      hub=self.hub,
      local_ranks=self.ranks,
      **policy_options(
        sync,
        ssp_bound=ssp_bound,
        pairwise=pairwise,
        gossip_seed=gossip_seed,
        hetpipe_every=hetpipe_every,
      ),
    )
    self.policy.place(
      {
        p: tuple(devices[p * per + ds[0]] for ds in plan.stage_devices)
        for p in range(pipelines)
      }
    )
    self.batches_per_epoch = batches_per_epoch
    for p, hooks in zip(self.ranks, self.hooks, strict=True):
      hooks.bind(self.policy, [p * per + ds[0] for ds in plan.stage_devices])

  def close(self) -> None:
    """Stops serving the shared objects (process 0 across processes)."""
    self.hub.close()

  # -- state -----------------------------------------------------------------

  def init(self, params: Any, model_state: Any = None) -> list[PipelineState]:
    """Every pipeline's state from the same params."""
    states = [pipe.init(params, model_state) for pipe in self.pipelines]
    self._start_servers(states)
    return states

  def _start_servers(self, states):
    self.policy.start(states[0].stage_params)

  def consensus_params(self, states: Sequence[PipelineState]) -> Any:
    """The mean of all pipelines' params (host arrays, on every process):
    the model to evaluate. Needs drained pipelines."""
    mine = _mean_trees(
      [
        pipe.gather_params(s)
        for pipe, s in zip(self.pipelines, states, strict=True)
      ]
    )
    if jax.process_count() == 1:
      return mine
    # Every process runs as many pipelines: the mean of the means.
    return _mean_trees(_all_gather(mine))

  def consensus_state(
    self, states: Sequence[PipelineState]
  ) -> tuple[Pipeline, PipelineState]:
    """(this process's first pipeline, its drained state with every
    stage's params the mean over all P pipelines'): the consensus model
    on one pipeline's stages, to evaluate through them. Each stage's
    mean is a collective over the stage's devices (``GroupMean``, as a
    sync); nothing is gathered to a host. Model state (BatchNorm
    statistics) stays the pipeline's own. Every process calls it."""
    everyone = range(self.num_pipelines)
    means = []
    for s in range(self.num_stages):
      devices = [self.policy.devices[r][s] for r in everyone]
      trees = [state.stage_params[s] for state in states]
      means.append(self.policy.mean(trees, devices)[0])
    first = self.pipelines[0]
    return first, first.with_stage_params(states[0], means)

  def state_dict(self, states: Sequence[PipelineState]) -> dict:
    """``{"pipelines": [every pipeline's state_dict, by rank]}`` (host
    arrays, on every process)."""
    mine = [
      pipe.state_dict(s) for pipe, s in zip(self.pipelines, states, strict=True)
    ]
    if jax.process_count() > 1:
      mine = [d for process in _all_gather(mine) for d in process]
    return {"pipelines": mine}

  def load_state_dict(self, tree: dict) -> list[PipelineState]:
    """This process's pipelines' states from ``state_dict``'s output.
    Saved with as many pipelines: each resumes its own replica. With
    another count, every pipeline starts from the replicas' mean (params,
    optimizer and model state; the largest step)."""
    saved = list(tree["pipelines"])
    if len(saved) != self.num_pipelines:
      saved = [_mean_state_dict(saved)] * self.num_pipelines
    states = [
      pipe.load_state_dict(saved[p])
      for p, pipe in zip(self.ranks, self.pipelines, strict=True)
    ]
    self._start_servers(states)
    return states

  def compile_groups(self, states) -> int:
    """Compiles, ahead of training, the averaging program of every group
    the policy may form (else each compiles when it first forms, inside
    the timed run). Returns how many were compiled."""
    first = self.pipelines[0]
    mine = set(self.ranks)
    count = 0
    for s in range(self.num_stages):
      params = [
        jax.ShapeDtypeStruct(x.shape, x.dtype)
        for x in states[0].stage_params[s]
      ]
      tree = params
      if self.policy.averages == "grads" and s not in first.tied.stages:
        tree = first.gradient_avals(s, params)
      for group in self.policy.possible_groups():
        if mine.isdisjoint(group):
          continue  # Other processes' pipelines only.
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
    batches = [0] * n
    ended = [0.0] * n
    start = time.perf_counter()

    def train(i):
      p, pipe, state, pending = self.ranks[i], self.pipelines[i], states[i], []
      while batches[i] < limit and self.policy.stop_of(p) is None:
        state, metrics = pipe.step(state, batch_at(p, batches[i]))
        batches[i] += 1
        if "loss" in metrics:
          pending.append(metrics["loss"])
        if len(pending) > 2:  # Stay at most two calls ahead of the devices.
          losses[i].append(float(pending.pop(0)))
      self.hooks[i].draining = True
      self.policy.start_draining(p)
      state, _ = pipe.flush(state)
      state = self._finish(pipe, p, state)
      jax.block_until_ready(state.stage_params)
      losses[i].extend(float(x) for x in pending)
      ended[i] = time.perf_counter() - start
      return state, None

    states, _ = self._each(train)
    seconds = time.perf_counter() - start
    return states, self._epoch_report(batches, losses, ended, seconds)

  def _epoch_report(self, batches, losses, ended, seconds) -> EpochReport:
    """The epoch's ``EpochReport``: this process's pipelines' figures
    gathered from every process (pipelines in rank order)."""
    mine = {
      "batches": batches,
      "steps": [h.steps[-1] for h in self.hooks],
      "losses": losses,
      "pipeline_seconds": ended,
      "delayed_seconds": [h.delayed_seconds for h in self.hooks],
      "sizes": self.policy.group_size_sums(),
      "seconds": seconds,
    }
    everyone = self.hub.all_gather("epoch report", mine)
    sizes = [
      (
        sum(e["sizes"][s][0] for e in everyone),
        sum(e["sizes"][s][1] for e in everyone),
      )
      for s in range(self.num_stages)
    ]
    return EpochReport(
      **{
        k: [x for e in everyone for x in e[k]]
        for k in (
          "batches",
          "steps",
          "losses",
          "pipeline_seconds",
          "delayed_seconds",
        )
      },
      seconds=max(e["seconds"] for e in everyone),
      mean_group_size=[t / c if c else float("nan") for t, c in sizes],
    )

  def _finish(self, pipe, p, state):
    """The policy's end-of-epoch sync of pipeline p (HetPipe's last push),
    into its drained state (unchanged where the policy keeps the params)."""
    params = tuple(
      self.policy.finish(p, s, leaves)
      for s, leaves in enumerate(state.stage_params)
    )
    if all(a is b for a, b in zip(params, state.stage_params, strict=True)):
      return state
    return pipe.with_stage_params(state, params)


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


def _local_ranks(devices, pipelines, per) -> tuple[int, ...]:
  """The pipelines whose devices this process holds (pipeline p on
  ``devices[p*per:(p+1)*per]``); every process must hold as many, and no
  pipeline may span processes."""
  me, count = jax.process_index(), jax.process_count()
  mine = []
  for p in range(pipelines):
    owners = {d.process_index for d in devices[p * per : (p + 1) * per]}
    if len(owners) > 1:
      raise ValueError(
        f"pipeline {p} would span processes {sorted(owners)}: across "
        "processes each pipeline runs in one process; give every process "
        "a multiple of the devices per pipeline (e.g. one pipeline per "
        "process: --devices-per-process = devices per pipeline)"
      )
    if owners == {me}:
      mine.append(p)
  if pipelines % count or len(mine) != pipelines // count:
    raise ValueError(
      f"{pipelines} pipelines over {count} processes: this process holds "
      f"{len(mine)}; every process must run as many (pipelines a multiple "
      "of the process count, as many devices in each process)"
    )
  return tuple(mine)


def _all_gather(tree) -> list:
  """Every process's ``tree`` of host arrays (the same structure in
  each), by process index, with this process's dtypes (the gather goes
  through JAX, which makes 64-bit values 32-bit)."""
  leaves, treedef = jax.tree.flatten(tree)
  stacked = jax.tree.leaves(distributed.allgather(tree))
  return [
    jax.tree.unflatten(
      treedef,
      [
        np.asarray(x[q], dtype=np.asarray(mine).dtype)
        for x, mine in zip(stacked, leaves, strict=True)
      ],
    )
    for q in range(jax.process_count())
  ]


def _mean_trees(trees):
  """The element-wise mean of pytrees of host arrays; integer and
  non-numeric leaves (an optimizer's step count) stay as the first's."""

  def mean(*xs):
    x0 = np.asarray(xs[0])
    if not np.issubdtype(x0.dtype, np.inexact):
      return xs[0]
    return np.mean(np.stack([np.asarray(x) for x in xs]), axis=0).astype(
      x0.dtype
    )

  return jax.tree.map(mean, *trees)


def _mean_state_dict(dicts):
  """The mean of state dicts (``_mean_trees``), with the largest step."""
  out = _mean_trees(
    [{k: v for k, v in d.items() if k != "step"} for d in dicts]
  )
  out["step"] = max(int(d["step"]) for d in dicts)
  return out


def _devices_per_pipeline(sync, pipelines, devices, pipeline_options) -> int:
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
  if "devices" in pipeline_options:
    raise ValueError("pass devices once, to DataParallelPipelines")
  return per


def _replica_pipelines(
  loss_fn, params, example_batch, devices, hooks, pipeline_options
) -> list[Pipeline]:
  """This process's pipelines, on ``devices[i]`` with ``hooks[i]``: the
  first partitions the model, the others run its plan."""
  first = Pipeline(
    loss_fn,
    params,
    example_batch,
    devices=devices[0],
    hooks=hooks[0],
    **pipeline_options,
  )
  if any(len(ds) > 1 for ds in first.plan.stage_devices):
    raise ValueError(
      "a stage replicated inside a pipeline (a pipedream_hybrid plan) "
      "cannot also be replicated across pipelines: partition with "
      "'contiguous' or 'pipedream' and let the pipelines be the replicas"
    )
  options = with_partition(pipeline_options, first.plan)
  return [first] + [
    Pipeline(loss_fn, params, example_batch, devices=ds, hooks=h, **options)
    for ds, h in zip(devices[1:], hooks[1:], strict=True)
  ]
