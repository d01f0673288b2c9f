"""The pipeline facade: validate, build, then init / step / flush / gather.

``Pipeline`` traces the loss on one microbatch, partitions it (or takes a
Plan), builds jitted stage functions, places each stage's parameters and
optimizer state on its device(s) and runs a schedule's actions through the
driver (``_driver.py``). JAX dispatches asynchronously, so devices work
concurrently; the host blocks only when reading metrics.

Synchronous schedules (seq, gpipe, 1f1b, interleaved) flush at the end of
every ``step`` and give exactly single-device gradient accumulation over
the microbatches. Asynchronous ones (``async``, ``2bw``) stream: the
steady state of PipeDream's 1F1B without flushes persists across calls,
microbatches still in flight when a call ends finish in the next one, and
stage s of n sees delay ``n - 1 - s`` on every microbatch after the
warm-up, whatever the call boundaries (``jpipe.schedule.Stream``).
``flush`` drains the stream; ``gather_params`` and ``state_dict`` need a
drained pipeline. Which params each forward and backward uses is the
version policy's table (``_versions.py``); tied parameters are
``_tied.py``'s; a stage on several devices is a replica group
(``_placement.py``: data parallel, same math).

The last stage (no other stage reads its values) runs each microbatch's
forward and backward as one program wherever that gives the same result
(``fuse_last_stage``): its backward needs nothing but its own forward.
"""

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple

import jax
import optax

from jpipe import partition as partition_lib
from jpipe import schedule as schedule_lib
from jpipe import staleness
from jpipe.runtime import _pipeline_state
from jpipe.runtime._batches import batch_size, place_microbatches
from jpipe.runtime._build import (
  check_stage_count,
  cut_model,
  partition_model,
  place_stages,
  schedule_calls,
)
from jpipe.runtime._driver import Driver, DriverHooks, InFlight
from jpipe.runtime._flat import FlatLayout, own_buffer_bytes
from jpipe.runtime._memory import (
  StageMemory,
  device_totals,
  resolve_memory_limit,
)
from jpipe.runtime._options import Staleness, staleness_from_keywords
from jpipe.runtime._partitioning import (
  Partitioning,
  partitioning_from_keywords,
)
from jpipe.runtime._pipeline_memory import (
  check_memory_limit,
  predict_pipeline_memory,
)
from jpipe.runtime._profiler import ActionProfiler
from jpipe.runtime._programs import StagePrograms
from jpipe.runtime._stage_optimizer import StageOptimizer, leaf_names
from jpipe.runtime._tied import TiedParams
from jpipe.runtime._versions import VersionPolicy


class PipelineState(NamedTuple):
  """Per-stage parameter leaves and optimizer states, on their devices.

  An optimizer state is keyed by the leaves' global paths (see
  ``Pipeline.state_dict``); on a Gap-Aware stage it is Gap-Aware's state
  around the optimizer's. ``in_flight``: an asynchronous pipeline's
  stream (microbatches between their forward and their step); None for
  synchronous ones. A state is consumed by ``step`` / ``flush`` (its
  gradient buffers are donated): continue from the one they return.
  """

  stage_params: tuple[tuple[jax.Array, ...], ...]
  opt_states: tuple[Any, ...]
  step: int
  # Leaves of the model state (BatchNorm statistics), when there is one.
  model_state: tuple[jax.Array, ...] = ()
  in_flight: InFlight | None = None


class Pipeline:
  """A model split into pipeline stages, trained by a schedule.

  Args:
    loss_fn: ``loss_fn(params, batch) -> scalar`` (mean over the batch).
    params: example params (their structure is kept).
    example_batch: a full mini-batch; its leading axis is split into
      ``num_microbatches`` microbatches.
    num_stages: pipeline stages, required unless ``partitioning`` is
      given (ignored when ``partition`` is a Plan);
      with "pipedream_hybrid", the devices the plan may use (its DP picks
      the stages and their replicas).
    devices: the devices to use; default ``jax.devices()``.
    schedule: a name from ``jpipe.schedule.SCHEDULES`` or its
      ``jpipe.schedule.ScheduleKind`` (``jpipe.schedule.REGISTRY``).
    num_microbatches: microbatches per ``step`` call of the example batch
      (it fixes the microbatch size; a call may pass a batch of another
      multiple of it).
    optimizer: an optax transformation, applied per stage.
    partition: "contiguous", "mixed", "pipedream", "pipedream_hybrid"
      (see ``jpipe.partition.plan_traced``), or a jpipe.partition.Plan. A Plan
      may put a stage on several devices (``stage_devices[s]`` =
      ``(0, 1)``): the stage then runs data parallel over them, each
      microbatch split among the replicas (it must divide evenly), with
      the same results as on one device. Stages share all their devices
      or none.
    depth: module-path depth of the traced nodes; None (the default)
      chooses it: the shallowest depth whose split into the stages is as
      balanced (within 5 %) as the deepest's (``self.granularity`` says
      which and why; with a Plan, the depth its nodes were cut at).
    bandwidth: bytes/s between devices, for the partitioner (None: plan on
      compute alone; "pipedream" / "pipedream_hybrid" then assume 1e9 for
      the all-reduce of replicated stages).
    cost_model: how the partitioner costs nodes (see
      ``jpipe.partition.profile_nodes``): "analytic" (FLOPs from the jaxpr;
      default, no compilation), "xla" (XLA's cost analysis) or "measured"
      (each node compiled and timed on the default device: slower to
      start, right where FLOPs mislead, e.g. small or memory-bound ops).
    recompute: backward recomputes the forward (True) or keeps residuals.
      ``async`` without weight stashing needs it: saved residuals pin the
      forward's params, which is weight stashing.
    step_every: ``async``: a stage steps after every ``step_every``
      backwards, on their mean gradient (a flush steps on a partial
      window's mean); ``2bw``: microbatches per minibatch (>= num_stages).
    weight_stashing: ``async``: the backward recomputes at the params its
      forward used (PipeDream). Costs up to d + 1 param versions per stage.
    prediction: ``async``: None, "msnag" (predict the params ``delay``
      steps ahead with zero future gradients) or "aggmsnag" (the first
      future step uses the gradient accumulated so far).
    predictor: the ``staleness.Predictor`` to use; default
      ``staleness.replay_predictor(optimizer)`` (any optax optimizer,
      scheduler-aware by itself). Pass ``staleness.weight_predictor(...)``
      for FTPipe's closed forms.
    learning_rate_schedule: with a closed-form ``predictor``, the schedule
      that makes prediction scheduler-aware (future learning rates).
    gap_aware: ``async``: None, "ga" (FTPipe's Gap-Aware; the gap is
      between the params the forward used and those the step updates) or
      "ga_jfl" (the same gap, but the backward recomputes at the current
      params: only the loss signal is stale; needs recompute).
    gap_aware_options: keyword arguments of ``staleness.gap_aware``
      (``optimizer`` "sgd" | "adam" | "adamw", ``learning_rate``,
      ``weight_decay``, ``beta``...); required with ``gap_aware``.
    gap_aware_policy: which stages apply it, by depth (FTPipe):
      "all_except_last" (default), "almost_last_partition",
      "all_except_last_two".
    model_state: non-trained model state (e.g. BatchNorm statistics). With
      it, ``loss_fn(params, model_state, batch) -> (loss, new_model_state)``;
      each stage feeds its forwards the state its previous forward left
      (microbatches in order, as one device would) and the recomputing
      backward sees the same state as its forward.
    record_params: report, in each call's ``metrics["used_params"]``,
      the params every forward and backward used, keyed by ``(kind,
      stage, microbatch)`` (tests and debugging; holds every version
      alive).
    fuse_last_stage: run the backward of a stage no other stage reads
      from (the last, which computes the loss) together with its forward,
      as one program, wherever the result is the same: B(s, k) needs
      nothing but F(s, k), so it may run early unless a step of s comes
      between them (async) or it would differentiate at other params.
      One program instead of a forward and a backward-from-residuals lets
      XLA fuse across them and keeps no residuals: GPipe's last stage no
      longer holds every microbatch's activations. A measured timeline
      shows such an F spanning both and its B as an instant. Only the
      order of the gradient sum changes (float rounding).
    transport: how values cross processes when the devices belong to
      several (``jax.distributed``; each process runs its own stages):
      "pull" (``jax.experimental.transfer``: never blocks a device) or
      "collective" (a ppermute pair program: gloo / NCCL, but it ties the
      two stages' streams together). See ``runtime/_transport.py``.
    memory_limit: bytes each device may hold, or "device" (each device's
      own capacity, where the platform reports it: GPUs and TPUs); None
      (default) checks nothing. The partitioner ("contiguous",
      "pipedream*") then only considers splits that fit, and the built
      pipeline's prediction (``self.memory``: params and their stashed
      versions, gradients, optimizer state, microbatches in flight for
      the schedule) must fit, or construction fails naming the stage, the
      predicted bytes and the fixes -- before anything compiles.
    hooks: a ``jpipe.runtime.DriverHooks`` called around this pipeline's
      actions, for the stages this process runs (before each forward or
      backward, on each gradient before its step, on each stage's params
      after it): what a layer above adds, e.g. data-parallel replica
      sync and simulated delays (``jpipe.parallel``) or injected
      slowdowns (``jpipe.dynamic``). None: no hooks.
    staleness: the staleness options above as one ``jpipe.runtime.
      Staleness`` value (``self.staleness`` either way); giving it and
      any of their keywords at once is refused.
    partitioning: the split and placement options above (num_stages,
      partition, depth, bandwidth, cost_model, fuse_last_stage,
      transport, memory_limit) as one ``jpipe.runtime.Partitioning``
      value (``self.partitioning`` either way); giving it and any of
      their keywords at once is refused.
  """

  def __init__(
    self,
    loss_fn: Callable[..., jax.Array],
    params: Any,
    example_batch: Any,
    *,
    num_stages: int | None = None,
    devices: Sequence[Any] | None = None,
    schedule: "str | schedule_lib.ScheduleKind" = "gpipe",
    num_microbatches: int = 1,
    optimizer: optax.GradientTransformation,
    partition: Any = "contiguous",
    depth: int | None = None,
    bandwidth: float | None = None,
    cost_model: str = "analytic",
    recompute: bool = True,
    step_every: int = 1,
    weight_stashing: bool = False,
    prediction: str | None = None,
    predictor: staleness.Predictor | None = None,
    learning_rate_schedule: Callable[[Any], Any] | None = None,
    gap_aware: str | None = None,
    gap_aware_options: Mapping[str, Any] | None = None,
    gap_aware_policy: str = "all_except_last",
    model_state: Any = None,
    record_params: bool = False,
    fuse_last_stage: bool = True,
    transport: str = "pull",
    memory_limit: float | str | None = None,
    hooks: DriverHooks | None = None,
    staleness: Staleness | None = None,
    partitioning: Partitioning | None = None,
  ):
    staleness = staleness_from_keywords(
      staleness,
      recompute=recompute,
      step_every=step_every,
      weight_stashing=weight_stashing,
      prediction=prediction,
      predictor=predictor,
      learning_rate_schedule=learning_rate_schedule,
      gap_aware=gap_aware,
      gap_aware_options=gap_aware_options,
      gap_aware_policy=gap_aware_policy,
    )
    partitioning = partitioning_from_keywords(
      partitioning,
      num_stages,
      partition=partition,
      depth=depth,
      bandwidth=bandwidth,
      cost_model=cost_model,
      fuse_last_stage=fuse_last_stage,
      transport=transport,
      memory_limit=memory_limit,
    )
    schedule = schedule_lib.lookup(schedule).name
    staleness.check(schedule, optimizer, params)
    self.staleness, self.partitioning = staleness, partitioning
    self.microbatch_size = _microbatch_size(example_batch, num_microbatches)
    self.num_microbatches = num_microbatches
    devices = list(jax.devices() if devices is None else devices)
    check_stage_count(
      partitioning.num_stages, len(devices), partitioning.partition
    )
    self.memory_limit = resolve_memory_limit(partitioning.memory_limit, devices)
    self.optimizer = optimizer

    cut = cut_model(
      loss_fn,
      params,
      example_batch,
      self.microbatch_size,
      model_state,
      partitioning,
      len(devices),
    )
    self.traced, self.granularity = cut.traced, cut.granularity
    self._num_batch_leaves = cut.num_batch_leaves
    self.state_treedef = cut.state_treedef
    parts = partition_model(
      cut,
      params,
      partitioning,
      len(devices),
      staleness=staleness,
      schedule=schedule,
      num_microbatches=num_microbatches,
      optimizer=optimizer,
      memory_limit=self.memory_limit,
    )
    self.plan, self.stages = parts.plan, parts.stages
    placed = place_stages(
      self.plan,
      self.stages,
      devices,
      self.microbatch_size,
      cut.num_batch_leaves,
      partitioning.transport,
    )
    self.placement, self.stage_device = placed.placement, placed.stage_device
    self.transport, self._batch_leaves = placed.transport, placed.batch_leaves
    self._schedule_device = placed.schedule_device
    self.device_names = placed.device_names
    self.schedule_name = schedule
    scheduled = schedule_calls(
      schedule,
      self.stages,
      placed.schedule_device,
      num_microbatches,
      step_every=staleness.step_every,
      fuse_last_stage=partitioning.fuse_last_stage,
    )
    self.stream, self.calls = scheduled.stream, scheduled.calls
    self.schedule = scheduled.schedule
    self._build_runtime(params, record_params, hooks)
    self._memory = None
    if self.memory_limit is not None:
      check_memory_limit(self, self.memory_limit)

  def _build_runtime(self, params, record_params, hooks) -> None:
    """Stage programs, tied params, per-stage optimizers, the version
    policy and the driver."""
    param_avals = self.traced.closed_jaxpr.in_avals
    grad_layouts = tuple(
      FlatLayout(
        [param_avals[i] for i in spec.param_leaves],
        own_buffer_bytes(place.devices[0].platform),
      )
      for spec, place in zip(self.stages.specs, self.placement, strict=True)
    )
    staleness = self.staleness
    self.programs = StagePrograms(
      self.stages, grad_layouts, staleness.recompute
    )
    self.tied = TiedParams(self.stages, self.transport)
    self.params_treedef = jax.tree.structure(params)
    self.leaf_names = leaf_names(params)
    # One predictor for every stage, as before the options became a value.
    predictor = staleness.stage_predictor(self.optimizer)
    self.stage_optimizers = tuple(
      self._stage_optimizer(s, grad_layouts[s], predictor)
      for s in range(self.stages.num_stages)
    )
    self.policy = VersionPolicy(
      self.stream,
      recompute=staleness.recompute,
      weight_stashing=staleness.weight_stashing,
      prediction=staleness.prediction,
      gap_aware=staleness.gap_aware,
      record=record_params,
    )
    self.driver = Driver(
      self.stages,
      self.programs,
      self.placement,
      self.stage_optimizers,
      self.policy,
      self.tied,
      self.transport,
      self.stream,
      num_batch_leaves=self._num_batch_leaves,
      record_params=record_params,
    )
    if hooks is not None:
      self.driver.hooks = hooks

  # -- Memory ----------------------------------------------------------------

  @property
  def memory(self) -> tuple[StageMemory, ...]:
    """Per stage, the bytes it is predicted to hold on each of its devices
    at its peak (``StageMemory``: params x versions, gradients, optimizer
    state, microbatches in flight x what each keeps, one program's
    working buffers), for this schedule and microbatch count. From
    abstract shapes: nothing compiles."""
    if self._memory is None:
      self._memory = predict_pipeline_memory(self)
    return self._memory

  @property
  def device_memory(self) -> dict[int, int]:
    """``{device index: predicted peak bytes}``: the stages each device
    runs (``memory``) added up, one program's working buffers counted
    once per device."""
    return device_totals(self.memory, self.plan.stage_devices)

  def _stage_optimizer(self, s, layout, predictor):
    n = self.stages.num_stages
    leaves = self.stages.specs[s].param_leaves
    # Asynchronous: replicas of tied leaves another stage owns never step.
    replica = self.tied.replica_positions(s) if self.stream else set()
    positions = [p for p in range(len(leaves)) if p not in replica]
    return StageOptimizer(
      [self.leaf_names[leaves[p]] for p in positions],
      self.optimizer,
      positions=positions,
      gap_aware=self.staleness.gap_aware_at(
        partition_lib.steady_state_delay(n, s)
      ),
      predictor=predictor,
      learning_rate_schedule=self.staleness.learning_rate_schedule,
      horizon=self.stream.max_delay(s) if self.stream else 0,
      grad_layout=layout,
    )

  @property
  def reads_batch(self) -> bool:
    """Whether this process's stages read any batch leaf (inputs,
    labels). Across processes, one that reads none may pass ``step`` the
    batch's shapes (``jax.ShapeDtypeStruct`` leaves) instead of its data:
    only its size is used there."""
    return any(self._batch_leaves.values())

  # -- Action lists of a call ----------------------------------------------

  def call_actions(
    self, state: PipelineState, num_microbatches: int | None
  ) -> schedule_lib.ActionLists:
    """The action lists the next ``step`` with ``num_microbatches`` (None:
    the next ``flush``) would run from ``state``, per schedule device."""
    fed = state.in_flight.fed if state.in_flight else 0
    return self.calls(fed, num_microbatches).lists

  # -- State -----------------------------------------------------------------

  def init(self, params: Any, model_state: Any = None) -> PipelineState:
    """Splits ``params`` per stage, places them, builds optimizer states.

    ``model_state``: the initial model state (required when the pipeline
    was built with one).
    """
    if (model_state is None) != (self.state_treedef is None):
      raise ValueError(
        "pass model_state to init exactly when the Pipeline was built with "
        "model_state="
      )
    state_leaves = ()
    if model_state is not None:
      if jax.tree.structure(model_state) != self.state_treedef:
        raise ValueError("model_state has another structure than at build")
      state_leaves = tuple(jax.tree.leaves(model_state))
    stage_params, opt_states = [], []
    for s, leaves in enumerate(self.stages.split_params(params)):
      if not self.transport.owns(s):  # Another process runs it.
        stage_params.append(None)
        opt_states.append(None)
        continue
      place = self.placement[s]
      placed = place.put_replicated(leaves)
      stage_params.append(placed)
      opt_states.append(
        place.put_replicated(self.stage_optimizers[s].init(placed))
      )
    return self.drained_state(stage_params, opt_states, 0, state_leaves)

  def with_stage_params(
    self, state: PipelineState, stage_params: Sequence[Any]
  ) -> PipelineState:
    """The drained ``state`` with other params per stage (each stage's
    leaves, placed as ``state.stage_params`` are): an asynchronous stream
    starts anew from them. E.g. a replica's params after a sync."""
    _pipeline_state.check_drained(state, "with_stage_params")
    flight = InFlight.start(stage_params) if self.stream else None
    return state._replace(stage_params=tuple(stage_params), in_flight=flight)

  def gradient_avals(self, stage: int, params: Sequence[Any]) -> Any:
    """Shapes and dtypes of stage ``stage``'s gradient as its optimizer
    step receives it (small leaves packed into one buffer) for its param
    leaves ``params`` (arrays or ``jax.ShapeDtypeStruct``)."""
    return jax.eval_shape(self.programs.grad_layouts[stage].pack, params)

  def drained_state(self, stage_params, opt_states, step, model_state):
    """A drained state: a new stream for asynchronous schedules."""
    flight = InFlight.start(stage_params) if self.stream else None
    return PipelineState(
      tuple(stage_params), tuple(opt_states), step, tuple(model_state), flight
    )

  def gather_model_state(self, state: PipelineState) -> Any:
    """The model state pytree (host arrays), or None without one. Needs a
    drained pipeline (``flush``). Across processes every process must
    call it; each gets the whole state."""
    return _pipeline_state.gather_model_state(self, state)

  def gather_params(self, state: PipelineState) -> Any:
    """The full params pytree (host arrays). Needs a drained pipeline
    (``flush``): mid-stream, every stage is at another step. Across
    processes every process must call it; each gets the whole pytree."""
    return _pipeline_state.gather_params(self, state)

  def nonfinite_params(self, state: PipelineState) -> dict[int, str]:
    """``{stage: path of its first param leaf holding a NaN or an
    infinity}`` for every such stage (empty when all are finite). Works
    mid-stream. Across processes every process must call it."""
    return _pipeline_state.nonfinite_params(self, state)

  def param_norms(self, state: PipelineState) -> list[float]:
    """Each stage's parameter L2 norm (all its leaves together). Across
    processes every process must call it; each gets every stage's."""
    return _pipeline_state.param_norms(self, state)

  def stage_param_avals(self) -> list[tuple[Any, ...]]:
    """Per stage, the abstract values (shape, dtype) of its param leaves."""
    return _pipeline_state.stage_param_avals(self)

  def state_dict(self, state: PipelineState) -> dict[str, Any]:
    """The whole training state, independent of the partition (host
    arrays): ``{"params", "opt_state" (laid out as ``optimizer.init``
    does for the whole model, params-shaped parts keyed by global leaf
    path), "gap_aware", "model_state", "step"}``
    (``_pipeline_state.state_dict``). Needs a drained pipeline."""
    return _pipeline_state.state_dict(self, state)

  def load_state_dict(self, tree: Mapping[str, Any]) -> PipelineState:
    """A PipelineState from ``state_dict``'s output (any partition).
    Gap-Aware statistics of leaves that were not on a Gap-Aware stage when
    saved start fresh (zeros), as they do at initialisation."""
    return _pipeline_state.load_state_dict(self, tree)

  # -- Calls -----------------------------------------------------------------

  def step(self, state: PipelineState, batch: Any, *, profile: bool = False):
    """Feeds one mini-batch into the pipeline; returns (state, metrics).

    The batch is cut into microbatches of the example batch's microbatch
    size (``num_microbatches`` of them for a batch of the example's size).
    Synchronous schedules run them and take one optimizer step per stage
    (a flush per call). ``async`` and ``2bw`` stream: each stage runs the
    forwards of the new microbatches and the backwards and steps 1F1B
    pairs with them; microbatches still in flight finish in later calls or
    at ``flush``. Across processes every process calls ``step`` with the
    same batch size; where ``reads_batch`` is False the batch's shapes
    suffice (no data need be read there).

    Returns:
      The new state and ``metrics``: "loss", the mean loss of the
      microbatches whose forward (and so loss) ran in this call -- each
      microbatch's loss is counted once, in the call that feeds it;
      "param_versions", per stage the most param versions held at once,
      and "param_bytes", the most bytes of distinct param arrays;
      with ``profile=True`` "timeline", when every action of the call ran
      on its device (a ``jpipe.schedule.Timeline``; export with
      ``write_chrome_trace`` / ``plot_timeline``; the call runs the same
      compiled programs as any other; across processes it holds this
      process's actions, on its own clock); with ``record_params``
      "used_params".
    """
    size = batch_size(batch)
    if size % self.microbatch_size:
      raise ValueError(
        f"a batch of {size} examples does not split into microbatches of "
        f"{self.microbatch_size} (the example batch's size / "
        f"num_microbatches): pass a multiple of {self.microbatch_size}"
      )
    m = size // self.microbatch_size
    fed = state.in_flight.fed if state.in_flight else 0
    batches = place_microbatches(
      jax.tree.leaves(batch), self._batch_leaves, m, fed
    )
    return self._run(state, fed, m, batches, profile)

  def flush(self, state: PipelineState, *, profile: bool = False):
    """Drains an asynchronous pipeline: every pending backward and step
    runs (a partial ``step_every`` window steps on its mean). The next
    ``step`` starts a new stream with a new warm-up. A no-op for
    synchronous schedules (they flush every call).

    Returns:
      (state, metrics) as ``step``, without "loss" (no forward runs).
    """
    if self.stream is None or not state.in_flight.fed:
      return state, {}
    return self._run(state, state.in_flight.fed, None, {}, profile)

  def _run(self, state, fed, m, batches, profile):
    """One driver call: m microbatches after ``fed`` (None: a flush)."""
    call = self.calls(fed, m)
    profiler = ActionProfiler(call.lists) if profile else None
    flight = state.in_flight or InFlight.start(state.stage_params)
    if self.stream is None:
      cotangent = 1.0 / m
    else:  # A window's mean (a short one is rescaled at its step).
      cotangent = 1.0 / self.stream.step_every
    out = self.driver.run(
      call.order,
      call.fused,
      stage_params=state.stage_params,
      opt_states=state.opt_states,
      model_state=state.model_state,
      in_flight=flight,
      batches=batches,
      loss_cotangent=cotangent,
      profiler=profiler,
    )
    flight = out.in_flight
    if self.stream is None or m is None:
      if not flight.drained:
        raise RuntimeError("the pipeline did not drain")  # A schedule bug.
      flight = InFlight.start(out.stage_params) if self.stream else None
    else:
      flight = dataclasses.replace(flight, fed=fed + m)
    metrics = {
      "param_versions": tuple(out.param_versions),
      "param_bytes": tuple(out.param_bytes),
    }
    if out.loss is not None:
      metrics["loss"] = out.loss
    if profiler:
      metrics["timeline"] = profiler.timeline()
    if out.used_params is not None:
      metrics["used_params"] = out.used_params
    new = PipelineState(
      tuple(out.stage_params),
      tuple(out.opt_states),
      state.step + (m is not None),
      tuple(out.model_state),
      flight,
    )
    return new, metrics


def _microbatch_size(example_batch, num_microbatches: int) -> int:
  """Rows per microbatch; the count must divide the batch."""
  if num_microbatches < 1:
    raise ValueError(f"num_microbatches must be >= 1, got {num_microbatches}")
  size = batch_size(example_batch)
  if size % num_microbatches:
    raise ValueError(
      f"{num_microbatches} microbatches do not divide the batch of "
      f"{size}: use a divisor of {size}"
    )
  return size // num_microbatches
