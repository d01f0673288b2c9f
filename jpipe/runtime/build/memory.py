"""What each device of a pipeline holds, predicted before anything runs.

A stage's device holds, at its peak (bytes):

  params x versions    the live params, and the older (or predicted)
                       versions weight stashing, 2BW and prediction keep
                       for microbatches in flight
  + grads              the gradient accumulator (the params' bytes, packed;
                       wider with grad_accum_dtype)
  + opt_state          the optimizer's state of the stage's leaves
                       (Gap-Aware's statistics included)
  + in_flight x kept   what each microbatch between its forward and its
                       backward keeps: the stage's inputs when the backward
                       recomputes, else the forward's residuals
  + working            one program's own buffers, bounded from above: the
                       larger of the saving forward's residuals and
                       outputs and the backward's (every intermediate of
                       one microbatch, plus the gradients before they are
                       packed into the accumulator)

Every term comes from abstract evaluation (``jax.eval_shape``: no
compilation) and from the call's real action lists, so the prediction
knows the schedule: GPipe keeps every microbatch of a call in flight, 1F1B
``n - s``, and a last stage whose backward runs fused with its forward
none. Stages sharing a device (a mixed pipe) add up; a replicated stage's
replicas each hold the params and their share of every microbatch (round
robin: whole microbatches, 1 / r of those in flight).
"""

import dataclasses
import math
from collections.abc import Sequence

import jax

from jpipe.partition import MemoryBudget
from jpipe.runtime.build.grad_dtype import gradient_avals, promoted_state
from jpipe.schedule import (
  FORWARD,
  INPUT,
  INPUT_GRADIENT,
  WEIGHT,
  WEIGHT_GRADIENT,
)


@dataclasses.dataclass(frozen=True)
class StageMemory:
  """Predicted bytes one stage holds on each of its devices at its peak.

  Attributes:
    params: one version of the stage's param leaves.
    versions: param versions held at once at most (1: no stash).
    tied_copies: bytes of the extra copies of tied leaves another stage
      owns (a stream's replica takes the owner's value per microbatch).
    grads: the gradient accumulator.
    opt_state: the optimizer state.
    kept_per_microbatch: what one microbatch keeps between its forward and
      its backward (stage inputs, or residuals without recomputation).
    in_flight: microbatches between forward and backward at once, at most.
    working: one program's own buffers at its peak, an upper bound (XLA
      fuses and frees some intermediates: its figure is often 2-3x less
      on small stages).
    weight_kept_per_microbatch: what a split backward's W needs, kept
      from its I (zero-bubble schedules; 0 otherwise).
    awaiting_weight: microbatches between I and W when the stage holds
      the most (with ``in_flight`` at that moment).
  """

  params: int
  versions: int
  tied_copies: int
  grads: int
  opt_state: int
  kept_per_microbatch: int
  in_flight: int
  working: int
  weight_kept_per_microbatch: int = 0
  awaiting_weight: int = 0

  @property
  def total(self) -> int:
    return (
      self.params * self.versions
      + self.tied_copies
      + self.grads
      + self.opt_state
      + self.in_flight * self.kept_per_microbatch
      + self.awaiting_weight * self.weight_kept_per_microbatch
      + self.working
    )

  def describe(self) -> str:
    """One line: the total and its terms."""
    return (
      f"{format_bytes(self.total)} = params {format_bytes(self.params)} x {self.versions} "
      f"version(s) + tied copies {format_bytes(self.tied_copies)} + grads "
      f"{format_bytes(self.grads)} + optimizer state "
      f"{format_bytes(self.opt_state)} + {self.in_flight} microbatch(es) in flight "
      f"x {format_bytes(self.kept_per_microbatch)} + "
      + (
        f"{self.awaiting_weight} awaiting W x "
        f"{format_bytes(self.weight_kept_per_microbatch)} + "
        if self.awaiting_weight
        else ""
      )
      + f"working {format_bytes(self.working)}"
    )


def nbytes(tree) -> int:
  """Bytes of a pytree of arrays or ``ShapeDtypeStruct``s."""
  return int(
    sum(
      math.prod(x.shape) * x.dtype.itemsize  # PRNG key dtypes have one too
      for x in jax.tree.leaves(tree)
      if hasattr(x, "shape")
    )
  )


def in_flight_counts(calls: Sequence, num_stages: int) -> tuple[int, ...]:
  """Per stage, the most microbatches between forward and backward at once
  over a sequence of ``Call``s (``build/calls.py``) run in order. A forward
  whose backward runs fused with it keeps nothing; a split backward's
  I ends it."""
  states = split_backward_states(calls, num_stages)
  return tuple(max(held for held, _ in stage) for stage in states)


def split_backward_states(
  calls: Sequence, num_stages: int
) -> tuple[frozenset[tuple[int, int]], ...]:
  """Per stage, every ``(between F and I, between I and W)`` pair of
  microbatch counts it passes through over ``Call``s run in order (a
  backward run whole, B, counts as its I; a fused one keeps nothing).
  The peak memory is at one of them."""
  open_, waiting = [0] * num_stages, [0] * num_stages
  states = [{(0, 0)} for _ in range(num_stages)]
  for call in calls:
    for action in call.order:
      s, b = action.stage, action.microbatch
      if (s, b) in call.fused:
        continue
      if action.kind == FORWARD:
        open_[s] += 1
      elif action.kind in INPUT_GRADIENT:
        open_[s] -= 1
        waiting[s] += action.kind == INPUT
      elif action.kind == WEIGHT:
        waiting[s] -= 1
      states[s].add((open_[s], waiting[s]))
  return tuple(frozenset(x) for x in states)


def tied_copies(policy, stream, owner_of_replicas) -> tuple[int, ...]:
  """Per stage, how many extra copies of the tied leaves it holds for
  another stage (``owner_of_replicas[s]``: that stage, or None).

  In a stream a replica's forward of microbatch b takes the value the
  owner's forward of b used, kept until b's backward: at most one per
  owner step in between (its delay), or per microbatch of a 2BW
  minibatch. An upper bound.
  """
  if stream is None:
    return tuple(0 for _ in owner_of_replicas)
  out = []
  for owner in owner_of_replicas:
    if owner is None:
      out.append(0)
    elif stream.backward_uses_stash:
      out.append(stream.step_every)
    elif policy.keeps_forward_params:
      out.append(stream.max_delay(owner))
    else:
      out.append(0)
  return tuple(out)


def param_versions(policy, stream, num_stages: int) -> tuple[int, ...]:
  """Per stage, the param versions held at once at most (the driver's
  ``param_versions`` metric in steady state).

  PipeDream's model: weight stashing keeps a version per in-flight
  microbatch, ``d + 1`` with the live one (d = the stage's largest delay);
  with prediction each in-flight forward has its own predicted version,
  one more. 2BW keeps two. Prediction without a stash makes one
  predicted copy at a time, beside the live params.
  """
  if stream is None:
    return (1,) * num_stages
  if stream.backward_uses_stash:  # 2BW: W(t-1) and W(t).
    return (2,) * num_stages
  out = []
  for s in range(num_stages):
    d = stream.max_delay(s)
    predicted = policy.prediction is not None and d > 0
    if policy.keeps_forward_params:
      out.append(d + 1 + predicted if d > 0 else 1)
    else:
      out.append(1 + predicted)
  return tuple(out)


def predict_stage_memory(
  *,
  params,
  opt_state,
  kept,
  residuals,
  outputs,
  intermediates,
  in_flight: int,
  versions: int,
  tied: int,
  replicas: int,
  weight_kept=(),
  awaiting_weight: int = 0,
  round_robin: bool = False,
  grads=None,
) -> StageMemory:
  """One stage's ``StageMemory`` from abstract values.

  Args:
    params: the stage's param leaves (avals).
    opt_state: its optimizer state (avals).
    kept: what one microbatch keeps in flight (avals).
    residuals: one microbatch's residuals (avals).
    outputs: one microbatch's outputs and results (avals).
    intermediates: every intermediate of one microbatch's backward
      (avals).
    in_flight: microbatches in flight at most.
    versions: param versions at most.
    tied: bytes of the extra copies of tied leaves (``tied_copies`` x
      their bytes).
    replicas: devices the stage runs on (each gets 1/replicas of a
      microbatch); a weighted group's microbatch size over its largest
      slice (a float).
    weight_kept: what a split backward's W keeps per microbatch (avals).
    awaiting_weight: microbatches between I and W beside ``in_flight``.
    round_robin: the replicas take whole microbatches in turn (1F1B-RR):
      each holds every byte of its microbatches, and 1 / replicas of the
      stage's in flight (rounded up: they are consecutive).
    grads: the gradient accumulator (avals) where it is not ``params``'
      bytes (summed in a wider dtype: ``grad_accum_dtype``).
  """
  per_replica = max(replicas, 1)
  if round_robin:
    in_flight = -(-in_flight // per_replica)
    awaiting_weight = -(-awaiting_weight // per_replica)
    per_replica = 1
  # The accumulator packs the same leaves (in their own dtypes unless
  # grads says otherwise).
  grads = nbytes(params if grads is None else grads)
  forward = nbytes(residuals) + nbytes(outputs)
  backward = nbytes(intermediates)
  return StageMemory(
    params=nbytes(params),
    versions=versions,
    tied_copies=tied,
    grads=grads,
    opt_state=nbytes(opt_state),
    kept_per_microbatch=_share(nbytes(kept), per_replica),
    in_flight=in_flight,
    working=_share(max(forward, backward), per_replica) + grads,
    weight_kept_per_microbatch=_share(nbytes(weight_kept), per_replica),
    awaiting_weight=awaiting_weight,
  )


def _share(nbytes_: int, ways) -> int:
  """Bytes on a device holding 1 / ``ways`` of a microbatch, rounded up."""
  if isinstance(ways, int):
    return -(-nbytes_ // ways)
  return math.ceil(nbytes_ / ways)


def device_totals(
  stage_memory: Sequence[StageMemory], stage_devices: Sequence[Sequence[int]]
) -> dict[int, int]:
  """``{device index: predicted bytes}``: what the stages each device runs
  hold, added up, plus the largest ``working`` term among them once: a
  device runs one program at a time, so its stages' programs' own buffers
  never coexist (on an H100 summing them over-predicted a 4-stage
  one-device GPT by 1.8x; measured in experiments/gpu_campaign)."""
  held: dict[int, int] = {}
  working: dict[int, int] = {}
  for memory, devices in zip(stage_memory, stage_devices, strict=True):
    for d in devices:
      held[d] = held.get(d, 0) + memory.total - memory.working
      working[d] = max(working.get(d, 0), memory.working)
  return {d: held[d] + working[d] for d in held}


def resolve_memory_limit(memory_limit, devices) -> float | None:
  """``memory_limit`` in bytes (None: no limit)."""
  if memory_limit is None:
    return None
  if memory_limit == "device":
    stats = [d.memory_stats() for d in devices]
    if any(not st or "bytes_limit" not in st for st in stats):
      raise ValueError(
        f"memory_limit='device': the {devices[0].platform} devices do not "
        "report their memory: pass memory_limit in bytes"
      )
    return float(min(st["bytes_limit"] for st in stats))
  if isinstance(memory_limit, str) or not memory_limit > 0:
    raise ValueError(
      f"memory_limit must be bytes per device (> 0), 'device' or None, got "
      f"{memory_limit!r}"
    )
  return float(memory_limit)


def partitioner_memory_model(
  limit,
  optimizer,
  params,
  schedule,
  num_microbatches,
  num_stages,
  *,
  recompute,
  stashes,
  fused_last,
  grad_accum_dtype=None,
):
  """The partitioner's ``MemoryBudget`` for a schedule (a
  ``jpipe.schedule.ScheduleKind``) under ``limit`` bytes per device
  (None: no limit; the model still counts).

  A per-node model, coarser than ``Pipeline.memory`` (which the built
  pipeline is checked against): optimizer state as the optimizer's own
  ratio to the params, the schedule's in-flight counts (PipeDream's for
  a stream) and stash counts. Gradients summed wider than the params
  (``grad_accum_dtype``) add their extra bytes, and those of the state
  they promote, to that ratio (the model counts one gradient byte per
  param byte beside it).
  """
  n, m = num_stages, num_microbatches
  param_bytes = max(nbytes(params), 1)
  factor = (
    _state_and_extra_gradient_bytes(optimizer, params, grad_accum_dtype)
    / param_bytes
  )
  stream = schedule.asynchronous
  if stream:
    flight = [n - s for s in range(n)]
  else:
    flight = _held_until_weight_gradient(schedule, n, m, fused_last)
  if schedule.two_versions:
    versions = [2] * n
  elif stream and stashes:
    versions = [n - s for s in range(n)]
  else:
    versions = [1] * n
  return MemoryBudget(
    limit=limit,
    optimizer_state_factor=factor,
    in_flight=tuple(flight),
    param_versions=tuple(versions),
    recompute=recompute,
  )


def _state_and_extra_gradient_bytes(optimizer, params, grad_accum_dtype):
  """Bytes of ``optimizer``'s state for ``params`` (as gradients in
  ``grad_accum_dtype`` promote it), plus the gradients' bytes beyond the
  params'."""

  def state_of(p):
    state = optimizer.init(p)
    if grad_accum_dtype is None:
      return state
    return promoted_state(
      optimizer.update, state, p, gradient_avals(p, grad_accum_dtype)
    )

  extra = nbytes(gradient_avals(params, grad_accum_dtype)) - nbytes(params)
  return nbytes(jax.eval_shape(state_of, params)) + extra


def _held_until_weight_gradient(kind, n, m, fused_last) -> list[int]:
  """Per stage, the most microbatches between their forward and their
  weight gradient (B or W) in ``kind``'s schedule of ``n`` stages (stage
  s on device s) and ``m`` microbatches; a last stage whose backward runs
  fused with its forward keeps none. A written schedule for other
  devices: every microbatch, an upper bound."""
  try:
    built = kind.on_devices(list(range(n)), m)
  except ValueError:
    return [m] * n
  flight = []
  for s in range(n):
    held = peak = 0
    for a in built.device_actions[built.stage_device[s]]:
      if a.stage == s:
        held += (a.kind == FORWARD) - (a.kind in WEIGHT_GRADIENT)
        peak = max(peak, held)
    flight.append(peak)
  last = built.device_actions[built.stage_device[n - 1]]
  if fused_last and not any(a.kind == INPUT for a in last):
    flight[-1] = 0
  return flight


def format_bytes(n: float) -> str:
  """``n`` bytes with a binary unit: "1.5 GiB", "640.0 KiB", "12 B"."""
  for power, unit in ((3, "GiB"), (2, "MiB"), (1, "KiB")):
    if abs(n) >= 1024**power:
      return f"{n / 1024**power:.1f} {unit}"
  return f"{n:.0f} B"
