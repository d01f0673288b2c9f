"""A pipeline that re-partitions itself when a device slows (DynPipe).

``DynamicPipeline`` wraps ``jpipe.Pipeline``: every ``window`` steps it
profiles one step (the action profiler's watcher threads stamp each
action's end while the stream runs on; only that step waits for its
timeline) and estimates each stage slot's slowdown

  sigma_s = measured seconds per microbatch / expected seconds.

The expected seconds of a stage are its nodes' calibrated times: the
reference window (after ``warmup_windows``) measures each stage of the
first plan, and a stage's measured time is split among its nodes in the
cost model's proportions, so cost-model errors (a loss head the FLOP
count underrates) stay with their nodes when they move instead of
reading as a slow device. What this cannot place (a stage's fixed
dispatch cost, which a small stage carries relatively more of) reads as
up to ~1.5x: hence sigmas between the thresholds count as 1. The
planners use the calibrated node times (``NodeTimes``,
``_node_times.py``: the best split for given slowdowns, a split's
predicted step time). Then, by policy (classes in ``_policies.py``; a
decision is a ``Decision``):

- "jpipe": sigmas between the thresholds count as 1 (as DynPipe's); when
  a slot becomes slowed or recovers, or its sigma moves by the trigger's
  factor from what the plan in force assumed, in two windows in a row
  (one profiled step is a noisy sample), solve the exact min-max split
  for their mean sigmas, predict both splits' step time with
  jpipe's event simulator on the schedule in use (the split in force on
  its two windows' measured stage times, the new one on the calibrated
  node times), and switch only when
  the gain over ``horizon_steps`` beats the cost of switching (measured:
  the first build, or an earlier switch to a plan seen before).
- "dynpipe": DynPipe's rule: its trigger on stage times against a
  reference window (re-taken after every switch, as DynPipe restarts),
  sigmas between the thresholds counted as 1, the best of its top-k
  candidate cuts by its 1F1B score, switched to whenever it differs.
- "static": measures, never switches (the baseline).

Across processes (one or more stages per process) each process times its
own stages -- an action's start waits for its inputs from other
processes, so waiting is not counted as compute -- the times are
gathered, every process calibrates alike, and process 0 decides (its
measured switch costs) and tells the others.

A switch is ``PlanSwitch``'s: drain, move every bit of state by
parameter path, continue the stream. Every switch is recorded in
``history`` and reported in the step's metrics under "repartition".
"""

import dataclasses
import json
import time
from collections.abc import Sequence

import jax
import numpy as np

from jpipe import partition as partition_lib
from jpipe.distributed import text_from_process_zero
from jpipe.dynamic._inject import Interference
from jpipe.dynamic._measure import stage_seconds_per_microbatch
from jpipe.dynamic._node_times import NodeTimes
from jpipe.dynamic._policies import Decision, make_policy
from jpipe.dynamic._predictor import SlowdownPredictor
from jpipe.dynamic._replan import boundaries_of, stage_costs
from jpipe.dynamic._split_in_force import SplitInForce
from jpipe.dynamic._switch import PlanSwitch
from jpipe.runtime import (
  Pipeline,
  PipelineBuilder,
  PipelineState,
  outside_user_mesh,
  rows_for_speeds,
)


@dataclasses.dataclass(frozen=True)
class Window:
  """One measured window: at ``step`` (calls so far), per stage slot,
  seconds per microbatch and the slowdown estimate (relative to the
  reference window's)."""

  step: int
  stage_seconds: tuple[float, ...]
  sigma: tuple[float, ...]
  step_seconds: float  # The profiled call's wall-clock seconds.


def _in_force(name: str) -> property:
  """A read-only attribute of the pipeline in force (``Pipeline.<name>``)."""
  return property(
    lambda self: getattr(self.switch.pipeline, name),
    doc=f"``Pipeline.{name}`` of the pipeline in force.",
  )


@outside_user_mesh  # (A caller's jax.set_mesh.)
class DynamicPipeline(SplitInForce):
  """A ``jpipe.Pipeline`` that re-partitions itself while training.

  Args:
    build: builds its pipelines (``jpipe.PipelineBuilder``: the model,
      an example batch and ``jpipe.Pipeline``'s options): the first for
      the options' partition, then one per plan switched to. The plan
      must be straight, one stage per device or per replica group
      (PipeDream's hybrid plans, each microbatch split over the group: a
      slot's stage runs as many times faster as it has replicas, and a
      slowed device slows its whole group). Its pipelines price every
      stage alike (``price_last_stage=False``), as its re-planning does
      (per-node times, whatever stage a node lands on), so that with no
      slowdown it plans what the first pipeline runs.
    policy: "jpipe", "dynpipe" or "static" (module docstring).
    window: calls (``step``) per measurement window.
    high, low: the trigger's thresholds (DynPipe: 2 and 0.5).
    warmup_windows: windows before the reference (compilation).
    top_k: DynPipe's candidate cuts per stage.
    horizon_steps: steps a switch's predicted gain is counted over
      (default two windows).
    interference: injected slowdowns and simulated compute
      (``Interference``; default none).
    cost_model: node costs for re-planning ("analytic", "xla",
      "measured"; see ``jpipe.partition.profile_nodes``).
    predictor: a fitted ``SlowdownPredictor`` (DynPipe's random forest):
      a candidate stage's slowdown on a slowed device is predicted from
      what the device shows and the stage's features, instead of the
      device's measured slowdown applying to any layers.
  """

  def __init__(
    self,
    build: PipelineBuilder,
    *,
    policy: str = "jpipe",
    window: int = 10,
    high: float = 2.0,
    low: float = 0.5,
    warmup_windows: int = 1,
    top_k: int = 2,
    horizon_steps: int | None = None,
    interference: Interference | None = None,
    cost_model: str = "analytic",
    predictor: SlowdownPredictor | None = None,
  ):
    if window < 1:
      raise ValueError(f"window must be >= 1 steps, got {window}")
    self.policy = make_policy(
      policy, high=high, low=low, warmup_windows=warmup_windows, top_k=top_k
    )
    self.window, self.high, self.low = window, high, low
    self.horizon_steps = horizon_steps or 2 * window
    self.interference = interference or Interference()
    self.switch = self._first_switch(_priced_alike(build))
    first = self.switch.pipeline
    self.schedule_name = first.schedule_name
    # (Re-planning keeps the named schedule: schedule="auto" is refused.)
    self.schedule_choice = first.schedule_choice
    self.num_microbatches = first.num_microbatches
    self._calibrate(build, cost_model, predictor)
    self.balances = policy != "static"  # Re-split weighted groups by speed.
    self.calls = 0
    self.rebalances: list[dict] = []  # Weighted groups' re-splits.
    self.windows: list[Window] = []  # Measured, in order.
    self.history: list[dict] = []  # Switches, in order.
    self.assumed = np.ones(first.stages.num_stages)  # sigma of the plan
    self._warmup_left = warmup_windows
    self._move_seconds = None  # Last switch's drain and move (no build).
    # A new pipeline's first call compiles its programs: timed, part of
    # what a switch to an unseen plan costs.
    self.compile_seconds, self._fresh = 0.0, True
    self._place()

  def _calibrate(self, build, cost_model, predictor) -> None:
    """The first pipeline's node costs (``costs``), its slots' replica
    groups (``groups``: each slot keeps its devices across switches) and
    the per-node seconds per microbatch (``nodes``: the cost model's
    until the reference window calibrates them)."""
    first = self.switch.pipeline
    self.costs = _node_costs(
      first, build.params, build.example_batch, cost_model
    )
    self.groups = tuple(tuple(ds) for ds in first.plan.stage_devices)
    self.nodes = NodeTimes(
      self.costs,
      first.traced,
      first.schedule_name,
      first.num_microbatches,
      predictor,
      replicas=[len(g) for g in self.groups],
    )
    self.predictor = predictor

  def _first_switch(self, build: PipelineBuilder) -> PlanSwitch:
    """The first pipeline (its build timed: ``build_seconds``) in a
    ``PlanSwitch`` that builds the others the same way."""

    def build_for(plan):
      return build(plan, hooks=self.interference)

    start = time.perf_counter()
    first = build(hooks=self.interference)
    self.build_seconds = time.perf_counter() - start
    _check_slots(first)
    return PlanSwitch(build_for, first)

  # -- the pipeline in force -------------------------------------------------

  @property
  def pipeline(self) -> Pipeline:
    return self.switch.pipeline

  @property
  def plan(self) -> partition_lib.Plan:
    return self.switch.plan

  @property
  def boundaries(self) -> tuple[int, ...]:
    return boundaries_of(self.plan.stage_of_node)

  def _place(self):
    """Tells the interference what each stage holds now."""
    b = self.boundaries
    forward = stage_costs(self.nodes.shares[0], b)
    backward = stage_costs(self.nodes.shares[1], b)
    self.interference.stage_shares = tuple(
      zip(forward.tolist(), backward.tolist(), strict=True)
    )
    self.interference.stage_devices = tuple(
      ds[0] for ds in self.plan.stage_devices
    )
    self.interference.stage_groups = tuple(
      tuple(ds) for ds in self.plan.stage_devices
    )
    self.interference.stage_rows = tuple(
      p.rows if p.weighted else None for p in self.pipeline.placement
    )

  # -- a call ----------------------------------------------------------------

  # What the training loop reads of the pipeline in force, by name (no
  # catch-all pass-through: an attribute not listed here is not one).
  init = _in_force("init")
  flush = _in_force("flush")
  state_dict = _in_force("state_dict")
  load_state_dict = _in_force("load_state_dict")
  gather_params = _in_force("gather_params")
  transport = _in_force("transport")
  placement = _in_force("placement")
  replica_rows = _in_force("replica_rows")
  stream = _in_force("stream")
  device_names = _in_force("device_names")
  granularity = _in_force("granularity")
  memory = _in_force("memory")
  memory_limit = _in_force("memory_limit")
  reads_batch = _in_force("reads_batch")
  param_norms = _in_force("param_norms")
  nonfinite_params = _in_force("nonfinite_params")
  gather_model_state = _in_force("gather_model_state")
  # (Its ``predict`` is the node times' prediction of a split's time:
  # predictions of the model are ``self.pipeline.predict``.)
  evaluate = _in_force("evaluate")

  def step(
    self, state: PipelineState, batch, *, profile: bool = False
  ) -> tuple[PipelineState, dict]:
    """One ``Pipeline.step``; the window's last also measures and may
    re-partition (then metrics has "repartition" and "window").
    ``profile``: also return the step's "timeline" (``Pipeline.step``)."""
    self.interference.step = self.calls
    measure = (self.calls + 1) % self.window == 0
    if measure:
      self.interference.take_slept()
      self.interference.take_replica_slept()
    start = time.perf_counter()
    state, metrics = self.pipeline.step(
      state, batch, profile=measure or profile
    )
    if self._fresh:  # Dispatch of a first call: mostly compilation.
      self.compile_seconds = time.perf_counter() - start
      self._fresh = False
    self.calls += 1
    if not measure:
      return state, metrics
    timeline = metrics["timeline"] if profile else metrics.pop("timeline")
    replica_slept = self.interference.take_replica_slept()
    window = self._measure(timeline, time.perf_counter() - start)
    metrics["window"] = window
    balanced = self._balance(timeline, replica_slept)
    if balanced:
      metrics["rebalance"] = balanced
    decision = self._decide(window) if jax.process_index() == 0 else None
    if jax.process_count() > 1:
      # Process 0 decides (its measured switch costs), everyone follows.
      decision = Decision.from_json(
        text_from_process_zero(decision.to_json() if decision else "null")
      )
    if decision is not None:
      state, record = self._switch_to(state, decision, window)
      metrics["repartition"] = record
    return state, metrics

  def _measure(self, timeline, seconds) -> Window:
    per_micro = stage_seconds_per_microbatch(
      timeline, self.interference.take_slept(), self.plan.num_stages
    )
    n = self.plan.num_stages
    if not self.nodes.calibrated and self._warmup_left <= 0:
      self.nodes.calibrate(self.boundaries, per_micro)
      if self.interference.model_seconds is None:
        self.interference.model_seconds = self.nodes.total
    self._warmup_left -= 1
    if self.nodes.calibrated:
      expected = self.nodes.stage_seconds(self.boundaries)
      sigma = per_micro / np.maximum(expected, 1e-12)
    else:
      sigma = np.ones(n)
    window = Window(self.calls, tuple(per_micro), tuple(sigma), seconds)
    self.windows.append(window)
    return window

  def _balance(self, timeline, replica_slept) -> list[dict]:
    """DynPipe's DP-stage load balancing (spec: DynPipe, B4): each
    weighted replica group's examples re-split in proportion to its
    replicas' measured speeds, where that cuts the group's predicted time
    per microbatch by ``BALANCE_GAIN`` at least (a new split compiles new
    programs: noise must not flip it back and forth). A replica keeps at
    least one example, so its speed stays measured. Returns the changes
    (also in ``rebalances``)."""
    if not self.balances:
      return []
    changes = []
    for s, place in enumerate(self.pipeline.placement):
      if not place.weighted:
        continue
      speeds = replica_speeds(timeline, replica_slept, s, place.rows)
      n, rows = place.microbatch_size, place.rows
      new = rows_for_speeds(n, speeds)
      if n >= len(new):
        new = _at_least_one(new)
      old_time = max(r / v for r, v in zip(rows, speeds, strict=True))
      new_time = max(r / v for r, v in zip(new, speeds, strict=True))
      if new == rows or new_time > (1 - BALANCE_GAIN) * old_time:
        continue
      self.pipeline.set_replica_rows(s, new)
      record = {
        "step": self.calls,
        "stage": s,
        "old": list(rows),
        "new": list(new),
        "examples_per_second": [float(v) for v in speeds],
        "predicted_gain": float(old_time / new_time),
      }
      changes.append(record)
    if changes:
      self.rebalances.extend(changes)
      self._place()
    return changes

  def _decide(self, window: Window) -> Decision | None:
    """The policy's decision after ``window`` (none while warming up)."""
    if self._warmup_left >= 0:
      return None
    return self.policy.decide(self, window)


def _node_costs(first, params, example_batch, cost_model):
  """The cost model's node costs of ``first``'s trace on one microbatch
  (across processes, process 0's: a measured model differs per
  process)."""
  micro = jax.tree.map(
    lambda x: x[: x.shape[0] // first.num_microbatches], example_batch
  )
  costs = partition_lib.profile_nodes(
    first.traced, params, micro, method=cost_model
  )
  if jax.process_count() > 1:  # A measured model differs per process.
    f, b = json.loads(
      text_from_process_zero(
        json.dumps(
          [costs.forward_seconds.tolist(), costs.backward_seconds.tolist()]
        )
      )
    )
    costs = dataclasses.replace(
      costs, forward_seconds=np.asarray(f), backward_seconds=np.asarray(b)
    )
  return costs


def _priced_alike(build: PipelineBuilder) -> PipelineBuilder:
  """``build`` pricing every stage alike (``price_last_stage=False``), as
  re-planning does; refused where the options ask otherwise."""
  partitioning = build.options.get("partitioning")
  if partitioning is not None:
    return build.with_options(
      partitioning=dataclasses.replace(partitioning, price_last_stage=False)
    )
  if build.options.get("price_last_stage", False):
    raise ValueError(
      "DynamicPipeline re-plans with per-node times, every stage alike: "
      "price_last_stage=True would start it from a plan it cannot "
      "return to; leave it out"
    )
  return build.with_options(price_last_stage=False)


def _check_slots(pipe):
  """A straight plan, one stage per device or replica group (the groups
  disjoint), replicas splitting each microbatch."""
  plan = pipe.plan
  devices = [d for ds in plan.stage_devices for d in ds]
  if len(set(devices)) != len(devices):
    raise ValueError(
      "re-partitioning needs one stage per device or replica group (no "
      "mixed pipe: stages sharing devices)"
    )
  if any(p.round_robin for p in pipe.placement):
    raise ValueError(
      "re-partitioning runs replicated stages that split each microbatch "
      "(replica_routing='split' or 'weighted'), not round-robin replicas"
    )
  boundaries_of(plan.stage_of_node)  # Raises unless straight.


# A weighted group re-splits only for at least this predicted gain.
BALANCE_GAIN = 0.05


def replica_speeds(timeline, replica_slept, s, rows) -> list[float]:
  """Examples per second of each replica of weighted stage s in one
  profiled step: a replica's seconds per microbatch are what it slept for
  its slice (``Interference``) plus the stage's measured compute per
  microbatch times its share of the examples. (Replicas on one host's
  fake CPU devices share its cores, so their compute cannot be timed
  apart; with no injected interference every replica reads alike.)"""
  busy, micro = 0.0, 0
  for action, end in timeline.end.items():
    if action.stage != s or action.kind == "S":
      continue
    busy += end - timeline.start[action]
    micro += action.kind == "F"
  micro = max(micro, 1)
  n = sum(rows)
  speeds = []
  for j, r in enumerate(rows):
    seconds = replica_slept.get((s, j), 0.0) / micro + busy / micro * r / n
    speeds.append(r / max(seconds, 1e-9) if r else 0.0)
  if not any(speeds):  # Nothing measured: keep every replica alike.
    return [1.0] * len(rows)
  # A replica that took no examples has no measured speed: the slowest
  # measured one's, so it gets examples back to be measured.
  slowest = min(v for v in speeds if v > 0)
  return [v if v > 0 else slowest for v in speeds]


def _at_least_one(rows) -> tuple[int, ...]:
  """``rows`` with every replica given one example at least, taken from
  the largest."""
  rows = list(rows)
  for j, r in enumerate(rows):
    if r == 0:
      rows[rows.index(max(rows))] -= 1
      rows[j] = 1
  return tuple(rows)


def describe(boundaries: Sequence[int]) -> str:
  """``"[0:3 | 3:7 | 7:12]"``: each stage's node range."""
  return (
    "["
    + " | ".join(
      f"{a}:{b}" for a, b in zip(boundaries[:-1], boundaries[1:], strict=True)
    )
    + "]"
  )
