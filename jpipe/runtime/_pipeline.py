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
import numpy as np
import optax

from jpipe import partition as partition_lib
from jpipe import schedule as schedule_lib
from jpipe import staleness
from jpipe.distributed import text_from_process_zero
from jpipe.runtime._batches import batch_size, place_microbatches
from jpipe.runtime._calls import CallActions
from jpipe.runtime._driver import Driver, DriverHooks, InFlight
from jpipe.runtime._flat import FlatLayout, own_buffer_bytes
from jpipe.runtime._gather import trees_everywhere
from jpipe.runtime._memory import (
  MemoryLimitError,
  StageMemory,
  device_totals,
  format_bytes,
  in_flight_counts,
  nbytes,
  param_versions,
  partitioner_memory_model,
  predict_stage_memory,
  resolve_memory_limit,
  tied_copies,
)
from jpipe.runtime._options import GAP_AWARE_POLICIES, check_staleness_options
from jpipe.runtime._placement import (
  StagePlacement,
  check_device_groups,
  device_name,
)
from jpipe.runtime._profiler import ActionProfiler
from jpipe.runtime._programs import StagePrograms
from jpipe.runtime._stage_optimizer import StageOptimizer, leaf_names
from jpipe.runtime._state_dict import (
  merge_optimizer_states,
  restore_structure,
  select_optimizer_states,
)
from jpipe.runtime._tied import TiedParams
from jpipe.runtime._transport import Transport
from jpipe.runtime._versions import VersionPolicy

SYNCHRONOUS = ("seq", "gpipe", "1f1b", "interleaved")
ASYNCHRONOUS = schedule_lib.STREAMS


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
    num_stages: pipeline stages (ignored when ``partition`` is a Plan);
      with "pipedream_hybrid", the devices the plan may use (its DP picks
      the stages and their replicas).
    devices: the devices to use; default ``jax.devices()``.
    schedule: one of jpipe.schedule.SCHEDULES.
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
  """

  def __init__(
    self,
    loss_fn: Callable[..., jax.Array],
    params: Any,
    example_batch: Any,
    *,
    num_stages: int,
    devices: Sequence[Any] | None = None,
    schedule: str = "gpipe",
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
  ):
    # -- Options ---------------------------------------------------------
    if schedule not in schedule_lib.SCHEDULES:
      raise ValueError(
        f"unknown schedule {schedule!r}: one of {schedule_lib.SCHEDULES}"
      )
    check_staleness_options(
      schedule,
      recompute=recompute,
      step_every=step_every,
      weight_stashing=weight_stashing,
      prediction=prediction,
      gap_aware=gap_aware,
      gap_aware_options=gap_aware_options,
      gap_aware_policy=gap_aware_policy,
    )
    if gap_aware is not None:
      # Gap-Aware reads the optimizer's statistics (Adam's moments or SGD's
      # momentum) by the name it is given: a wrong name reads nothing.
      staleness.check_state_matches(
        jax.eval_shape(optimizer.init, params),
        gap_aware_options["optimizer"],
        "Pipeline(gap_aware_options={'optimizer': ...})",
      )
    if num_microbatches < 1:
      raise ValueError(f"num_microbatches must be >= 1, got {num_microbatches}")
    size = batch_size(example_batch)
    if size % num_microbatches:
      raise ValueError(
        f"{num_microbatches} microbatches do not divide the batch of "
        f"{size}: use a divisor of {size}"
      )
    devices = list(jax.devices() if devices is None else devices)
    _check_stage_count(num_stages, len(devices), partition)
    self.memory_limit = resolve_memory_limit(memory_limit, devices)
    self.num_microbatches = num_microbatches
    self.microbatch_size = size // num_microbatches
    self.optimizer = optimizer

    # -- Trace and partition ---------------------------------------------
    micro = jax.tree.map(lambda x: x[: self.microbatch_size], example_batch)
    self._num_batch_leaves = len(jax.tree.leaves(micro))
    self._state_treedef = None
    if model_state is not None:
      self._state_treedef = jax.tree.structure(model_state)
      loss_fn, micro = partition_lib.with_model_state(
        loss_fn, micro, model_state
      )
    self.traced = partition_lib.trace(
      loss_fn, params, micro, depth=depth or 1, has_aux=model_state is not None
    )
    self.granularity = None  # An explicit depth.
    if depth is None:
      self.traced, self.granularity = _granularity(
        self.traced, partition, num_stages, len(devices)
      )
    if model_state is not None:
      _check_state_output(self.traced, self._state_treedef)
    self.plan = _make_plan(
      self.traced,
      params,
      micro,
      partition,
      num_stages,
      len(devices),
      bandwidth=bandwidth,
      cost_model=cost_model,
      recompute=recompute,
      memory=partitioner_memory_model(
        self.memory_limit,
        optimizer,
        params,
        schedule,
        num_microbatches,
        min(num_stages, len(devices)),
        recompute=recompute,
        stashes=weight_stashing or not recompute,
        fused_last=fuse_last_stage,
      ),
    )
    if jax.process_count() > 1 and not isinstance(
      partition, partition_lib.Plan
    ):  # A measured cost model may solve differently in each process.
      self.plan = partition_lib.Plan.from_json(
        text_from_process_zero(self.plan.to_json())
      )
    # Model-state leaf j is batch input num_batch_leaves + j and result
    # j + 1 (after the loss): carried from one microbatch to the next.
    num_state = 0 if model_state is None else len(jax.tree.leaves(model_state))
    self.stages = partition_lib.Stages(
      self.traced,
      self.plan.stage_of_node,
      carried=[(self._num_batch_leaves + j, j + 1) for j in range(num_state)],
    )
    n = self.stages.num_stages

    # -- Placement -------------------------------------------------------
    # A stage on several devices is a replica group (see _placement.py).
    self.placement = tuple(
      StagePlacement([devices[i] for i in ds], self.microbatch_size)
      for ds in self.plan.stage_devices
    )
    self.stage_device = tuple(p.device for p in self.placement)
    # Several processes: each runs the stages on its devices.
    self.transport = Transport(self.placement, transport)
    self.transport.connect()
    # Which batch leaves each placement's stages read (model-state leaves,
    # numbered after the batch leaves, are not split), for this process's.
    self._batch_leaves = {}
    for s, (spec, place) in enumerate(
      zip(self.stages.specs, self.placement, strict=True)
    ):
      if not self.transport.owns(s):
        continue
      wanted = self._batch_leaves.setdefault(place, [])
      wanted.extend(
        i
        for i in spec.batch_leaves
        if i < self._num_batch_leaves and i not in wanted
      )
    # The schedule's devices: one per device group, numbered in the order
    # of the groups' first devices; labelled "device 2", "devices 0-1".
    firsts = sorted({ds[0] for ds in self.plan.stage_devices})
    self._schedule_device = tuple(
      firsts.index(ds[0]) for ds in self.plan.stage_devices
    )
    groups = {ds[0]: ds for ds in self.plan.stage_devices}
    self.device_names = tuple(device_name(groups[f]) for f in firsts)

    # -- Schedule --------------------------------------------------------
    self.schedule_name = schedule
    self.stream = None
    if schedule in ASYNCHRONOUS:
      self.stream = schedule_lib.Stream(schedule, n, step_every)
    self.calls = CallActions(
      schedule,
      self.stream,
      n,
      self._schedule_device,
      output_free=tuple(not spec.outputs for spec in self.stages.specs),
      fuse=fuse_last_stage,
    )
    # The Stream, or the synchronous Schedule of num_microbatches.
    self.schedule = self.stream or self.calls.synchronous(num_microbatches)

    # -- Stage programs, tied params, optimizers, version policy ---------
    param_avals = self.traced.closed_jaxpr.in_avals
    grad_layouts = tuple(
      FlatLayout(
        [param_avals[i] for i in spec.param_leaves],
        own_buffer_bytes(place.devices[0].platform),
      )
      for spec, place in zip(self.stages.specs, self.placement, strict=True)
    )
    self.programs = StagePrograms(self.stages, grad_layouts, recompute)
    self.tied = TiedParams(self.stages, self.transport)
    self._params_treedef = jax.tree.structure(params)
    self._leaf_names = leaf_names(params)
    if prediction is not None and predictor is None:
      predictor = staleness.replay_predictor(optimizer)
    self.stage_optimizers = tuple(
      self._stage_optimizer(
        s,
        grad_layouts[s],
        predictor if prediction is not None else None,
        learning_rate_schedule,
        gap_aware_options if gap_aware is not None else None,
        gap_aware_policy,
      )
      for s in range(n)
    )
    self.policy = VersionPolicy(
      self.stream,
      recompute=recompute,
      weight_stashing=weight_stashing,
      prediction=prediction,
      gap_aware=gap_aware,
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
    self._memory = None
    if self.memory_limit is not None:
      self._check_memory(self.memory_limit)

  # -- Memory ----------------------------------------------------------------

  @property
  def memory(self) -> tuple[StageMemory, ...]:
    """Per stage, the bytes it is predicted to hold on each of its devices
    at its peak (``StageMemory``: params x versions, gradients, optimizer
    state, microbatches in flight x what each keeps, one program's
    working buffers), for this schedule and microbatch count. From
    abstract shapes: nothing compiles."""
    if self._memory is None:
      self._memory = self._predict_memory()
    return self._memory

  @property
  def device_memory(self) -> dict[int, int]:
    """``{device index: predicted peak bytes}``: the stages each device
    runs (``memory``) added up, one program's working buffers counted
    once per device."""
    return device_totals(self.memory, self.plan.stage_devices)

  def _predict_memory(self) -> tuple[StageMemory, ...]:
    n, m = self.stages.num_stages, self.num_microbatches
    if self.stream is None:
      calls = [self.calls(0, m)]
    else:  # Enough calls to reach the stream's steady state, then a flush.
      count = 2 + -(-(n + 2 * self.stream.step_every) // m)
      calls = [self.calls(i * m, m) for i in range(count)]
      calls.append(self.calls(count * m, None))
    flight = in_flight_counts(calls, n)
    versions = param_versions(self.policy, self.stream, n)
    replicas = [sorted(self.tied.replica_positions(s)) for s in range(n)]
    owners = [self.tied.replica_owner(s) for s in range(n)]
    copies = tied_copies(self.policy, self.stream, owners)
    avals = self.traced.closed_jaxpr.in_avals
    first_batch = self.traced.num_param_leaves
    out = []
    for s, (spec, params) in enumerate(
      zip(self.stages.specs, self._param_avals(), strict=True)
    ):
      batch = tuple(avals[first_batch + i] for i in spec.batch_leaves)
      acts = tuple(v.aval for v in spec.inputs)
      outputs, results, residuals = jax.eval_shape(
        lambda p, b, a, s=s: self.stages.forward_saving(s, p, b, a),
        params,
        batch,
        acts,
      )
      out.append(
        predict_stage_memory(
          params=params,
          opt_state=jax.eval_shape(self.stage_optimizers[s].init, params),
          kept=(batch, acts) if self.programs.recompute else residuals,
          residuals=residuals,
          outputs=(outputs, results),
          intermediates=jax.eval_shape(
            lambda p, b, a, s=s: self.stages.intermediates(s, p, b, a),
            params,
            batch,
            acts,
          ),
          in_flight=flight[s],
          versions=versions[s],
          tied=copies[s] * nbytes([params[p] for p in replicas[s]]),
          replicas=len(self.plan.stage_devices[s]),
        )
      )
    return tuple(out)

  def _check_memory(self, limit: float) -> None:
    """Refuses a pipeline whose prediction exceeds ``limit`` on a device."""
    totals = self.device_memory
    over = [d for d in sorted(totals) if totals[d] > limit]
    if not over:
      return
    d = max(over, key=totals.get)
    stages = [s for s, ds in enumerate(self.plan.stage_devices) if d in ds]
    worst = max(stages, key=lambda s: self.memory[s].total)
    fixes = ["more stages (each holds fewer params and activations)"]
    if not self.programs.recompute:
      fixes.append(
        "recompute=True (a microbatch in flight keeps only the stage's "
        "inputs, not its residuals)"
      )
    if self.memory[worst].in_flight > 1:
      fixes.append(
        "smaller microbatches (more num_microbatches for the same batch)"
      )
    if self.schedule_name == "gpipe":
      fixes.append("schedule='1f1b' (n - s microbatches in flight, not all)")
    if self.memory[worst].versions > 1:
      fixes.append("fewer stashed versions (2bw, or no weight stashing)")
    raise MemoryLimitError(
      f"the pipeline does not fit memory_limit={format_bytes(limit)}: "
      f"device {d} is predicted to hold {format_bytes(totals[d])} "
      f"(stage {', '.join(map(str, stages))}); stage {worst}: "
      f"{self.memory[worst].describe()}. Use " + "; or ".join(fixes)
    )

  def _stage_optimizer(self, s, layout, predictor, lr_schedule, ga, policy):
    n = self.stages.num_stages
    leaves = self.stages.specs[s].param_leaves
    # Asynchronous: replicas of tied leaves another stage owns never step.
    replica = self.tied.replica_positions(s) if self.stream else set()
    positions = [p for p in range(len(leaves)) if p not in replica]
    applies_ga = ga is not None and GAP_AWARE_POLICIES[policy](
      partition_lib.steady_state_delay(n, s)
    )
    return StageOptimizer(
      [self._leaf_names[leaves[p]] for p in positions],
      self.optimizer,
      positions=positions,
      gap_aware=dict(ga) if applies_ga else None,
      predictor=predictor,
      learning_rate_schedule=lr_schedule,
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
    if (model_state is None) != (self._state_treedef is None):
      raise ValueError(
        "pass model_state to init exactly when the Pipeline was built with "
        "model_state="
      )
    state_leaves = ()
    if model_state is not None:
      if jax.tree.structure(model_state) != self._state_treedef:
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
    return self._state(stage_params, opt_states, 0, state_leaves)

  def with_stage_params(
    self, state: PipelineState, stage_params: Sequence[Any]
  ) -> PipelineState:
    """The drained ``state`` with other params per stage (each stage's
    leaves, placed as ``state.stage_params`` are): an asynchronous stream
    starts anew from them. E.g. a replica's params after a sync."""
    self._check_drained(state, "with_stage_params")
    flight = InFlight.start(stage_params) if self.stream else None
    return state._replace(stage_params=tuple(stage_params), in_flight=flight)

  def gradient_avals(self, stage: int, params: Sequence[Any]) -> Any:
    """Shapes and dtypes of stage ``stage``'s gradient as its optimizer
    step receives it (small leaves packed into one buffer) for its param
    leaves ``params`` (arrays or ``jax.ShapeDtypeStruct``)."""
    return jax.eval_shape(self.programs.grad_layouts[stage].pack, params)

  def _state(self, stage_params, opt_states, step, model_state):
    """A drained state: a new stream for asynchronous schedules."""
    flight = InFlight.start(stage_params) if self.stream else None
    return PipelineState(
      tuple(stage_params), tuple(opt_states), step, tuple(model_state), flight
    )

  def _check_drained(self, state: PipelineState, what: str) -> None:
    flight = state.in_flight
    if flight is not None and flight.fed:
      raise ValueError(
        f"{what} needs a drained pipeline, but {flight.fed} microbatches "
        "of the asynchronous stream have not all been applied: call "
        "`state, _ = pipe.flush(state)` first"
      )

  def gather_model_state(self, state: PipelineState) -> Any:
    """The model state pytree (host arrays), or None without one. Needs a
    drained pipeline (``flush``). Across processes every process must
    call it; each gets the whole state."""
    self._check_drained(state, "gather_model_state")
    if self._state_treedef is None:
      return None
    # Each leaf from the process of the stage that updates it (any
    # process holds a leaf no stage updates: its initial value).
    producer = {
      r: s for s, spec in enumerate(self.stages.specs) for r in spec.results
    }
    held = [
      self.transport.owns(producer[i + 1])
      if i + 1 in producer
      else self.transport.process == 0
      for i in range(len(state.model_state))
    ]
    leaves = trees_everywhere(
      [x if h else None for x, h in zip(state.model_state, held, strict=True)],
      self.driver.state_avals,
      held,
    )
    return jax.tree.unflatten(self._state_treedef, leaves)

  def gather_params(self, state: PipelineState) -> Any:
    """The full params pytree (host arrays). Needs a drained pipeline
    (``flush``): mid-stream, every stage is at another step. Across
    processes every process must call it; each gets the whole pytree."""
    self._check_drained(state, "gather_params")
    stage_params = trees_everywhere(
      state.stage_params, self._param_avals(), self._held()
    )
    leaves = [None] * self.traced.num_param_leaves
    for spec, values in zip(self.stages.specs, stage_params, strict=True):
      for i, v in zip(spec.param_leaves, values, strict=True):
        if leaves[i] is None:
          leaves[i] = v
    return jax.tree.unflatten(self._params_treedef, leaves)

  def nonfinite_params(self, state: PipelineState) -> dict[int, str]:
    """``{stage: path of its first param leaf holding a NaN or an
    infinity}`` for every such stage (empty when all are finite). Works
    mid-stream (each stage's current params). Across processes every
    process must call it; each gets the answer for all stages."""

    def first_nonfinite(leaves):
      finite = [bool(jax.numpy.isfinite(x).all()) for x in leaves]
      return finite.index(False) if False in finite else -1

    firsts = self._per_stage_scalar(state, first_nonfinite, np.int32)
    return {
      s: self._leaf_names[self.stages.specs[s].param_leaves[int(i)]]
      for s, i in enumerate(firsts)
      if int(i) >= 0
    }

  def param_norms(self, state: PipelineState) -> list[float]:
    """Each stage's parameter L2 norm (all its leaves together). Across
    processes every process must call it; each gets every stage's."""

    def norm(leaves):
      return np.sqrt(sum(float(jax.numpy.vdot(x, x).real) for x in leaves))

    return [float(n) for n in self._per_stage_scalar(state, norm, np.float32)]

  def _per_stage_scalar(self, state, fn, dtype) -> list:
    """``fn(stage's param leaves)`` of every stage, computed by the process
    that runs it and known to all (a collective across processes)."""
    values = [
      None if leaves is None else dtype(fn(leaves))
      for leaves in state.stage_params
    ]
    template = jax.ShapeDtypeStruct((), dtype)
    return trees_everywhere(values, [template] * len(values), self._held())

  def _held(self):
    """Per stage, whether this process runs it."""
    return [self.transport.owns(s) for s in range(self.stages.num_stages)]

  def _param_avals(self):
    avals = self.traced.closed_jaxpr.in_avals
    return [
      tuple(avals[i] for i in spec.param_leaves) for spec in self.stages.specs
    ]

  def state_dict(self, state: PipelineState) -> dict[str, Any]:
    """The whole training state, independent of the partition (host arrays).

    Returns:
      ``{"params": the full params pytree, "opt_state": the optimizer's
      state as ``optimizer.init({path: leaf})`` lays it out for the whole
      model (params-shaped parts are dicts keyed by global leaf path),
      "gap_aware": {"sq_avg": {path: array}, "count", "max_learning_rate"}
      for the leaves of Gap-Aware stages ({} without Gap-Aware),
      "model_state": the model state pytree or None, "step": int}``. It
      needs a drained pipeline (``flush``), so no stash or in-flight
      microbatch needs saving.
    """
    self._check_drained(state, "state_dict")
    opt_avals = [
      jax.eval_shape(opt.init, avals)
      for opt, avals in zip(
        self.stage_optimizers, self._param_avals(), strict=True
      )
    ]
    opt_states = trees_everywhere(state.opt_states, opt_avals, self._held())
    merged, gap = merge_optimizer_states(self.stage_optimizers, opt_states)
    return {
      "params": self.gather_params(state),
      "opt_state": merged,
      "gap_aware": gap,
      "model_state": self.gather_model_state(state),
      "step": int(state.step),
    }

  def load_state_dict(self, tree: Mapping[str, Any]) -> PipelineState:
    """A PipelineState from ``state_dict``'s output (any partition).

    Gap-Aware statistics of leaves that were not on a Gap-Aware stage when
    saved start fresh (zeros), as they do at initialisation.
    """
    missing = {"params", "opt_state", "step"} - set(tree)
    if missing:
      raise ValueError(f"state dict lacks {sorted(missing)}")
    params = tree["params"]
    if jax.tree.structure(params) != self._params_treedef:
      raise ValueError(
        "the saved params have a different structure than this pipeline's "
        "model: it was saved from another model or configuration"
      )
    for name, saved, expected in zip(
      self._leaf_names,
      jax.tree.leaves(params),
      jax.tree.leaves(self.traced.closed_jaxpr.in_avals)[
        : self.traced.num_param_leaves
      ],
      strict=True,
    ):
      if tuple(np.shape(saved)) != tuple(expected.shape):
        raise ValueError(
          f"saved param {name} has shape {np.shape(saved)}, the model needs "
          f"{tuple(expected.shape)}: the checkpoint is for another model"
        )
    model_state = tree.get("model_state")
    if (model_state is None) != (self._state_treedef is None):
      raise ValueError(
        "the saved state and this pipeline disagree on having a model "
        "state (e.g. BatchNorm statistics): it was saved for another model"
      )
    if model_state is not None:
      model_state = restore_structure(model_state, self._state_treedef)
    base = self.init(params, model_state)
    stage_params = base.stage_params
    opt_states = list(base.opt_states)  # None where another process runs it
    owned = [s for s in range(len(opt_states)) if self.transport.owns(s)]
    loaded = select_optimizer_states(
      tree,
      [self.stage_optimizers[s] for s in owned],
      [opt_states[s] for s in owned],
    )
    for s, opt_state in zip(owned, loaded, strict=True):
      opt_states[s] = self.placement[s].put_replicated(opt_state)
    return self._state(
      stage_params, opt_states, int(tree["step"]), base.model_state
    )

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


def _granularity(traced, partition, num_stages, num_devices):
  """The trace cut at the automatic depth (see ``Pipeline``'s ``depth``)."""
  if isinstance(partition, partition_lib.Plan):
    for depth in range(1, traced.max_depth + 1):
      cut = traced.at_depth(depth)
      if cut.node_names == partition.node_names:
        why = f"depth {depth}: the depth the given Plan's nodes were cut at"
        return cut, partition_lib.Granularity(depth, cut.num_nodes, {}, why)
    raise ValueError(
      "the Plan was made for a different model: no depth of this model "
      "has its nodes"
    )
  stages = num_stages if partition == "mixed" else min(num_stages, num_devices)
  return partition_lib.choose_depth(traced, stages)


def _check_stage_count(num_stages, num_devices, partition) -> None:
  """One device per stage unless FTPipe's mixed pipe (or a given Plan,
  which names its devices) puts several stages on a device."""
  if num_stages < 1:
    raise ValueError(f"num_stages must be >= 1, got {num_stages}")
  if isinstance(partition, str) and partition != "mixed":
    if num_stages > num_devices:
      raise ValueError(
        f"{num_stages} stages need {num_stages} devices, got "
        f"{num_devices}: use at most {num_devices} stages, pass more "
        f"devices, or partition='mixed' (several stages per device)"
      )


def _make_plan(
  traced, params, micro, partition, num_stages, num_devices, **options
):
  """The Plan given (checked against the model and devices) or solved."""
  if isinstance(partition, partition_lib.Plan):
    plan = partition
  else:
    costs = partition_lib.profile_nodes(
      traced,
      params,
      micro,
      method=options["cost_model"],
      recompute=options["recompute"],
    )
    memory = options["memory"] or {}
    if partition == "mixed":  # Checked on the built pipeline instead.
      memory = {}
    elif partition != "contiguous":  # PipeDream's own stash model.
      memory = {"memory_limit": memory.get("memory_limit")}
    plan = partition_lib.plan_traced(
      traced,
      costs,
      min(num_stages, num_devices),
      method=partition,
      bandwidth=options["bandwidth"],
      **memory,
    )
  if plan.node_names != traced.node_names:
    raise ValueError("the Plan was made for a different model (nodes differ)")
  used = max(d for ds in plan.stage_devices for d in ds)
  if used >= num_devices:
    raise ValueError(
      f"the plan uses device {used} but only {num_devices} are given"
    )
  check_device_groups(plan.stage_devices)
  return plan


def _check_state_output(traced, state_treedef):
  """The loss must return ``(loss, new_state)`` shaped like the state."""
  want = jax.tree.structure(
    (0.0, jax.tree.unflatten(state_treedef, [0] * (state_treedef.num_leaves)))
  )
  if not traced.has_aux or traced.out_tree != want:
    raise ValueError(
      "with model_state=, loss_fn(params, model_state, batch) must return "
      "(loss, new_model_state) with new_model_state structured like "
      "model_state"
    )
