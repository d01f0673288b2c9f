"""The pipeline facade: options in, then init / step / flush / gather.

``Pipeline`` traces the loss on one microbatch, partitions it (or takes a
Plan), builds jitted stage functions, places each stage's parameters and
optimizer state on its device(s) (``_assemble.py``: the construction, one
frozen value of parts) and runs a schedule's actions through the driver
(``_step.py``, ``execute/driver.py``); the state in and out is
``_pipeline_state.py``'s. JAX dispatches asynchronously, so devices work
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
version policy's table (``build/versions.py``); tied parameters are
``build/tied.py``'s; a stage on several devices is a replica group
(``build/placement.py``: data parallel, same math).

The last stage (no other stage reads its values) runs each microbatch's
forward and backward as one program wherever that gives the same result
(``fuse_last_stage``): its backward needs nothing but its own forward.
"""

import inspect
from collections.abc import Callable, Sequence
from typing import Any

import jax
import optax

from jpipe import schedule as schedule_lib
from jpipe.runtime import _step
from jpipe.runtime._assemble import (
  build_pipeline,
  options_from_keywords,
)
from jpipe.runtime._frozen_params import FrozenParams
from jpipe.runtime._pipeline_inference import PipelineInferenceMethods
from jpipe.runtime._pipeline_memory import PipelineMemoryMethods
from jpipe.runtime._pipeline_state import PipelineState
from jpipe.runtime._pipeline_state_methods import PipelineStateMethods
from jpipe.runtime.build.loss_scale import DynamicLossScale
from jpipe.runtime.build.options import Staleness
from jpipe.runtime.build.partitioning import Partitioning
from jpipe.runtime.build.phases import check_request
from jpipe.runtime.build.pipeline_memory import (
  check_memory_limit,
)
from jpipe.runtime.build.user_mesh import every_process, outside_user_mesh
from jpipe.runtime.execute.hooks import DriverHooks


def _part(phase: str, name: str) -> property:
  """A read-only attribute: field ``name`` of the construction phase
  ``phase`` of ``Pipeline.parts``."""
  return property(
    lambda self: getattr(getattr(self.parts, phase), name),
    doc=f"``{name}`` of the pipeline's {phase} phase (``Pipeline.parts``).",
  )


@outside_user_mesh  # (A caller's jax.set_mesh: build/user_mesh.py.)
class Pipeline(
  PipelineStateMethods, PipelineInferenceMethods, PipelineMemoryMethods
):
  """A model split into pipeline stages, trained by a schedule.

  Args:
    loss_fn: ``loss_fn(params, batch) -> scalar`` (mean over the batch).
      A step's gradient is that of the mean of its microbatches' losses:
      each backward starts from the cotangent 1 / num_microbatches (as
      Megatron-LM divides the loss), so a ``custom_vjp`` whose backward
      is not linear in its cotangent (clipping each layer's gradient)
      sees it scaled; ``async`` / ``2bw`` start from 1 / step_every.
    params: example params (their structure is kept).
    example_batch: a full mini-batch; its leading axis is split into
      ``num_microbatches`` microbatches.
    optimizer: an optax transformation, applied per stage.
    devices: the devices to use; default ``jax.devices()``.
    schedule: a name from ``jpipe.schedule.SCHEDULES`` or its
      ``jpipe.schedule.ScheduleKind`` (``jpipe.schedule.REGISTRY``), or
      "auto": the synchronous schedule the solved plan runs fastest in
      the event simulator within ``memory_limit`` (planned as for 1f1b;
      ``schedule_choice`` holds the table; ``build/auto_schedule.py``).
    num_microbatches: microbatches per ``step`` call of the example batch
      (it fixes the microbatch size; a call may pass a batch of another
      multiple of it).
    model_state: non-trained model state (e.g. BatchNorm statistics). With
      it, ``loss_fn(params, model_state, batch) -> (loss, new_model_state)``;
      each stage feeds its forwards the state its previous forward left
      (microbatches in order, as one device would) and the recomputing
      backward sees the same state as its forward.
    frozen: regular expressions (a list, or one comma-separated string)
      finding the ``"a/b/c"`` paths of params that do not train (e.g.
      ``"wte/"``): held inside as model state, so no stage computes,
      sends or steps their gradients and none keeps optimizer state for
      them (``jpipe.frozen_loss``); every method still takes and gives
      the whole params (``init``, ``gather_params``, ``state_dict``, the
      functions given to ``evaluate``, ``predict`` and ``generate``).
      ``nonfinite_params`` and ``param_norms`` look at the trained ones.
    has_aux: ``loss_fn`` returns ``(loss, aux)`` (with model state
      ``(loss, (new_model_state, aux))``), ``aux`` a pytree of arrays
      beside the loss (an accuracy, a count), as ``jax.value_and_grad``'s
      ``has_aux``: each ``step``'s ``metrics["aux"]`` is its leaves' means
      over the microbatches whose forward ran in the call (as its
      "loss"), each computed on the stage that makes it and shared with
      every process. Not differentiated.
    record_params: report, in each call's ``metrics["used_params"]``,
      the params every forward and backward used, keyed by ``(kind,
      stage, microbatch)`` (tests and debugging; holds every version
      alive).
    clip_global_norm: clip the gradient to this global L2 norm, taken
      over every stage's gradient together, before the optimizer: each
      step equals ``optax.chain(optax.clip_by_global_norm(c), optimizer)``
      on one device (synchronous schedules; the replicas of a tied leaf
      count once; the norm in float32, where optax takes it in the
      leaves' dtype: half-precision steps differ in its last bits, and a
      float16 sum of squares that overflows is clipped, not zeroed). Streaming schedules (``async``, ``2bw``) have no
      step all stages share: a stage's step clips with the norm of its
      own gradient and the latest step's gradient of every other stage
      (one process only). None: no clipping.
    grad_accum_dtype: the floating dtype a step's microbatch gradients
      are summed in, and the optimizer receives them in (DeepSpeed's
      ``grad_accum_dtype``): e.g. ``"float32"`` for bfloat16 params, whose
      own 8-bit mantissa drops a small microbatch gradient beside a large
      sum. Each backward still computes in the params' dtype; tied
      leaves' and replicas' gradients travel in this dtype; optimizer
      state that follows the gradient's dtype (SGD's momentum, optax
      Adam's first moment unless ``mu_dtype`` fixes it) is kept in the
      dtype a step gives it on one device. None: the params' own dtypes.
    skip_nonfinite_steps: a step whose gradient (over every stage, as
      global-norm clipping sees it) holds a NaN or an infinity changes
      nothing: every stage keeps its params and optimizer state, as
      ``optax.apply_if_finite`` would on one device (which a pipeline
      refuses: its check spans stages), and ``metrics["step_skipped"]``
      says so (a device bool), e.g. for float16 dynamic loss scaling.
      Synchronous schedules only.
    loss_scale: loss scaling for float16 activations, whose small
      cotangents underflow to zero. A number S (static, any schedule):
      each backward starts from the loss cotangent times S (so every
      activation cotangent passed between stages is S times larger) and
      each step divides its gradient by S before clipping and the
      optimizer, as static loss scaling on one device (the norm clipped
      is the unscaled gradient's). A power of two scales exactly: a
      float32 model's steps are bitwise those without it. Too large a
      scale overflows to inf (``skip_nonfinite_steps`` skips such a
      step). ``"dynamic"`` or a ``jpipe.runtime.DynamicLossScale``
      (synchronous schedules): the scale is halved at each step whose
      gradient overflows (the step skipped, as with
      ``skip_nonfinite_steps``, which it implies) and doubled after a
      run of finite steps; its state is the ``PipelineState``'s
      ``loss_scale``, saved in the state dict, and each step's
      ``metrics["loss_scale"]`` is the scale it used. Each step then
      reads its skip flag on the host, waiting for the step to end, as
      Megatron's scaler does. None: no scaling.
    hooks: a ``jpipe.runtime.DriverHooks`` called around this pipeline's
      actions, for the stages this process runs (before each forward or
      backward, on each gradient before its step, on each stage's params
      after it): what a layer above adds, e.g. data-parallel replica
      sync and simulated delays (``jpipe.parallel``) or injected
      slowdowns (``jpipe.dynamic``). None: no hooks.
    staleness: the staleness options (weight stashing, prediction,
      Gap-Aware, ``step_every``, recompute) as one ``jpipe.runtime.
      Staleness`` value (``self.staleness``); default: none of them, and
      backwards recompute their forward.
    partitioning: the split and placement options (the stage count, the
      partition method or Plan, depth, bandwidth, cost model, the last
      stage's fusion, the transport, the memory limit) as one
      ``jpipe.runtime.Partitioning`` value (``self.partitioning``).
    **options: the same options by name, as ``Staleness`` and
      ``Partitioning`` name them (where each is documented): e.g.
      ``num_stages=4, partition="pipedream", schedule="async",
      weight_stashing=True``. ``num_stages`` is required unless
      ``partitioning`` is given; giving a value and any of its options
      by name at once is refused.
  """

  # The construction phases' values (``self.parts``, a ``PipelineParts``),
  # each field read-only under its own name.
  optimizer = _part("request", "optimizer")
  staleness = _part("request", "staleness")
  partitioning = _part("request", "partitioning")
  schedule_kind = _part("request", "schedule_kind")
  schedule_name = _part("request", "schedule_name")
  # schedule="auto": asked for, and the ranked table it chose from (else
  # False and None).
  auto_schedule = _part("request", "auto_schedule")
  schedule_choice = _part("request", "schedule_choice")
  num_microbatches = _part("request", "num_microbatches")
  microbatch_size = _part("request", "microbatch_size")
  batch_spec = _part("request", "batch_spec")
  devices = _part("request", "devices")
  memory_limit = _part("request", "memory_limit")
  clip_global_norm = _part("request", "clip_global_norm")
  grad_accum_dtype = _part("request", "grad_accum_dtype")
  skip_nonfinite_steps = _part("request", "skip_nonfinite_steps")
  loss_scale = _part("request", "loss_scale")
  traced = _part("cut", "traced")
  granularity = _part("cut", "granularity")
  num_batch_leaves = _part("cut", "num_batch_leaves")
  state_treedef = _part("cut", "state_treedef")
  state_rows = _part("cut", "state_rows")
  loss_outputs = _part("cut", "loss_outputs")
  retrace = _part("cut", "retrace")
  plan = _part("partitioned", "plan")
  stages = _part("partitioned", "stages")
  stages_at = _part("partitioned", "stages_at")
  placement = _part("placed", "placement")
  stage_device = _part("placed", "stage_device")
  transport = _part("placed", "transport")
  batch_leaves = _part("placed", "batch_leaves")
  schedule_device = _part("placed", "schedule_device")
  device_names = _part("placed", "device_names")
  stream = _part("scheduled", "stream")
  calls = _part("scheduled", "calls")
  schedule = _part("scheduled", "schedule")
  programs = _part("runtime", "programs")
  tied = _part("runtime", "tied")
  params_treedef = _part("runtime", "params_treedef")
  leaf_names = _part("runtime", "leaf_names")
  stage_optimizers = _part("runtime", "stage_optimizers")
  policy = _part("runtime", "policy")
  driver = _part("runtime", "driver")

  def __init__(
    self,
    loss_fn: Callable[..., jax.Array],
    params: Any,
    example_batch: Any,
    *,
    optimizer: optax.GradientTransformation,
    devices: Sequence[Any] | None = None,
    schedule: "str | schedule_lib.ScheduleKind" = "gpipe",
    num_microbatches: int = 1,
    model_state: Any = None,
    frozen: str | Sequence[str] | None = None,
    has_aux: bool = False,
    record_params: bool = False,
    clip_global_norm: float | None = None,
    grad_accum_dtype: Any = None,
    skip_nonfinite_steps: bool = False,
    loss_scale: "float | str | DynamicLossScale | None" = None,
    hooks: DriverHooks | None = None,
    staleness: Staleness | None = None,
    partitioning: Partitioning | None = None,
    **options: Any,
  ):
    options = options_from_keywords(
      staleness, partitioning, options, own=_OWN_ARGUMENTS
    )
    self.frozen_params = None
    if frozen:  # (Held as model state inside: _frozen_params.py.)
      self.frozen_params = FrozenParams(
        loss_fn, params, frozen, model_state, has_aux
      )
      inside = self.frozen_params.inner
      loss_fn, params = inside.loss_fn, inside.params
      model_state = inside.model_state
    request = check_request(
      params,
      example_batch,
      optimizer,
      devices,
      schedule,
      num_microbatches,
      options,
      clip_global_norm,
      grad_accum_dtype,
      skip_nonfinite_steps,
      loss_scale,
    )
    parts = build_pipeline(
      loss_fn,
      params,
      example_batch,
      request,
      model_state=model_state,
      has_aux=has_aux,
      record_params=record_params,
      hooks=hooks,
    )
    self.parts = parts  # Read through by the properties above.
    self._memory = None
    # (function, batch structure, per-example shapes) -> ForwardProgram.
    self.forward_programs = {}
    if self.memory_limit is not None:
      if self.auto_schedule:
        self._fit_auto_schedule()
      check_memory_limit(self, self.memory_limit)

  @property
  def reads_batch(self) -> bool:
    """Whether this process's stages read any batch leaf (inputs,
    labels). Across processes, one that reads none may pass ``step`` the
    batch's shapes (``jax.ShapeDtypeStruct`` leaves) instead of its data:
    only its size is used there."""
    return any(self.batch_leaves.values())

  # -- Weighted replica groups ---------------------------------------------

  @property
  def replica_rows(self) -> dict[int, tuple[int, ...]]:
    """``{stage: examples of a microbatch per replica}`` of its weighted
    replica groups (``replica_routing="weighted"``)."""
    return {s: p.rows for s, p in enumerate(self.placement) if p.weighted}

  def set_replica_rows(self, stage: int, rows) -> None:
    """Replica j of weighted group ``stage`` takes ``rows[j]`` examples of
    each microbatch from the next forward on (a microbatch in flight
    finishes with the split it started with). Each new slice size traces
    the model on that many examples once (and compiles the stage's
    programs for it at its first run)."""
    place = self.placement[stage]
    if not place.weighted:
      raise ValueError(
        f"stage {stage} is not a weighted replica group (its routing is "
        "set by replica_routing='weighted' on a plan with replicas)"
      )
    old = place.rows
    place.set_rows(rows)
    try:  # Traced now: a model that changes with the size fails here.
      self.programs.weighted[stage].prepare()
    except ValueError:
      place.set_rows(old)
      raise
    self._memory = None  # The busiest replica's share changed.

  # -- Action lists of a call ----------------------------------------------

  def call_actions(
    self, state: PipelineState, num_microbatches: int | None
  ) -> schedule_lib.ActionLists:
    """The action lists the next ``step`` with ``num_microbatches`` (None:
    the next ``flush``) would run from ``state``, per schedule device."""
    fed = state.in_flight.fed if state.in_flight else 0
    return self.calls(fed, num_microbatches).lists

  # -- Calls -----------------------------------------------------------------

  @every_process
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
      and "param_bytes", the most bytes of distinct param arrays; with
      ``skip_nonfinite_steps``, "step_skipped" (a device bool);
      with ``profile=True`` "timeline", when every action of the call ran
      on its device (a ``jpipe.schedule.Timeline``; export with
      ``write_chrome_trace`` / ``plot_timeline``; the call runs the same
      compiled programs as any other; across processes it holds this
      process's actions, on its own clock); with ``record_params``
      "used_params".
    """
    return _step.step(self, state, batch, profile)

  @every_process
  def flush(self, state: PipelineState, *, profile: bool = False):
    """Drains an asynchronous pipeline: every pending backward and step
    runs (a partial ``step_every`` window steps on its mean). The next
    ``step`` starts a new stream with a new warm-up. A no-op for
    synchronous schedules (they flush every call).

    Returns:
      (state, metrics) as ``step``, without "loss" (no forward runs).
    """
    return _step.flush(self, state, profile)


# Pipeline's own arguments: a misspelled option's nearest name may be one.
_OWN_ARGUMENTS = tuple(inspect.signature(Pipeline.__init__).parameters)[1:-1]
