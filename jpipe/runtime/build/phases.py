"""Building a pipeline, phase by phase: each phase a function of what the
ones before it made, returning a frozen value.

0. ``check_request``: the options checked, the devices and sizes fixed.
1. ``cut_model``: trace the loss on one microbatch, cut at a depth.
2. ``partition_model``: the Plan (given or solved) and its Stages.
3. ``place_stages``: devices, replica groups, the cross-process transport.
4. ``schedule_calls``: the schedule (or stream) and its per-call actions.

``_assemble.build_pipeline`` runs them in order, then builds the
programs, the optimizers and the driver from their results.
"""

import dataclasses
import os
import sys
import warnings
from typing import Any

import jax

from jpipe import partition as partition_lib
from jpipe import schedule as schedule_lib
from jpipe.distributed import text_from_process_zero
from jpipe.runtime.build.auto_schedule import auto_plan, provisional_kind
from jpipe.runtime.build.batches import BatchSpec, batch_size
from jpipe.runtime.build.calls import CallActions
from jpipe.runtime.build.flat import own_buffer_bytes
from jpipe.runtime.build.grad_dtype import check_grad_accum_dtype
from jpipe.runtime.build.loss_outputs import (
  LossOutputs,
  check_argument_leaves,
  check_loss_arguments,
  loss_output_message,
  loss_outputs,
)
from jpipe.runtime.build.loss_scale import DynamicLossScale, check_loss_scale
from jpipe.runtime.build.memory import (
  partitioner_memory_model,
  resolve_memory_limit,
)
from jpipe.runtime.build.options import Staleness
from jpipe.runtime.build.partitioning import Partitioning
from jpipe.runtime.build.placement import (
  StagePlacement,
  check_device_groups,
  device_name,
  even_rows,
)
from jpipe.runtime.build.programs import compiler_options
from jpipe.runtime.build.state_rows import StateRows, rows_read_by_layer
from jpipe.runtime.build.transport import Transport


@dataclasses.dataclass(frozen=True)
class Request:
  """What the pipeline is asked to be, checked: what every phase reads.

  Attributes:
    optimizer, staleness, partitioning: as given.
    schedule_kind: the schedule (``jpipe.schedule.ScheduleKind``).
    schedule_name: its name.
    num_microbatches, microbatch_size: of the example batch.
    devices: the devices to use.
    memory_limit: bytes per device (``partitioning.memory_limit``
      resolved), or None.
    clip_global_norm: the largest global gradient norm a step applies
      (over every stage's gradient together), or None.
    grad_accum_dtype: the floating dtype gradients are summed in (None:
      the params' own; ``build/grad_dtype.py``).
    skip_nonfinite_steps: a step whose global gradient holds a NaN or
      an infinity leaves every stage's params and optimizer state as
      they were (synchronous schedules).
    loss_scale: the static loss scale S (each backward starts from the
      loss cotangent times S, each step's gradient is divided by S), a
      ``DynamicLossScale``, or None (``build/loss_scale.py``).
    auto_schedule: ``schedule="auto"`` was asked for: the schedule is
      chosen once the plan is solved (``build/auto_schedule.py``); until
      then ``schedule_kind`` is the one auto plans as (1f1b).
    schedule_choice: the ``jpipe.schedule.ScheduleChoice`` auto made (its
      table), or None.
    batch_spec: what every batch must be like (``build.batches.BatchSpec``:
      the example batch's fields, shapes and dtypes).
  """

  optimizer: Any
  staleness: Staleness
  partitioning: Partitioning
  schedule_kind: schedule_lib.ScheduleKind
  schedule_name: str
  num_microbatches: int
  microbatch_size: int
  devices: tuple[Any, ...]
  memory_limit: float | None
  clip_global_norm: float | None = None
  grad_accum_dtype: Any = None
  skip_nonfinite_steps: bool = False
  loss_scale: Any = None
  auto_schedule: bool = False
  schedule_choice: Any = None
  batch_spec: Any = None


def check_request(
  params,
  example_batch,
  optimizer,
  devices,
  schedule,
  num_microbatches: int,
  options: tuple[Staleness, Partitioning],
  clip_global_norm: float | None = None,
  grad_accum_dtype: Any = None,
  skip_nonfinite_steps: bool = False,
  loss_scale: Any = None,
) -> Request:
  """The options checked against each other and the devices, before any
  work (``devices`` None: all of them; ``options``: the staleness and
  partitioning values)."""
  staleness, partitioning = options
  if not (hasattr(optimizer, "init") and hasattr(optimizer, "update")):
    called = getattr(optimizer, "__name__", "")
    raise TypeError(
      "optimizer must be an optax GradientTransformation"
      + (
        f" (optax.{called}(...), called: {called} is its factory)"
        if called
        else ""
      )
      + f"; got {type(optimizer).__name__}"
    )
  auto = isinstance(schedule, str) and schedule == schedule_lib.AUTO
  devices = tuple(jax.devices() if devices is None else devices)
  kind = (
    provisional_kind(
      partitioning.num_stages, len(devices), partitioning.partition
    )
    if auto
    else schedule_lib.lookup(schedule)
  )
  try:
    staleness.check(kind, optimizer, params)
  except ValueError as e:
    if not auto:
      raise
    raise ValueError(
      f"schedule='auto' chooses among the synchronous schedules, which do "
      f"not take these options ({e}); name a schedule to use them"
    ) from None
  _check_step_options(kind, clip_global_norm, skip_nonfinite_steps)
  loss_scale = check_loss_scale(loss_scale)
  if isinstance(loss_scale, DynamicLossScale):
    if kind.asynchronous:
      raise ValueError(
        f"a dynamic loss_scale needs a synchronous schedule, not "
        f"{kind.name!r}: it skips a step whose gradient overflows, which a "
        "stream's stages cannot do together (give a number: a static scale)"
      )
    skip_nonfinite_steps = True  # (How an overflow is survived.)
  batch_spec = BatchSpec.of(example_batch)
  micro = _microbatch_size(example_batch, num_microbatches)
  try:
    check_stage_count(
      partitioning.num_stages, len(devices), partitioning.partition, kind
    )
  except ValueError as e:
    if len(devices) > 1 or devices[0].platform != "cpu":
      raise
    raise ValueError(  # A CPU user's usual fix: JAX's fake host devices.
      f"{e} (on CPU, XLA_FLAGS=--xla_force_host_platform_device_count=N "
      "set before jax is imported gives N devices)"
    ) from None
  limit = resolve_memory_limit(partitioning.memory_limit, devices)
  return Request(
    optimizer,
    staleness,
    partitioning,
    kind,
    kind.name,
    num_microbatches,
    micro,
    devices,
    limit,
    clip_global_norm,
    check_grad_accum_dtype(grad_accum_dtype),
    bool(skip_nonfinite_steps),
    loss_scale,
    auto_schedule=auto,
    batch_spec=batch_spec,
  )


def _check_step_options(kind, clip_global_norm, skip_nonfinite_steps):
  """What a step does to its gradient, checked against the schedule."""
  if clip_global_norm is not None and not clip_global_norm > 0:
    raise ValueError(
      f"clip_global_norm must be > 0 (or None: no clipping), got "
      f"{clip_global_norm}"
    )
  if skip_nonfinite_steps and kind.asynchronous:
    raise ValueError(
      f"skip_nonfinite_steps needs a synchronous schedule, not "
      f"{kind.name!r}: a stream's stages step apart, so one skipping while "
      "the others apply their gradients would train a mix (use gpipe, "
      "1f1b, ...)"
    )


@dataclasses.dataclass(frozen=True)
class ModelCut:
  """The loss traced on one microbatch and cut into nodes.

  Attributes:
    traced: the ``partition.TracedModel`` at the chosen depth.
    granularity: why that depth (None: the caller gave one).
    micro: the first microbatch (the model state appended, if any).
    num_batch_leaves: leaves of a microbatch (model state excluded).
    num_state_leaves: leaves of the model state (0: none).
    state_treedef: the model state's structure, or None.
    retrace: ``retrace(n)`` -> the loss traced on the first n examples of
      the microbatch, cut at the same depth (a weighted replica group's
      slices).
    loss_outputs: the structure of the loss's results (``LossOutputs``: the
      model state's and the aux outputs').
    state_rows: the model state's leaves stacked per layer of a scan split
      by layer, held as rows (``state_rows.StateRows``: the model's layout
      back); None: every leaf as the model declares it.
  """

  traced: Any
  granularity: Any
  micro: Any
  num_batch_leaves: int
  num_state_leaves: int
  state_treedef: Any
  retrace: Any = None
  loss_outputs: LossOutputs = LossOutputs()
  state_rows: StateRows | None = None


def cut_model(
  loss_fn,
  params,
  example_batch,
  model_state,
  request: Request,
  has_aux: bool = False,
  *,
  state_as_rows: bool = True,
) -> ModelCut:
  """Traces ``loss_fn`` on the first microbatch and cuts it at
  ``partitioning.depth`` (None: the automatic depth for the stage
  count). ``has_aux``: it returns aux outputs beside the loss
  (``build/loss_outputs.py``). ``state_as_rows``: a model-state leaf
  stacked per layer of a scan split by layer is held as rows
  (``state_rows``; False: ``model_state`` is that already)."""
  partitioning = request.partitioning
  depth = partitioning.depth
  size = request.microbatch_size
  micro = jax.tree.map(
    lambda x: partition_lib.keep_type(x, x[:size]), example_batch
  )
  num_batch_leaves = len(jax.tree.leaves(micro))
  check_loss_arguments(loss_fn, model_state)
  check_argument_leaves(params, model_state)
  model_loss = loss_fn
  if model_state is not None:
    loss_fn, micro = partition_lib.with_model_state(loss_fn, micro, model_state)
  traced_aux = has_aux or model_state is not None
  try:
    traced = partition_lib.trace(
      loss_fn, params, micro, depth=depth or 1, has_aux=traced_aux
    )
  except partition_lib.LossOutputError as e:
    message = loss_output_message(e.got, model_state, has_aux)
    raise ValueError(message) from None
  outputs = loss_outputs(traced.out_tree, model_state, has_aux)
  rows = None
  if state_as_rows:
    rows = _state_rows(traced, model_state, num_batch_leaves)
  if rows is not None:  # (Traced again, the stacked state as its rows.)
    cut = cut_model(
      rows.on_rows(model_loss, has_aux),
      params,
      example_batch,
      rows.to_rows(model_state),
      request,
      has_aux,
      state_as_rows=False,
    )
    return dataclasses.replace(cut, state_rows=rows)
  granularity = None  # An explicit depth.
  if depth is None:
    traced, granularity = _granularity(
      traced,
      partitioning.partition,
      partitioning.num_stages,
      len(request.devices),
      request.schedule_kind,
    )

  def retrace(n):
    rows = jax.tree.map(lambda x: partition_lib.keep_type(x, x[:n]), micro)
    return partition_lib.trace(
      loss_fn, params, rows, depth=traced.depth, has_aux=traced_aux
    )

  return ModelCut(
    traced,
    granularity,
    micro,
    num_batch_leaves,
    outputs.num_state_leaves,
    outputs.state_treedef,
    retrace,
    outputs,
  )


def _state_rows(traced, model_state, num_batch_leaves) -> StateRows | None:
  """The model state's rows where a leaf is stacked per layer of a scan
  split by layer (``state_rows``); None where none is."""
  if model_state is None:
    return None
  first = traced.num_param_leaves + num_batch_leaves
  num_state = len(jax.tree.leaves(model_state))
  rows = rows_read_by_layer(traced, range(first, first + num_state))
  return StateRows.of(model_state, rows) if rows else None


@dataclasses.dataclass(frozen=True)
class Partitioned:
  """The plan and the stage functions cut from the traced model."""

  plan: partition_lib.Plan
  stages: partition_lib.Stages
  stages_at: Any = None  # n -> the stages cut from ``ModelCut.retrace(n)``


def partition_model(cut: ModelCut, params, request: Request) -> Partitioned:
  """The Plan given or solved (agreed across processes), and the stages
  cut by it."""
  partitioning, staleness = request.partitioning, request.staleness
  partition, num_stages = partitioning.partition, partitioning.num_stages
  num_devices = len(request.devices)
  slots = request.schedule_kind.stage_devices(
    num_stages, num_devices if partition == "contiguous" else None
  )

  def plan_for(memory):
    return _make_plan(
      cut.traced,
      params,
      cut.micro,
      partition,
      num_stages,
      num_devices,
      bandwidth=partitioning.bandwidth,
      cost_model=partitioning.cost_model,
      recompute=staleness.recompute,
      price_last_stage=partitioning.fuse_last_stage
      and partitioning.price_last_stage,
      slots=slots,
      memory=memory,
      mixed_blocks=partitioning.mixed_blocks,
    )

  if request.auto_schedule:
    plan = auto_plan(
      plan_for, lambda kind: _memory_budget(request, params, kind)
    )
  else:
    # Where the schedule places the stages (zbv's V: several per device,
    # which the partitioner's per-device memory model does not know), the
    # memory is checked on the built pipeline instead.
    plan = plan_for(
      None if slots is not None else _memory_budget(request, params)
    )
  if jax.process_count() > 1 and not isinstance(partition, partition_lib.Plan):
    # A measured cost model may solve differently in each process.
    plan = partition_lib.Plan.from_json(text_from_process_zero(plan.to_json()))
  # Model-state leaf j is batch input num_batch_leaves + j and result
  # j + 1 (after the loss): carried from one microbatch to the next.
  first = cut.num_batch_leaves
  policy = jax.checkpoint_policies.dots_saveable
  if staleness.residuals_from_current_params(request.schedule_kind):
    # FTPipe's no-recompute semantics: the backward reads the current
    # params, so only saved values keep the forward's activations.
    policy = jax.checkpoint_policies.everything_saveable

  def stages_of(traced):
    return partition_lib.Stages(
      traced,
      plan.stage_of_node,
      residual_policy=policy,
      carried=[(first + j, j + 1) for j in range(cut.num_state_leaves)],
      compiler_options=program_options(request),
      residual_own_bytes=own_bytes(
        request, request.devices[0].platform, residuals=True
      ),
      hold_unread_params=True,
    )

  def stages_at(n):
    traced = cut.retrace(n)
    _check_same_structure(cut.traced, traced, request.microbatch_size, n)
    return stages_of(traced)

  stages = stages_of(cut.traced)
  _warn_stages_without_params(stages, first)
  return Partitioned(plan, stages, stages_at)


def _warn_stages_without_params(stages, num_batch_leaves: int) -> None:
  """Warns where a stage holds no params and no model state: it trains
  nothing, its device runs parameter-free work (a residual add, the
  loss) -- a model with fewer module calls holding params than stages."""
  idle = [
    s
    for s, spec in enumerate(stages.specs)
    if not spec.param_leaves
    and not any(i >= num_batch_leaves for i in spec.batch_leaves)
  ]
  if idle and len(stages.specs) > 1:
    warnings.warn(
      f"stage(s) {idle} of {len(stages.specs)} hold no params: they take "
      "a device for parameter-free work (the model has fewer module calls "
      "holding params than stages, at the depth it was cut); use fewer "
      "stages (Pipeline.granularity and .plan show the cut)",
      stacklevel=_outside_jpipe(),
    )


def _outside_jpipe() -> int:
  """The ``stacklevel`` of the first caller outside the jpipe package,
  where a warning is the user's to read (the builder's depth varies)."""
  package = os.path.dirname(os.path.dirname(os.path.dirname(__file__)))
  frame, level = sys._getframe(1), 1
  while frame is not None and frame.f_code.co_filename.startswith(
    package + os.sep
  ):
    frame, level = frame.f_back, level + 1
  return level


def _memory_budget(request: Request, params, kind=None):
  """The partitioner's ``MemoryBudget`` for the request's schedule (or
  ``kind``), optimizer and limit (None without a limit)."""
  if request.memory_limit is None:
    return None
  partitioning, staleness = request.partitioning, request.staleness
  return partitioner_memory_model(
    request.memory_limit,
    request.optimizer,
    params,
    kind or request.schedule_kind,
    request.num_microbatches,
    min(partitioning.num_stages, len(request.devices)),
    recompute=staleness.recompute,
    stashes=staleness.stashes,
    fused_last=partitioning.fuse_last_stage,
    grad_accum_dtype=request.grad_accum_dtype,
  )


def _check_same_structure(traced, other, n, rows) -> None:
  """The model traced on ``rows`` examples has the equations, in order,
  of its trace on ``n``: the plan's nodes cut it the same way."""
  same = (
    other.num_nodes == traced.num_nodes
    and [e.primitive for e in other.jaxpr.eqns]
    == [e.primitive for e in traced.jaxpr.eqns]
    and other.eqn_scopes == traced.eqn_scopes
  )
  if not same:
    raise ValueError(
      f"the model traces differently on {rows} examples than on {n}: a "
      "weighted replica group runs slices of each microbatch, which needs "
      "a model whose operations do not depend on the batch size; use "
      "replica_routing='split'"
    )


def own_bytes(request: Request, platform: str, residuals=False) -> float:
  """A pipeline's own-buffer size (gradient leaves; residuals with
  ``residuals``): its ``Partitioning.own_buffer_bytes``, else the
  platform's (``_flat.own_buffer_bytes``)."""
  chosen = request.partitioning.own_buffer_bytes
  if chosen is not None:
    return chosen
  return own_buffer_bytes(platform, residuals)


def program_options(request: Request) -> dict:
  """XLA options of the pipeline's per-action programs on its devices
  (``_programs.compiler_options``; command buffers by default for the
  synchronous schedules only, ``Partitioning.gpu_command_buffers``)."""
  command_buffers = request.partitioning.gpu_command_buffers
  if command_buffers is None:
    command_buffers = not request.schedule_kind.asynchronous
  return compiler_options(request.devices[0].platform, command_buffers)


@dataclasses.dataclass(frozen=True)
class Placed:
  """Where each stage runs.

  Attributes:
    placement: per stage, its devices (a replica group on several).
    stage_device: per stage, its first device.
    transport: moves values between processes (one process: a no-op).
    batch_leaves: per placement this process runs, the batch leaves its
      stages read.
    schedule_device: per stage, its device group's index in the schedule
      (groups numbered in the order of their first devices).
    device_names: per schedule device, "device 2" or "devices 0-1".
  """

  placement: tuple[StagePlacement, ...]
  stage_device: tuple[Any, ...]
  transport: Transport
  batch_leaves: dict
  schedule_device: tuple[int, ...]
  device_names: tuple[str, ...]


def place_stages(parts: Partitioned, cut: ModelCut, request: Request) -> Placed:
  """Each stage on its devices, and the transport between processes."""
  plan, stages, num_batch_leaves = (
    parts.plan,
    parts.stages,
    cut.num_batch_leaves,
  )
  routing = request.partitioning.replica_routing
  placement = tuple(
    StagePlacement(
      [request.devices[i] for i in ds],
      request.microbatch_size,
      round_robin=routing == "round_robin",
      rows=(
        even_rows(request.microbatch_size, len(ds))
        if routing == "weighted"
        else None
      ),
    )
    for ds in plan.stage_devices
  )
  mover = Transport(placement, request.partitioning.transport)
  mover.connect()
  # Model-state leaves, numbered after the batch leaves, are not split.
  batch_leaves = {}
  for s, (spec, place) in enumerate(zip(stages.specs, placement, strict=True)):
    if not mover.owns(s):
      continue
    wanted = batch_leaves.setdefault(place, [])
    wanted.extend(
      i for i in spec.batch_leaves if i < num_batch_leaves and i not in wanted
    )
  firsts = sorted({ds[0] for ds in plan.stage_devices})
  groups = {ds[0]: ds for ds in plan.stage_devices}
  return Placed(
    placement,
    tuple(p.device for p in placement),
    mover,
    batch_leaves,
    tuple(firsts.index(ds[0]) for ds in plan.stage_devices),
    tuple(device_name(groups[f]) for f in firsts),
  )


@dataclasses.dataclass(frozen=True)
class Scheduled:
  """The schedule: a stream (``async``, ``2bw``) or None, the per-call
  action lists, and the Stream or the synchronous Schedule of one call of
  the example's microbatches."""

  stream: schedule_lib.Stream | None
  calls: CallActions
  schedule: Any


def schedule_calls(stages, placed: Placed, request: Request) -> Scheduled:
  """The schedule of the pipeline's stages on their schedule devices."""
  n, kind = stages.num_stages, request.schedule_kind
  stream = (
    schedule_lib.Stream(
      kind.name,
      n,
      request.staleness.step_every,
      split_flush=request.staleness.split_flush,
      warmups=request.staleness.stream_warmups(
        n, len(set(placed.schedule_device))
      ),
      replicas=(
        tuple(len(p.devices) for p in placed.placement)
        if any(p.round_robin for p in placed.placement)
        else None
      ),
    )
    if kind.asynchronous
    else None
  )
  calls = CallActions(
    kind,
    stream,
    n,
    placed.schedule_device,
    output_free=tuple(not spec.outputs for spec in stages.specs),
    fuse=request.partitioning.fuse_last_stage,
    fuse_steps=request.partitioning.fuse_step,
  )
  first = stream or calls.synchronous(request.num_microbatches)
  return Scheduled(stream, calls, first)


def _granularity(traced, partition, num_stages, num_devices, kind):
  """The trace cut at the automatic depth (see ``Pipeline``'s ``depth``)."""
  if isinstance(partition, partition_lib.Split):
    return partition.depth_of(traced)
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
  several = partition == "mixed" or kind.placement is not None or kind.loops
  stages = num_stages if several else min(num_stages, num_devices)
  return partition_lib.choose_depth(traced, stages)


def check_stage_count(num_stages, num_devices, partition, kind) -> None:
  """One device per stage unless FTPipe's mixed pipe, a schedule that
  places its stages (``zbv``: two per device in a V; ``interleaved``:
  stage s on device s mod p) or a given Plan
  (which names its devices) puts several stages on a device."""
  if num_stages < 1:
    raise ValueError(f"num_stages must be >= 1, got {num_stages}")
  if isinstance(partition, partition_lib.Split):
    if kind.placement is not None:
      raise ValueError(
        f"schedule {kind.name!r} places its stages itself (2 per device): "
        f"give it num_stages, not a Split"
      )
    if partition.num_devices > num_devices:
      raise ValueError(
        f"the split {partition.describe()} needs {partition.num_devices} "
        f"devices, got {num_devices}: use fewer replicas or stages, or "
        f"pass more devices"
      )
    return
  if kind.placement is not None and isinstance(partition, str):
    wrong = []  # (Only what is wrong: naming a right value confuses.)
    if num_stages % 2:
      wrong.append(f"an even num_stages (got {num_stages})")
    if partition != "contiguous":
      wrong.append(f"partition 'contiguous' (got {partition!r})")
    if wrong:
      raise ValueError(
        f"schedule {kind.name!r} places 2 stages per device in a V: use "
        + " and ".join(wrong)
      )
    if num_stages // 2 > num_devices:
      raise ValueError(
        f"schedule {kind.name!r}: {num_stages} stages need "
        f"{num_stages // 2} devices (2 per device), got {num_devices}: "
        f"use at most {2 * num_devices} stages"
      )
    return
  if kind.loops and partition == "contiguous" and num_stages > num_devices:
    kind.stage_devices(num_stages, num_devices)  # Uneven: one line.
    return
  if (
    kind.loops
    and isinstance(partition, str)
    and partition != "mixed"
    and num_stages <= num_devices
  ):
    # One stage a device, a loop runs another schedule's order than the
    # one asked for: interleaved 1F1B's is 1F1B's, looped BFS's GPipe's.
    used = min(num_stages, num_devices)
    raise ValueError(
      f"schedule {kind.name!r} loops stages over devices (stage s on "
      f"device s mod p), but {num_stages} stages on {num_devices} devices "
      f"hold one a device, which runs {kind.unlooped!r}'s order: use more "
      f"stages than devices, a multiple of them (e.g. num_stages="
      f"{2 * used} on {used} devices), or schedule={kind.unlooped!r}"
    )
  if isinstance(partition, str) and partition != "mixed":
    if num_stages > num_devices:
      raise ValueError(
        f"{num_stages} stages need {num_stages} devices, got "
        f"{num_devices}: use at most {num_devices} stages, pass more "
        f"devices, partition='mixed' (several stages per device), or a "
        f"loop schedule ('interleaved', 'interleaved_zb', 'looped_bfs': "
        f"a multiple of the devices, stage s on device s mod p)"
      )


def _make_plan(
  traced, params, micro, partition, num_stages, num_devices, **options
):
  """The Plan given (checked against the model and devices) or solved."""
  if isinstance(partition, partition_lib.Plan):
    plan = partition
  elif isinstance(partition, partition_lib.Split):
    plan = partition.plan(
      traced,
      partition_lib.profile_nodes(
        traced,
        params,
        micro,
        method=options["cost_model"],
        recompute=options["recompute"],
      ),
    )
  else:
    costs = partition_lib.profile_nodes(
      traced,
      params,
      micro,
      method=options["cost_model"],
      recompute=options["recompute"],
    )
    last_stage_costs = None
    if options["recompute"] and options["price_last_stage"]:
      # FTPipe's async meta-algorithm: the fused last stage never
      # recomputes, so its nodes are priced without it.
      last_stage_costs = partition_lib.profile_nodes(
        traced, params, micro, method=options["cost_model"], recompute=False
      )
    slots = options["slots"]  # A contiguous stage per slot, on its device.
    plan = partition_lib.plan_traced(
      traced,
      costs,
      min(num_stages, num_devices) if slots is None else len(slots),
      method=partition,
      bandwidth=options["bandwidth"],
      devices=slots,
      last_stage_costs=last_stage_costs,
      memory=options["memory"],
      mixed_blocks=options["mixed_blocks"],
    )
  if plan.node_names != traced.node_names:
    raise ValueError("the Plan was made for a different model (nodes differ)")
  check_plan_stages(plan)
  used = max(d for ds in plan.stage_devices for d in ds)
  if used >= num_devices:
    raise ValueError(
      f"the plan uses device {used} but only {num_devices} are given"
    )
  check_device_groups(plan.stage_devices)
  return plan


def check_plan_stages(plan: partition_lib.Plan) -> None:
  """A Plan's per-stage fields describe the stages its nodes are cut
  into (``stage_of_node``: stages 0..k-1), and every stage has a device:
  otherwise a one-line error naming the field (a Plan edited by hand, or
  ``dataclasses.replace``'d with another pipeline's devices)."""
  stages = max(plan.stage_of_node, default=-1) + 1
  per_stage = {
    "stage_devices": plan.stage_devices,
    "stage_forward_seconds": plan.stage_forward_seconds,
    "stage_backward_seconds": plan.stage_backward_seconds,
  }
  for field, values in per_stage.items():
    if len(values) != stages:
      raise ValueError(
        f"the Plan cuts its nodes into {stages} stages (stage_of_node) but "
        f"its {field} has {len(values)} entries: give one per stage"
      )
  for s, devices in enumerate(plan.stage_devices):
    if not devices:
      raise ValueError(f"the Plan's stage {s} has no device (stage_devices)")


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
