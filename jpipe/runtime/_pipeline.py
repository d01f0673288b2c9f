"""The pipeline driver: stages on devices, run by a schedule.

``Pipeline`` traces the loss on one microbatch, partitions it (or takes a
Plan), builds jitted stage functions, places each stage's parameters and
optimizer state on its device, and runs a schedule's actions in an order
that respects every device's action list. JAX dispatches asynchronously, so
devices work concurrently; the host blocks only when reading metrics.

Synchronous schedules (seq, gpipe, 1f1b, interleaved) give exactly
single-device gradient accumulation over the microbatches. Parameters read
by several stages (tied embeddings) are replicated; their gradient is
summed over the stages and every replica takes the same step.

A stage the Plan puts on several devices is a replica group (PipeDream's
hybrid data parallelism, ``_placement.py``): its programs run SPMD over the
group, each microbatch split among the replicas, params replicated and
their gradient summed by XLA. It changes where a stage runs, not what any
action computes: every property above and below holds unchanged.

The last stage (no other stage reads its values) runs each microbatch's
forward and backward as one program wherever that gives the same result
(``fuse_last_stage``): its backward needs nothing but its own forward.

Asynchronous schedules follow PipeDream/FTPipe (``design.md``): in
``async`` each stage steps after every ``step_every`` of its backwards, so
stage s of n runs microbatch b's forward ``n - 1 - s`` steps before the
step that applies its gradient (the delay ramps up from 0 after the start
of each ``step`` call, which ends with a drain -- FTPipe flushes once per
epoch, so give one call many microbatches). Which params each action uses:

=====================  ===========================  =========================
                       forward of microbatch b      backward (recompute)
=====================  ===========================  =========================
stale (no mitigation)  current params               current params
weight stashing (ws)   current params               the forward's params
prediction (wp)        predict(current, state, d)   current params
ws + wp                predict(current, state, d)   the forward's (predicted)
ga_jfl                 as above                     current params
=====================  ===========================  =========================

Without recomputation the backward always differentiates at the forward's
params (its saved residuals pin them). A parameter read by several stages
(a tied embedding) belongs to the first of them: later stages use, for
microbatch b, the value the owner's forward of b used (as if it travelled
with the activations) and add their gradient to the owner's step. Gap-Aware divides the gradient by
``1 + |params - forward params| / C`` at the step (``jpipe.staleness``).
``2bw`` runs every microbatch of minibatch t at W(t-1): W(t+1) = W(t) -
lr * grad f(W(t-1)).
"""

import functools
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jpipe import partition as partition_lib
from jpipe import schedule as schedule_lib
from jpipe import staleness
from jpipe.runtime._flat import FlatLayout
from jpipe.runtime._options import GAP_AWARE_POLICIES, check_staleness_options
from jpipe.runtime._placement import StagePlacement
from jpipe.runtime._profiler import ActionProfiler
from jpipe.runtime._stage_optimizer import StageOptimizer, leaf_names
from jpipe.runtime._state_dict import (
  merge_keyed,
  restore_structure,
  select_keyed,
)

SYNCHRONOUS = ("seq", "gpipe", "1f1b", "interleaved")
ASYNCHRONOUS = ("async", "2bw")


class PipelineState(NamedTuple):
  """Per-stage parameter leaves and optimizer states, on their devices.

  An optimizer state is keyed by the leaves' global paths (see
  ``Pipeline.state_dict``); on a Gap-Aware stage it is Gap-Aware's state
  around the optimizer's.
  """

  stage_params: tuple[tuple[jax.Array, ...], ...]
  opt_states: tuple[Any, ...]
  step: int
  # Leaves of the model state (BatchNorm statistics), when there is one.
  model_state: tuple[jax.Array, ...] = ()


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
    num_microbatches: microbatches per ``step`` call.
    optimizer: an optax transformation, applied per stage.
    partition: "contiguous", "mixed", "pipedream", "pipedream_hybrid"
      (see ``jpipe.partition.plan_traced``), or a jpipe.partition.Plan. A Plan
      may put a stage on several devices (``stage_devices[s]`` =
      ``(0, 1)``): the stage then runs data parallel over them, each
      microbatch split among the replicas (it must divide evenly), with
      the same results as on one device. Stages share all their devices
      or none.
    depth: module-path depth of the traced nodes.
    bandwidth: bytes/s between devices, for the partitioner (None: plan on
      compute alone; "pipedream" / "pipedream_hybrid" then assume 1e9 for
      the all-reduce of replicated stages).
    cost_model: how the partitioner costs nodes (see
      ``jpipe.partition.profile_nodes``): "analytic" (FLOPs from the jaxpr;
      default, no compilation), "xla" (XLA's cost analysis) or "measured"
      (each node compiled and timed on the default device: slower to
      start, right where FLOPs mislead, e.g. small or memory-bound ops).
    recompute: backward recomputes the forward (True) or keeps residuals.
    step_every: ``async``: a stage steps after every ``step_every``
      backwards, on their mean gradient (and after the last, partial
      window); ``2bw``: microbatches per minibatch (>= num_stages).
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
    record_params: keep, for the last ``step`` call, the params every
      forward and backward used in ``used_params[(kind, stage, mb)]``
      (tests and debugging; holds every version alive).
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
    depth: int = 1,
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
  ):
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
      num_microbatches=num_microbatches,
    )
    if num_microbatches < 1:
      raise ValueError(f"num_microbatches must be >= 1, got {num_microbatches}")
    batch_size = _batch_size(example_batch)
    if batch_size % num_microbatches:
      raise ValueError(
        f"{num_microbatches} microbatches do not divide the batch of "
        f"{batch_size}: use a divisor of {batch_size}"
      )
    devices = list(jax.devices() if devices is None else devices)
    self.num_microbatches = num_microbatches
    self.recompute = recompute
    self.optimizer = optimizer
    self.asynchronous = schedule in ASYNCHRONOUS
    self.weight_stashing = weight_stashing
    self.prediction = prediction
    self.gap_aware = gap_aware
    self.record_params = record_params
    self.used_params: dict[tuple[str, int, int], tuple] = {}
    micro = jax.tree.map(
      lambda x: x[: batch_size // num_microbatches], example_batch
    )
    self._num_batch_leaves = len(jax.tree.leaves(micro))
    self._state_treedef = None
    if model_state is not None:
      self._state_treedef = jax.tree.structure(model_state)
      loss_fn, micro = partition_lib.with_model_state(
        loss_fn, micro, model_state
      )
    self.traced = partition_lib.trace(
      loss_fn, params, micro, depth=depth, has_aux=model_state is not None
    )
    if model_state is not None:
      _check_state_output(self.traced, self._state_treedef)
    if isinstance(partition, partition_lib.Plan):
      plan = partition
    else:
      if num_stages > len(devices) and partition != "mixed":
        raise ValueError(
          f"{num_stages} stages need {num_stages} devices, got "
          f"{len(devices)}: pass more devices or partition='mixed'"
        )
      costs = partition_lib.profile_nodes(
        self.traced, params, micro, method=cost_model, recompute=recompute
      )
      plan = partition_lib.plan_traced(
        self.traced,
        costs,
        min(num_stages, len(devices)),
        method=partition,
        bandwidth=bandwidth,
      )
    self.plan = plan
    if plan.node_names != self.traced.node_names:
      raise ValueError("the Plan was made for a different model (nodes differ)")
    self.stages = partition_lib.Stages(self.traced, plan.stage_of_node)
    n = self.stages.num_stages
    used = max(d for ds in plan.stage_devices for d in ds)
    if used >= len(devices):
      raise ValueError(
        f"the plan uses device {used} but only {len(devices)} are given"
      )
    _check_device_groups(plan.stage_devices)
    # A stage on several devices is a replica group (see _placement.py).
    self.placement = tuple(
      StagePlacement([devices[i] for i in ds], batch_size // num_microbatches)
      for ds in plan.stage_devices
    )
    self.stage_device = tuple(p.device for p in self.placement)
    # Which batch leaves each placement's stages read (model-state leaves,
    # numbered after the batch leaves, are not split).
    self._batch_leaves_of_placement: dict[StagePlacement, list[int]] = {}
    for spec, place in zip(self.stages.specs, self.placement, strict=True):
      wanted = self._batch_leaves_of_placement.setdefault(place, [])
      wanted.extend(
        i
        for i in spec.batch_leaves
        if i < self._num_batch_leaves and i not in wanted
      )
    # The schedule's devices: one per device group, numbered in the order
    # of the groups' first devices.
    firsts = sorted({ds[0] for ds in plan.stage_devices})
    physical = [firsts.index(ds[0]) for ds in plan.stage_devices]
    # Their labels in timelines: "device 2", "devices 0-1" (a group).
    groups = {ds[0]: ds for ds in plan.stage_devices}
    self.device_names = tuple(_device_name(groups[f]) for f in firsts)
    if schedule == "interleaved":
      self.schedule = schedule_lib.interleaved(physical, num_microbatches)
    else:
      kwargs = {}
      if schedule == "async":
        kwargs["step_every"] = step_every
      elif schedule == "2bw":
        kwargs["minibatch"] = step_every
      self.schedule = _place(
        schedule_lib.build(schedule, n, num_microbatches, **kwargs), physical
      )
    self._order = _issue_order(self.schedule)
    self.fused_pairs = (
      _fusable_pairs(self.schedule, self.stages.specs)
      if fuse_last_stage
      else frozenset()
    )
    self._shared = _shared_leaves(self.stages)
    self._leaf_names = leaf_names(params)
    # Asynchronous: a tied leaf belongs to the first stage that reads it
    # (the owner); later stages hold replicas that never step.
    self._replicas = {}  # stage -> [(position, leaf, owner, owner position)]
    self._owned_tied = {}  # owner -> [(position, leaf)]
    if self.asynchronous:
      for leaf, holders in self._shared.items():
        (owner, owner_pos), *others = holders
        self._owned_tied.setdefault(owner, []).append((owner_pos, leaf))
        for h, pos in others:
          self._replicas.setdefault(h, []).append((pos, leaf, owner, owner_pos))
    self._producer = {
      v: s for s, spec in enumerate(self.stages.specs) for v in spec.outputs
    }
    self._params_treedef = jax.tree.structure(params)
    # The loss cotangent of every microbatch: 1 / (microbatches its step
    # averages over).
    groups = self.schedule.step_groups[n - 1]
    if not self.asynchronous:
      groups = (tuple(range(num_microbatches)),)
    self._loss_scale = np.zeros(num_microbatches)
    for group in groups:
      self._loss_scale[list(group)] = 1.0 / len(group)
    self._keep_forward_params = (
      not recompute
      or weight_stashing
      or gap_aware is not None
      or self.schedule.backward_uses_stash
      or record_params
    )
    if prediction is not None and predictor is None:
      predictor = staleness.replay_predictor(optimizer)
    # Gradient accumulators are one flat buffer per dtype (host cost per
    # call grows with its leaves, see _flat.py), unpacked inside the
    # optimizer step -- or before it, on stages that exchange tied grads.
    param_avals = self.traced.closed_jaxpr.in_avals
    self._grad_layout = tuple(
      FlatLayout([param_avals[i] for i in spec.param_leaves])
      for spec in self.stages.specs
    )
    self._tied_stages = frozenset(
      s for holders in self._shared.values() for s, _ in holders
    )
    self.stage_optimizers = tuple(
      self._stage_optimizer(
        s,
        predictor if prediction is not None else None,
        learning_rate_schedule,
        gap_aware_options if gap_aware is not None else None,
        gap_aware_policy,
      )
      for s in range(n)
    )
    # Jitted backwards, fused forward + backwards, gradient unpacking.
    self._backward_fns: dict[tuple, Any] = {}
    self._sync_step = {
      a.stage: a
      for acts in self.schedule.device_actions
      for a in acts
      if a.kind == schedule_lib.STEP
    }
    self.timeline: schedule_lib.Timeline | None = None
    # Per stage, the most param versions (live, stashed or predicted) held
    # at once during the last step call (tracked when versions are kept).
    self.peak_param_versions: tuple[int, ...] = (1,) * n

  def _stage_optimizer(self, s, predictor, schedule, ga_options, ga_policy):
    n = self.stages.num_stages
    leaves = self.stages.specs[s].param_leaves
    replica = {pos for pos, *_ in self._replicas.get(s, ())}
    positions = [p for p in range(len(leaves)) if p not in replica]
    names = [self._leaf_names[leaves[p]] for p in positions]
    applies_ga = ga_options is not None and GAP_AWARE_POLICIES[ga_policy](
      n - 1 - s
    )
    return StageOptimizer(
      names,
      self.optimizer,
      positions=positions,
      gap_aware=dict(ga_options) if applies_ga else None,
      predictor=predictor,
      learning_rate_schedule=schedule,
      horizon=int(self.schedule.delay[s].max()),
      grad_layout=self._grad_layout[s],
    )

  # -- state ----------------------------------------------------------------

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
    stage_params = []
    opt_states = []
    for s, leaves in enumerate(self.stages.split_params(params)):
      place = self.placement[s]
      placed = place.put_replicated(leaves)
      stage_params.append(placed)
      opt_states.append(
        place.put_replicated(self.stage_optimizers[s].init(placed))
      )
    return PipelineState(
      tuple(stage_params), tuple(opt_states), 0, state_leaves
    )

  def gather_model_state(self, state: PipelineState) -> Any:
    """The model state pytree (host arrays), or None without one."""
    if self._state_treedef is None:
      return None
    return jax.tree.unflatten(
      self._state_treedef, [jax.device_get(x) for x in state.model_state]
    )

  def gather_params(self, state: PipelineState) -> Any:
    """The full params pytree (on the host's default device)."""
    n_leaves = self.traced.num_param_leaves
    leaves = [None] * n_leaves
    for spec, values in zip(self.stages.specs, state.stage_params, strict=True):
      for i, v in zip(spec.param_leaves, values, strict=True):
        if leaves[i] is None:
          leaves[i] = jax.device_get(v)
    return jax.tree.unflatten(self._params_treedef, leaves)

  def state_dict(self, state: PipelineState) -> dict[str, Any]:
    """The whole training state, independent of the partition (host arrays).

    Returns:
      ``{"params": the full params pytree, "opt_state": the optimizer's
      state as ``optimizer.init({path: leaf})`` lays it out for the whole
      model (params-shaped parts are dicts keyed by global leaf path),
      "gap_aware": {"sq_avg": {path: array}, "count", "max_learning_rate"}
      for the leaves of Gap-Aware stages ({} without Gap-Aware),
      "model_state": the model state pytree or None, "step": int}``. Between ``step`` calls the pipeline is drained, so no
      stash or in-flight state needs saving.
    """
    base = [
      jax.device_get(opt.base_state(st))
      for opt, st in zip(self.stage_optimizers, state.opt_states, strict=True)
    ]
    merged = merge_keyed(base)
    ga_states = [
      jax.device_get(st)
      for opt, st in zip(self.stage_optimizers, state.opt_states, strict=True)
      if opt.gap_aware
    ]
    gap = {}
    if ga_states:
      gap = {
        "sq_avg": {k: v for st in ga_states for k, v in st.sq_avg.items()},
        "count": ga_states[0].count,
        "max_learning_rate": ga_states[0].max_learning_rate,
      }
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
    stage_params, opt_states = base.stage_params, []
    for s, opt in enumerate(self.stage_optimizers):
      fresh = base.opt_states[s]
      loaded = select_keyed(
        tree["opt_state"], opt.base_state(jax.device_get(fresh))
      )
      if opt.gap_aware:
        gap = tree.get("gap_aware") or {}
        sq = {
          k: gap.get("sq_avg", {}).get(k, v) for k, v in fresh.sq_avg.items()
        }
        loaded = fresh._replace(
          inner_state=loaded,
          sq_avg=sq,
          count=gap.get("count", fresh.count),
          max_learning_rate=gap.get(
            "max_learning_rate", fresh.max_learning_rate
          ),
        )
      opt_states.append(self.placement[s].put_replicated(loaded))
    return PipelineState(
      stage_params, tuple(opt_states), int(tree["step"]), base.model_state
    )

  # -- one call: num_microbatches microbatches --------------------------------

  def step(self, state: PipelineState, batch: Any, *, profile: bool = False):
    """Runs the schedule on one mini-batch; returns (state, metrics).

    Synchronous schedules take one optimizer step per call; ``async`` and
    ``2bw`` take the steps their schedule names and drain at the end.
    With ``profile=True`` it also measures when every action ran on its
    device and leaves the ``jpipe.schedule.Timeline`` in ``self.timeline``
    (export with ``jpipe.schedule.write_chrome_trace`` / ``plot_timeline``).
    """
    profiler = ActionProfiler(self.schedule) if profile else None
    m = self.num_microbatches
    size = _batch_size(batch)
    if size % m:
      raise ValueError(f"{m} microbatches do not divide the batch of {size}")
    micro_leaves = self._split_batch(jax.tree.leaves(batch))
    model_state = list(state.model_state)
    n = self.stages.num_stages
    sched = self.schedule
    values: dict[tuple[int, Any], Any] = {}  # (microbatch, var) -> value
    saved: dict[tuple[int, int], Any] = {}  # (stage, microbatch) -> inputs
    cots: dict[tuple[int, Any], Any] = {}
    fused_done: dict[tuple[int, int], Any] = {}  # B(s, k) ran with F(s, k)
    grads: list[Any] = [None] * n
    losses = []
    params, opt_states = list(state.stage_params), list(state.opt_states)
    # Weight versions of this call: stage -> {steps taken: params}.
    versions = [{0: p} for p in params]
    steps = [0] * n
    next_forward = [0] * n
    forward_params: dict[tuple[int, int], tuple] = {}
    peak = [1] * n  # most param versions a stage held at once
    tied = {}  # (tied leaf, microbatch) -> the value its owner's F used
    tied_grads = {}  # (tied leaf, step index) -> replicas' summed grads
    self.used_params = {}
    for action in self._order:
      s, k = action.stage, action.microbatch
      spec, place = self.stages.specs[s], self.placement[s]
      if action.kind == schedule_lib.FORWARD:
        theta_untied = self._forward_params(
          s, k, versions[s], opt_states[s], grads
        )
        theta = self._tie(s, k, theta_untied, tied)
        next_forward[s] += 1
        if self._keep_forward_params:
          forward_params[(s, k)] = theta
          held = {id(t) for t in versions[s].values()} | {
            id(t) for (s_, _), t in forward_params.items() if s_ == s
          }
          peak[s] = max(peak[s], len(held))
        if self.record_params:
          self.used_params[("F", s, k)] = theta
        acts = tuple(
          self._move(values[(k, v)], self._producer[v], s) for v in spec.inputs
        )
        local = self._local_inputs(
          spec, micro_leaves[place][k], model_state, place
        )
        if (s, k) in self.fused_pairs and self._same_backward_params(
          theta_untied, params[s]
        ):
          # Its backward needs only this forward: run both as one program.
          fused = self._fused(s, grads[s] is None, donate=not profile)
          results, grads[s], act_cots = fused(
            grads[s], theta, local, acts, self._result_cots(spec, k)
          )
          outputs = ()
          fused_done[(s, k)] = (grads[s], act_cots)
          if self.record_params:
            self.used_params[("B", s, k)] = theta
          self._send_cotangents(s, k, act_cots, cots)
        elif self.recompute:
          outputs, results = self.stages.jitted("forward", s)(
            theta, local, acts
          )
          saved[(s, k)] = (local, acts)
        else:
          outputs, results, residuals = self.stages.jitted("forward_saving", s)(
            theta, local, acts
          )
          saved[(s, k)] = residuals
        if profiler:
          profiler.record(action, (outputs, results))
        for v, x in zip(spec.outputs, outputs, strict=True):
          values[(k, v)] = x
        for r, x in zip(spec.results, results, strict=True):
          if r == 0:
            losses.append(x)
          else:  # A new model-state leaf: the next forward reads it.
            model_state[r - 1] = x
      elif action.kind == schedule_lib.BACKWARD and (s, k) in fused_done:
        if profiler:  # Ran with its forward; ends when that program does.
          profiler.record(action, fused_done.pop((s, k)))
        else:
          del fused_done[(s, k)]
      elif action.kind == schedule_lib.BACKWARD:
        out_cots = tuple(cots.pop((k, v), None) for v in spec.outputs)
        result_cots = self._result_cots(spec, k)
        if self.recompute:
          local, acts = saved.pop((s, k))
          theta = self._backward_params(s, k, params[s], forward_params)
          theta = self._tie(s, k, theta, tied)
          args = (theta, local, acts, out_cots, result_cots)
        else:
          theta = forward_params[(s, k)]  # The residuals' params.
          args = (theta, saved.pop((s, k)), out_cots, result_cots)
        if self.record_params:
          self.used_params[("B", s, k)] = theta
        # While profiling, nothing is donated: a watcher may still wait on
        # the previous gradient buffer.
        backward = self._backward(s, grads[s] is None, donate=not profile)
        grads[s], act_cots = backward(grads[s], *args)
        if profiler:
          profiler.record(action, (grads[s], act_cots))
        self._send_cotangents(s, k, act_cots, cots)
      elif self.asynchronous:  # STEP of stage s, applying its group.
        group = sched.step_groups[s][steps[s]]
        opt = self.stage_optimizers[s]
        stale = forward_params[(s, group[-1])] if opt.gap_aware else None
        # The packed accumulator, unpacked inside the step -- or before
        # it, to exchange tied leaves' gradients.
        g, step = grads[s], opt.update_packed
        if s in self._tied_stages:
          g = self._exchange_tied(
            s, steps[s], self._grad_leaves(s, g), tied_grads
          )
          step = opt.update
        params[s], opt_states[s] = step(g, opt_states[s], params[s], stale)
        if profiler:
          profiler.record(action, params[s])
        grads[s] = None
        steps[s] += 1
        versions[s][steps[s]] = params[s]
        for b in group:
          forward_params.pop((s, b), None)
          for _, leaf in self._owned_tied.get(s, ()):
            tied.pop((leaf, b), None)
        _drop_unused_versions(
          versions[s], sched.forward_version[s], next_forward[s]
        )
    if not self.asynchronous:  # One step per stage after every backward.
      grads = self._sum_shared(grads)
      for s in range(n):
        opt = self.stage_optimizers[s]
        step = opt.update if s in self._tied_stages else opt.update_packed
        params[s], opt_states[s] = step(
          grads[s], opt_states[s], params[s], None
        )
        if profiler:
          profiler.record(self._sync_step[s], params[s])
    if profiler:
      self.timeline = profiler.timeline()
    self.peak_param_versions = tuple(peak)
    loss = jnp.mean(jnp.stack(losses))
    return (
      PipelineState(
        tuple(params), tuple(opt_states), state.step + 1, tuple(model_state)
      ),
      {"loss": loss},
    )

  def _split_batch(self, leaves):
    """{placement: [microbatch k: {leaf index: array placed there}]}.

    One transfer and one jitted split per device per step, not a slice and
    a device_put per forward: on one device that cut ~0.2 ms of host work
    from every forward action (experiments/runtime/overhead.py).
    """
    m = self.num_microbatches
    out = {}
    for place, wanted in self._batch_leaves_of_placement.items():
      if not wanted:
        out[place] = [{}] * m
        continue
      chosen = [leaves[i] for i in wanted]
      if len(place.devices) > 1:
        parts = place.split_microbatches(chosen, m)
      else:
        parts = _split_microbatches(tuple(place.put_replicated(chosen)), m)
      out[place] = [dict(zip(wanted, part, strict=True)) for part in parts]
    return out

  def _local_inputs(self, spec, batch_leaves, model_state, place):
    """A stage's batch inputs on its device(s): microbatch leaves (already
    there), then model-state leaves (placed here, whole)."""
    nb = self._num_batch_leaves
    state = [model_state[i - nb] for i in spec.batch_leaves if i >= nb]
    state = iter(place.put_replicated(state) if state else ())
    return tuple(
      batch_leaves[i] if i < nb else next(state) for i in spec.batch_leaves
    )

  def _forward_params(self, s, k, versions, opt_state, grads):
    """The params F(s, k) runs with: its version, predicted if asked."""
    theta = versions[int(self.schedule.forward_version[s, k])]
    delay = int(self.schedule.delay[s, k])
    if self.prediction is None or delay == 0:
      return theta
    opt = self.stage_optimizers[s]
    if self.prediction == "aggmsnag" and grads[s] is not None:
      # The gradient accumulated so far, unpacked inside the prediction.
      return opt.predict_packed(theta, opt_state, delay, grads[s])
    return opt.predict(theta, opt_state, delay, None)

  def _tie(self, s, k, theta, tied):
    """Asynchronous tied params: the owner records the value its forward
    of microbatch k used; a replica stage uses that same value for k (in
    its forward and its backward), as if the version travelled with the
    activations."""
    for pos, leaf in self._owned_tied.get(s, ()):
      tied.setdefault((leaf, k), theta[pos])
    replicas = self._replicas.get(s)
    if not replicas:
      return theta
    theta = list(theta)
    for pos, leaf, _, _ in replicas:
      theta[pos] = self.placement[s].put_replicated(tied[(leaf, k)])
    return tuple(theta)

  def _exchange_tied(self, s, step_index, grads, tied_grads):
    """Before stage s's step: a replica stage hands its gradient of the
    tied leaves to the owner (it takes this step later, for the same
    microbatches); the owner adds them to its own."""
    grads = list(grads)
    for pos, leaf, owner, _ in self._replicas.get(s, ()):
      g = self.placement[owner].put_replicated(grads[pos])
      key = (leaf, step_index)
      tied_grads[key] = g if key not in tied_grads else tied_grads[key] + g
    for pos, leaf in self._owned_tied.get(s, ()):
      g = tied_grads.pop((leaf, step_index), None)
      if g is not None:
        grads[pos] = grads[pos] + g
    return tuple(grads)

  def _backward_params(self, s, k, current, forward_params):
    """The params a recomputing B(s, k) differentiates at."""
    if self._recompute_at_forward_params():
      return forward_params[(s, k)]
    return current

  def _recompute_at_forward_params(self) -> bool:
    return self.schedule.backward_uses_stash or (
      self.weight_stashing and self.gap_aware != "ga_jfl"
    )

  def _result_cots(self, spec, k):
    """Cotangents of a stage's results for microbatch k: the loss's
    weight in its step's mean; none for model-state outputs."""
    scale = self._loss_scale[k]
    return tuple(scale if r == 0 else None for r in spec.results)

  def _same_backward_params(self, forward_theta, current) -> bool:
    """Whether B(s, k), run right after F(s, k), would use F's params."""
    if not self.recompute or self._recompute_at_forward_params():
      return True
    # It recomputes at the current params: the same unless F's were an
    # older or predicted version (identity: no step can intervene).
    return forward_theta is current

  def _send_cotangents(self, s, k, act_cots, cots):
    """B(s, k)'s input cotangents, summed on each producer's device."""
    for v, c in zip(self.stages.specs[s].inputs, act_cots, strict=True):
      if c is not None:
        c = self._move(c, s, self._producer[v])
        cots[(k, v)] = c if (k, v) not in cots else cots[(k, v)] + c

  def _fused(self, s: int, first: bool, donate: bool = True):
    """Jitted forward + backward of an output-free stage s that also
    accumulates its gradient: ``(acc, params, batch, acts, result_cots)
    -> (results, grads, act_cots)``."""
    key = ("fused", s, first, donate)
    if key not in self._backward_fns:

      def fn(acc, *args):
        results, g, act_cots = self.stages.forward_backward(s, *args)
        return results, self._accumulate(s, first, acc, g), act_cots

      self._backward_fns[key] = jax.jit(
        fn, donate_argnums=(0,) if donate and not first else ()
      )
    return self._backward_fns[key]

  def _move(self, x, src: int, dst: int):
    """Value ``x`` from stage src's device(s) to stage dst's (no-op if
    shared)."""
    if self.placement[src] == self.placement[dst]:
      return x
    return self.placement[dst].put_values(x)

  def _backward(self, s: int, first: bool, donate: bool = True):
    """Jitted backward of stage s that also accumulates its gradient."""
    key = (s, first, donate)
    if key not in self._backward_fns:
      kind = "backward" if self.recompute else "backward_from_residuals"
      backward = getattr(self.stages, kind)

      def fn(acc, *args):
        g, act_cots = backward(s, *args)
        return self._accumulate(s, first, acc, g), act_cots

      self._backward_fns[key] = jax.jit(
        fn, donate_argnums=(0,) if donate and not first else ()
      )
    return self._backward_fns[key]

  def _accumulate(self, s, first, acc, grads):
    """(Traced) ``acc`` + the packed ``grads``, or the packed grads."""
    flat = self._grad_layout[s].pack(grads)
    return flat if first else tuple(map(jnp.add, acc, flat))

  def _grad_leaves(self, s, flat):
    """A packed gradient accumulator -> the stage's tuple of leaves."""
    key = ("unpack", s)
    if key not in self._backward_fns:
      self._backward_fns[key] = jax.jit(self._grad_layout[s].unpack)
    return self._backward_fns[key](flat)

  def _sum_shared(self, grads):
    """Packed accumulators -> what each stage's step takes: tied stages'
    unpacked, with every replica of a tied leaf given the sum of all
    replicas' gradients; the others' as they are."""
    grads = [
      list(self._grad_leaves(s, g)) if s in self._tied_stages else g
      for s, g in enumerate(grads)
    ]
    for holders in self._shared.values():
      total = None
      for s, pos in holders:
        g = self.placement[holders[0][0]].put_replicated(grads[s][pos])
        total = g if total is None else total + g
      for s, pos in holders:
        grads[s][pos] = self.placement[s].put_replicated(total)
    return [tuple(g) for g in grads]


@functools.partial(jax.jit, static_argnums=1)
def _split_microbatches(leaves, m):
  """m tuples of leaf slices along axis 0 (one program, m x L outputs)."""
  return tuple(
    tuple(jnp.reshape(x, (m, -1, *x.shape[1:]))[k] for x in leaves)
    for k in range(m)
  )


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


def _drop_unused_versions(versions, forward_version, next_forward):
  """Forget the versions no later forward of this stage reads (forward
  versions are non-decreasing in the microbatch)."""
  latest = max(versions)
  keep_from = latest
  if next_forward < len(forward_version):
    keep_from = min(int(forward_version[next_forward]), latest)
  for v in [v for v in versions if v < keep_from]:
    del versions[v]


def _batch_size(batch) -> int:
  sizes = {np.shape(x)[0] for x in jax.tree.leaves(batch) if np.ndim(x)}
  if len(sizes) != 1:
    raise ValueError(
      f"batch leaves need one common leading (batch) size, got {sizes}"
    )
  return sizes.pop()


def _device_name(group) -> str:
  """'device 2', 'devices 0-3' (consecutive) or 'devices 0,2'."""
  if len(group) == 1:
    return f"device {group[0]}"
  if list(group) == list(range(group[0], group[0] + len(group))):
    return f"devices {group[0]}-{group[-1]}"
  return "devices " + ",".join(map(str, group))


def _check_device_groups(stage_devices):
  """Stages share all their devices (mixed pipe) or none: replica groups
  of different stages cannot overlap."""
  for a in stage_devices:
    if len(set(a)) != len(a):
      raise ValueError(f"a stage lists a device twice: {tuple(a)}")
    for b in stage_devices:
      if tuple(a) != tuple(b) and set(a) & set(b):
        raise ValueError(
          f"stages on devices {tuple(a)} and {tuple(b)} overlap: stages "
          "must share all their devices, listed in the same order (several "
          "stages on one device or group), or none"
        )


def _place(schedule, stage_device):
  """The schedule with stages moved onto (possibly shared) devices.

  Each stage keeps its action order; stages sharing a device are
  interleaved in the order of the schedule's ideal timeline (unit costs,
  one device per stage), which keeps every dependency satisfiable.
  """
  if list(stage_device) == list(range(schedule.num_stages)):
    return schedule
  timeline = schedule_lib.simulate(schedule, 1.0, 1.0)
  num_devices = max(stage_device) + 1
  merged = [[] for _ in range(num_devices)]
  for acts in schedule.device_actions:
    for i, a in enumerate(acts):
      merged[stage_device[a.stage]].append((timeline.start[a], a.stage, i, a))
  device_actions = [[a for *_, a in sorted(m)] for m in merged]
  return schedule_lib.make_schedule(
    schedule.name, device_actions, stage_device, schedule.num_microbatches
  )


def _issue_order(schedule):
  """A global action order consistent with every device's list (the order
  of the simulated start times with unit costs)."""
  timeline = schedule_lib.simulate(schedule, 1.0, 1.0)
  actions = [a for acts in schedule.device_actions for a in acts]
  position = {
    a: i for acts in schedule.device_actions for i, a in enumerate(acts)
  }
  return sorted(
    actions,
    key=lambda a: (timeline.start[a], timeline.device_of[a], position[a]),
  )


def _fusable_pairs(schedule, specs) -> frozenset[tuple[int, int]]:
  """(stage, microbatch) pairs whose backward may run with the forward:
  the stage has no outputs and no step of it lies between the two on its
  device (so the gradient joins the same step's sum)."""
  pairs = set()
  for acts in schedule.device_actions:
    forward_at = {}
    for i, a in enumerate(acts):
      if specs[a.stage].outputs:
        continue
      if a.kind == schedule_lib.FORWARD:
        forward_at[(a.stage, a.microbatch)] = i
      elif a.kind == schedule_lib.BACKWARD:
        i0 = forward_at[(a.stage, a.microbatch)]
        if not any(
          b.kind == schedule_lib.STEP and b.stage == a.stage
          for b in acts[i0 + 1 : i]
        ):
          pairs.add((a.stage, a.microbatch))
  return frozenset(pairs)


def _shared_leaves(stages) -> dict[int, list[tuple[int, int]]]:
  """Param leaves held by several stages -> [(stage, position), ...]."""
  holders: dict[int, list[tuple[int, int]]] = {}
  for s, spec in enumerate(stages.specs):
    for pos, leaf in enumerate(spec.param_leaves):
      holders.setdefault(leaf, []).append((s, pos))
  return {k: v for k, v in holders.items() if len(v) > 1}
