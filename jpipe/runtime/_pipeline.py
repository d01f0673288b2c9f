"""The pipeline driver: stages on devices, run by a schedule.

``Pipeline`` traces the loss on one microbatch, partitions it (or takes a
Plan), builds jitted stage functions, places each stage's parameters and
optimizer state on its device, and runs a schedule's actions in an order
that respects every device's action list. JAX dispatches asynchronously, so
devices work concurrently; the host blocks only when reading metrics.

This first driver runs the synchronous schedules (seq, gpipe, 1f1b and
synchronous interleaved): the new params equal single-device gradient
accumulation over the same microbatches. Parameters read by several stages
(tied embeddings) are replicated; their gradient is summed over the stages
and every replica takes the same step, so the replicas stay equal.
"""

from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jpipe import partition as partition_lib
from jpipe import schedule as schedule_lib

SYNCHRONOUS = ("seq", "gpipe", "1f1b", "interleaved")


class PipelineState(NamedTuple):
  """Per-stage parameter leaves and optimizer states, on their devices."""

  stage_params: tuple[tuple[jax.Array, ...], ...]
  opt_states: tuple[Any, ...]
  step: int


class Pipeline:
  """A model split into pipeline stages, trained by a schedule.

  Args:
    loss_fn: ``loss_fn(params, batch) -> scalar`` (mean over the batch).
    params: example params (their structure is kept).
    example_batch: a full mini-batch; its leading axis is split into
      ``num_microbatches`` microbatches.
    num_stages: pipeline stages (ignored when ``partition`` is a Plan).
    devices: the devices to use; default ``jax.devices()``.
    schedule: one of jpipe.schedule.SCHEDULES (synchronous ones here).
    num_microbatches: microbatches per mini-batch.
    optimizer: an optax transformation, applied per stage.
    partition: "contiguous", "mixed", or a jpipe.partition.Plan.
    depth: module-path depth of the traced nodes.
    recompute: backward recomputes the forward (True) or keeps residuals.
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
    recompute: bool = True,
  ):
    if schedule not in schedule_lib.SCHEDULES:
      raise ValueError(
        f"unknown schedule {schedule!r}: one of {schedule_lib.SCHEDULES}"
      )
    if schedule not in SYNCHRONOUS:
      raise NotImplementedError(
        f"schedule {schedule!r} is asynchronous; this driver runs "
        f"{SYNCHRONOUS} so far"
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
    micro = jax.tree.map(
      lambda x: x[: batch_size // num_microbatches], example_batch
    )
    self.traced = partition_lib.trace(loss_fn, params, micro, depth=depth)
    if isinstance(partition, partition_lib.Plan):
      plan = partition
    else:
      if num_stages > len(devices) and partition != "mixed":
        raise ValueError(
          f"{num_stages} stages need {num_stages} devices, got "
          f"{len(devices)}: pass more devices or partition='mixed'"
        )
      costs = partition_lib.profile_nodes(
        self.traced, params, micro, method="analytic"
      )
      plan = partition_lib.plan_traced(
        self.traced, costs, min(num_stages, len(devices)), method=partition
      )
    self.plan = plan
    if plan.node_names != self.traced.node_names:
      raise ValueError("the Plan was made for a different model (nodes differ)")
    self.stages = partition_lib.Stages(self.traced, plan.stage_of_node)
    n = self.stages.num_stages
    used = sorted({ds[0] for ds in plan.stage_devices})
    if used[-1] >= len(devices):
      raise ValueError(
        f"the plan uses device {used[-1]} but only {len(devices)} are given"
      )
    self.stage_device = tuple(devices[ds[0]] for ds in plan.stage_devices)
    physical = [ds[0] for ds in plan.stage_devices]
    if schedule == "interleaved":
      self.schedule = schedule_lib.interleaved(physical, num_microbatches)
    else:
      self.schedule = _place(
        schedule_lib.build(schedule, n, num_microbatches), physical
      )
    self._order = _issue_order(self.schedule)
    self._shared = _shared_leaves(self.stages)
    self._producer = {
      v: s for s, spec in enumerate(self.stages.specs) for v in spec.outputs
    }
    self._params_treedef = jax.tree.structure(params)
    self._update = jax.jit(self._update_fn)
    self._backward_fns: dict[tuple[int, bool], Any] = {}

  # -- state ----------------------------------------------------------------

  def init(self, params: Any) -> PipelineState:
    """Splits ``params`` per stage, places them, builds optimizer states."""
    stage_params = []
    opt_states = []
    for s, leaves in enumerate(self.stages.split_params(params)):
      placed = jax.device_put(leaves, self.stage_device[s])
      stage_params.append(placed)
      opt_states.append(jax.jit(self.optimizer.init)(placed))
    return PipelineState(tuple(stage_params), tuple(opt_states), 0)

  def gather_params(self, state: PipelineState) -> Any:
    """The full params pytree (on the host's default device)."""
    n_leaves = self.traced.num_param_leaves
    leaves = [None] * n_leaves
    for spec, values in zip(self.stages.specs, state.stage_params, strict=True):
      for i, v in zip(spec.param_leaves, values, strict=True):
        if leaves[i] is None:
          leaves[i] = jax.device_get(v)
    return jax.tree.unflatten(self._params_treedef, leaves)

  # -- one mini-batch ---------------------------------------------------------

  def step(self, state: PipelineState, batch: Any):
    """Runs the schedule on one mini-batch; returns (state, metrics)."""
    m = self.num_microbatches
    size = _batch_size(batch)
    if size % m:
      raise ValueError(f"{m} microbatches do not divide the batch of {size}")
    micro = [
      jax.tree.map(lambda x, k=k: x[k * size // m : (k + 1) * size // m], batch)
      for k in range(m)
    ]
    stage_batch = [self.stages.split_batch(mb) for mb in micro]
    n = self.stages.num_stages
    values: dict[tuple[int, Any], Any] = {}  # (microbatch, var) -> value
    saved: dict[tuple[int, int], Any] = {}  # (stage, microbatch) -> inputs
    cots: dict[tuple[int, Any], Any] = {}
    grads: list[Any] = [None] * n
    losses = []
    params, opt_states = list(state.stage_params), list(state.opt_states)
    for action in self._order:
      s, k = action.stage, action.microbatch
      spec, device = self.stages.specs[s], self.stage_device[s]
      if action.kind == schedule_lib.FORWARD:
        acts = tuple(
          self._move(values[(k, v)], self._producer[v], s) for v in spec.inputs
        )
        local = jax.device_put(stage_batch[k][s], device)
        if self.recompute:
          outputs, results = self.stages.jitted("forward", s)(
            params[s], local, acts
          )
          saved[(s, k)] = (local, acts)
        else:
          outputs, results, residuals = self.stages.jitted("forward_saving", s)(
            params[s], local, acts
          )
          saved[(s, k)] = residuals
        for v, x in zip(spec.outputs, outputs, strict=True):
          values[(k, v)] = x
        if 0 in spec.results:
          losses.append(results[spec.results.index(0)])
      elif action.kind == schedule_lib.BACKWARD:
        out_cots = tuple(cots.pop((k, v), None) for v in spec.outputs)
        result_cots = tuple(1.0 / m if r == 0 else None for r in spec.results)
        if self.recompute:
          local, acts = saved.pop((s, k))
          args = (params[s], local, acts, out_cots, result_cots)
        else:
          args = (saved.pop((s, k)), out_cots, result_cots)
        grads[s], act_cots = self._backward(s, grads[s] is None)(
          grads[s], *args
        )
        for v, c in zip(spec.inputs, act_cots, strict=True):
          if c is not None:  # Summed on the producer's device.
            c = self._move(c, s, self._producer[v])
            cots[(k, v)] = c if (k, v) not in cots else cots[(k, v)] + c
      else:  # STEP
        pass  # Synchronous: all steps after the last backward (below).
    grads = self._sum_shared(grads)
    for s in range(n):
      params[s], opt_states[s] = self._update(
        grads[s], opt_states[s], params[s]
      )
    loss = jnp.mean(jnp.stack(losses))
    return (
      PipelineState(tuple(params), tuple(opt_states), state.step + 1),
      {"loss": loss},
    )

  def _move(self, x, src: int, dst: int):
    """``x`` from stage src's device to stage dst's (no-op if shared)."""
    if self.stage_device[src] == self.stage_device[dst]:
      return x
    return jax.device_put(x, self.stage_device[dst])

  def _backward(self, s: int, first: bool):
    """Jitted backward of stage s that also accumulates its gradient."""
    key = (s, first)
    if key not in self._backward_fns:
      kind = "backward" if self.recompute else "backward_from_residuals"
      backward = getattr(self.stages, kind)

      def fn(acc, *args):
        g, act_cots = backward(s, *args)
        if not first:
          g = jax.tree.map(jnp.add, acc, g)
        return g, act_cots

      self._backward_fns[key] = jax.jit(
        fn, donate_argnums=() if first else (0,)
      )
    return self._backward_fns[key]

  def _update_fn(self, grads, opt_state, params):
    updates, opt_state = self.optimizer.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state

  def _sum_shared(self, grads):
    """Tied leaves: every replica gets the sum of all replicas' gradients."""
    grads = [list(g) for g in grads]
    for holders in self._shared.values():
      total = None
      for s, pos in holders:
        g = jax.device_put(grads[s][pos], self.stage_device[holders[0][0]])
        total = g if total is None else total + g
      for s, pos in holders:
        grads[s][pos] = jax.device_put(total, self.stage_device[s])
    return [tuple(g) for g in grads]


def _batch_size(batch) -> int:
  sizes = {np.shape(x)[0] for x in jax.tree.leaves(batch) if np.ndim(x)}
  if len(sizes) != 1:
    raise ValueError(
      f"batch leaves need one common leading (batch) size, got {sizes}"
    )
  return sizes.pop()


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


def _shared_leaves(stages) -> dict[int, list[tuple[int, int]]]:
  """Param leaves held by several stages -> [(stage, position), ...]."""
  holders: dict[int, list[tuple[int, int]]] = {}
  for s, spec in enumerate(stages.specs):
    for pos, leaf in enumerate(spec.param_leaves):
      holders.setdefault(leaf, []).append((s, pos))
  return {k: v for k, v in holders.items() if len(v) > 1}
