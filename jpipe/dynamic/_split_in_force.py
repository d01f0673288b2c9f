"""The split in force of a ``DynamicPipeline``: the planning model on it
(``NodeTimes`` read for the split in force, as the policies ask) and
switching it (``PlanSwitch``), with what a switch costs and records.

A base class of ``DynamicPipeline`` (``_controller.py``), which sets what
is read here: ``nodes`` (``NodeTimes``), ``switch`` (``PlanSwitch``),
``pipeline`` / ``boundaries`` (in force), ``costs``, ``groups`` (each
slot's devices), ``build_seconds``, ``compile_seconds``, ``calls``,
``high`` / ``low``, ``policy`` and ``history``.
"""

import dataclasses

import numpy as np

from jpipe import partition as partition_lib
from jpipe.dynamic._policies import Decision
from jpipe.dynamic._trigger import clamped_ratios
from jpipe.runtime import PipelineState


class SplitInForce:
  """The planning model on the split in force, and switching it."""

  @property
  def forward(self) -> np.ndarray:
    """Per node, forward seconds per microbatch (calibrated)."""
    return self.nodes.forward

  @property
  def backward(self) -> np.ndarray:
    """Per node, backward seconds per microbatch (calibrated)."""
    return self.nodes.backward

  @property
  def features(self) -> np.ndarray:
    """``NodeTimes.features``: every node range's stage features."""
    return self.nodes.features

  def best_split(self, sigma) -> tuple[tuple[int, ...], np.ndarray]:
    """``NodeTimes.best_split`` for slowdowns seen on the split in force."""
    return self.nodes.best_split(sigma, self.boundaries)

  def on_replicas(self, slowdown):
    """``NodeTimes.on_replicas``: a slot slowdown as its stage's factor
    on one device's node times."""
    return self.nodes.on_replicas(slowdown)

  def slowdowns_of(self, observed):
    """``NodeTimes.slowdowns_of`` for slowdowns seen on the split in force."""
    return self.nodes.slowdowns_of(observed, self.boundaries)

  def predict_measured(self, stage_seconds) -> float:
    """``NodeTimes.predict_measured`` of the split in force."""
    return self.nodes.predict_measured(stage_seconds, self.boundaries)

  def predict(self, boundaries, sigma, forward=None, backward=None) -> float:
    """``NodeTimes.predict``: seconds per call of a split under ``sigma``."""
    return self.nodes.predict(boundaries, sigma, forward, backward)

  def switch_cost(self, boundaries) -> float:
    """Seconds a switch to ``boundaries`` costs: draining and moving
    (measured at the last switch; before one, bounded by a build), plus,
    for a plan not seen before, building its pipeline and compiling its
    programs (measured on the last new pipeline's first call)."""
    move = (
      self.build_seconds if self._move_seconds is None else self._move_seconds
    )
    new_pipeline = self.build_seconds + self.compile_seconds
    seen = self.switch.seen(self._plan(boundaries))
    return move + (0.0 if seen else new_pipeline)

  def start_at(self, calls: int) -> None:
    """Counts calls from ``calls`` (a resumed run: injected slowdowns
    and windows follow the run's steps). Measurement starts afresh: its
    warm-up, then a reference window on the split in force."""
    self.calls = int(calls)

  def move_to(self, state: PipelineState, boundaries) -> PipelineState:
    """Switches to the split ``boundaries`` (e.g. the plan a checkpoint
    recorded) without a decision; the plan then assumes no slowdown."""
    boundaries = tuple(int(b) for b in boundaries)
    if boundaries == self.boundaries:
      return state
    rows = self.pipeline.replica_rows
    state = self.switch.switch(state, self._plan(boundaries))
    self._keep_rows(rows)
    self._place()
    return state

  def _keep_rows(self, rows) -> None:
    """Each weighted slot's split as it was before a switch (the slots
    keep their devices, so their speeds)."""
    for s, r in rows.items():
      if self.pipeline.replica_rows.get(s) != r:
        self.pipeline.set_replica_rows(s, r)

  def _plan(self, boundaries) -> partition_lib.Plan:
    plan = partition_lib.plan_from_boundaries(
      self.pipeline.traced,
      self.costs,
      boundaries,
      devices=[g[0] for g in self.groups],
      stage_slowdown=[1.0 / len(g) for g in self.groups],
    )
    return dataclasses.replace(plan, stage_devices=self.groups)

  def _switch_to(self, state, decision: Decision, window):
    old, rows = self.boundaries, self.pipeline.replica_rows
    state = self.switch.switch(state, self._plan(decision.boundaries))
    self._keep_rows(rows)
    done = self.switch.history[-1]
    self._move_seconds = done.seconds - done.build_seconds
    self._fresh = done.compiled
    # What the new split's slots should show from now on (the forest's
    # prediction, or the measured slowdowns), as the trigger reads them.
    expected = np.asarray(decision.expected_sigma)
    self.assumed = clamped_ratios(
      expected, np.ones_like(expected), self.high, self.low
    )
    self.policy.switched()
    self._place()
    record = _switch_record(self.calls, old, decision, window, done)
    self.history.append(record)
    return state, record


def _switch_record(calls, old, decision: Decision, window, done) -> dict:
  """What a re-partition logs: when, the splits, the slowdowns seen and
  expected, the predicted and measured step times, what it cost."""
  return {
    "step": calls,
    "old": list(old),
    "new": list(decision.boundaries),
    "sigma": list(decision.sigma),
    "expected_sigma": list(decision.expected_sigma),
    "predicted_old_seconds": decision.old_seconds,
    "predicted_new_seconds": decision.new_seconds,
    "measured_seconds": window.step_seconds,
    "switch_seconds": done.seconds,
    "compiled": done.compiled,
  }
