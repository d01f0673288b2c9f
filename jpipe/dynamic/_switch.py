"""Moving a running pipeline to another partition, keeping its state.

``PlanSwitch`` keeps one ``jpipe.Pipeline`` per plan it has used (its
compiled stage programs with it: a plan seen before costs no
compilation). ``switch(state, plan)`` drains the stream (``flush``), takes
the partition-independent state dict (params, optimizer state, Gap-Aware
statistics and model state, keyed by parameter path), and loads it into
the pipeline of the new plan: every leaf lands on the stage and device
that now owns it. Unlike DynPipe, which rebuilds its optimizer and loses
momentum, nothing is reset; the stream warms up again from the switch.
"""

import dataclasses
import time
from collections.abc import Callable

from jpipe.partition import Plan
from jpipe.runtime import Pipeline, PipelineState


def plan_key(plan: Plan) -> tuple:
  """What makes two plans run the same programs on the same devices."""
  return (plan.stage_of_node, plan.stage_devices)


@dataclasses.dataclass
class Switch:
  """One re-partition: when, from and to which split, what it cost."""

  step: int
  old: tuple[tuple[int, ...], ...]  # Per stage, its node indices' bounds.
  new: tuple[tuple[int, ...], ...]
  seconds: float  # Drain, move and (first time only) build.
  compiled: bool  # A new pipeline was built for the plan.
  build_seconds: float  # Of ``seconds``, building it (0 when seen).


class PlanSwitch:
  """Pipelines of one model under several plans, and moves between them.

  Args:
    build: ``build(plan) -> jpipe.Pipeline`` (the same model, optimizer
      and options; only the partition differs).
    pipeline: the pipeline in use (its plan is the first).
  """

  def __init__(self, build: Callable[[Plan], Pipeline], pipeline: Pipeline):
    self._build = build
    self._pipelines = {plan_key(pipeline.plan): pipeline}
    self.pipeline = pipeline
    self.history: list[Switch] = []

  @property
  def plan(self) -> Plan:
    return self.pipeline.plan

  def seen(self, plan: Plan) -> bool:
    """Whether a pipeline for ``plan`` exists (switching costs no build)."""
    return plan_key(plan) in self._pipelines

  def switch(self, state: PipelineState, plan: Plan) -> PipelineState:
    """Drains ``state``, moves it onto ``plan``; returns the new state
    (``self.pipeline`` is then the plan's pipeline)."""
    start = time.perf_counter()
    old = self.pipeline
    state, _ = old.flush(state)
    saved = old.state_dict(state)
    key = plan_key(plan)
    compiled = key not in self._pipelines
    built = time.perf_counter()
    if compiled:
      self._pipelines[key] = self._build(plan)
    built = time.perf_counter() - built
    new = self._pipelines[key]
    if new.plan.node_names != old.plan.node_names:
      raise ValueError("the new plan is for another model (nodes differ)")
    moved = new.load_state_dict(saved)
    self.pipeline = new
    self.history.append(
      Switch(
        step=int(saved["step"]),
        old=_bounds(old.plan),
        new=_bounds(new.plan),
        seconds=time.perf_counter() - start,
        compiled=compiled,
        build_seconds=built,
      )
    )
    return moved


def _bounds(plan: Plan) -> tuple[tuple[int, ...], ...]:
  """Per stage, (first node, one past its last node)."""
  out = []
  for s in range(plan.num_stages):
    nodes = [i for i, t in enumerate(plan.stage_of_node) if t == s]
    out.append((min(nodes), max(nodes) + 1) if nodes else (0, 0))
  return tuple(out)
