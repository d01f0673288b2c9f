"""Per-node seconds, and what a split of the nodes costs under slowdowns.

DynPipe's planning model, apart from the controller that measures and
switches: every node's forward and backward seconds per microbatch (the
cost model's until a reference window calibrates them: each stage's
measured seconds split among its nodes in the cost model's proportions),
and from them the best split for given slot slowdowns, the slowdowns a
candidate split's stages will show (measured, or predicted by DynPipe's
random forest), and a split's step time by jpipe's event simulator on
the schedule in use.
"""

import numpy as np

from jpipe.dynamic._predictor import (
  SlowdownPredictor,
  node_features,
  range_features,
  sample_features,
)
from jpipe.dynamic._replan import (
  jpipe_split,
  minmax_split,
  predicted_step_seconds,
  stage_costs,
)
from jpipe.schedule import STREAMS


class NodeTimes:
  """Per node, seconds per microbatch (``forward``, ``backward``: [N]),
  and the predictions re-planning uses.

  Args:
    costs: the cost model's ``jpipe.partition`` node costs.
    traced: the traced model (the forest's node features).
    schedule_name, num_microbatches: the schedule in use and its
      microbatches per call (what ``predict`` simulates).
    predictor: a fitted ``SlowdownPredictor``, or None (a slot's measured
      slowdown applies to whatever it holds).
    replicas: per stage slot, the devices its stage is replicated on
      (PipeDream's hybrid plans; each microbatch split among them): the
      slot runs its nodes that many times faster. Node times are one
      device's; a slot's are divided by its replicas. Default: 1 each.
  """

  def __init__(
    self,
    costs,
    traced,
    schedule_name: str,
    num_microbatches: int,
    predictor: SlowdownPredictor | None = None,
    replicas=None,
  ):
    self.forward = np.array(costs.forward_seconds, np.float64)
    self.backward = np.array(costs.backward_seconds, np.float64)
    self.total = float(np.sum(self.forward + self.backward))
    if self.total <= 0:
      raise ValueError("the cost model gives the model no cost to split by")
    # Each node's share of the model's time by the cost model (what an
    # injected slowdown of a stage is proportioned by).
    self.shares = (self.forward / self.total, self.backward / self.total)
    self.traced, self.predictor = traced, predictor
    # The schedule a predicted step time simulates.
    self.schedule_name, self.num_microbatches = schedule_name, num_microbatches
    self.replicas = None if replicas is None else np.asarray(replicas, float)
    self.calibrated = False  # Until the reference window.
    self._features = None  # (Computed when first needed.)

  def calibrate(self, boundaries, per_micro) -> None:
    """The reference window: each stage's measured seconds per
    microbatch (``per_micro``, under split ``boundaries``), split among
    its nodes as the cost model proportions them (a stage the model
    gives no cost: evenly), as one device's (times the slot's
    replicas)."""
    b = boundaries
    per_micro = np.asarray(per_micro, np.float64) * self._speed(len(b) - 1)
    cost = self.forward + self.backward
    for s, (lo, hi) in enumerate(zip(b[:-1], b[1:], strict=True)):
      part = cost[lo:hi]
      weights = (
        part / part.sum() if part.sum() > 0 else np.full(hi - lo, 1 / (hi - lo))
      )
      seconds = per_micro[s] * weights
      with np.errstate(invalid="ignore", divide="ignore"):
        f_share = np.where(part > 0, self.forward[lo:hi] / part, 0.5)
      self.forward[lo:hi] = seconds * f_share
      self.backward[lo:hi] = seconds * (1 - f_share)
    self.total = float(np.sum(self.forward + self.backward))
    self.calibrated = True

  def stage_seconds(self, boundaries) -> np.ndarray:
    """[S]: each stage's seconds per microbatch (forward + backward) on
    its slot's replicas."""
    return stage_costs(self.forward + self.backward, boundaries) / self._speed(
      len(boundaries) - 1
    )

  def _speed(self, stages: int) -> np.ndarray:
    """[S]: how many times faster than one device each slot runs."""
    return np.ones(stages) if self.replicas is None else self.replicas

  def on_replicas(self, slowdown):
    """A slot slowdown (array, or a function of a split giving one) as
    the factor its stage's one-device time takes: divided by the slot's
    replicas."""
    if callable(slowdown):
      return lambda split: self.on_replicas(slowdown(split))
    slowdown = np.asarray(slowdown, np.float64)
    return slowdown / self._speed(len(slowdown))

  @property
  def features(self) -> np.ndarray:
    """Every node range's stage features (``range_features``, [N + 1,
    N + 1, 10]; computed once, when first needed: the forest's input and
    ``collect``'s)."""
    if self._features is None:
      nodes = node_features(self.traced)
      self._features = range_features(nodes, self.traced.edges())
    return self._features

  def best_split(self, sigma, current) -> tuple[tuple[int, ...], np.ndarray]:
    """jpipe's split for the slots' slowdowns ``sigma`` (observed on the
    split ``current``): the exact min-max split (range-dependent stage
    times under the forest), and the slowdowns its slots should show."""
    if self.predictor is None:
      new, _ = jpipe_split(self.forward, self.backward, self.on_replicas(sigma))
      return new, np.asarray(sigma, np.float64)
    table = self._slowdown_table(sigma, current)
    speed = self._speed(len(sigma))[:, None, None]
    new, _ = minmax_split(self._range_seconds(table) / speed)
    return new, _of_split(table, new)

  def slowdowns_of(self, observed, current):
    """split -> the slowdowns its stages will show: the forest's (one
    call for every node range), or (measured rule) each slot's
    ``observed`` one (observed on the split ``current``)."""
    if self.predictor is None:
      return lambda split: np.asarray(observed, np.float64)
    table = self._slowdown_table(observed, current)
    return lambda split: _of_split(table, split)

  def _slowdown_table(self, observed, current) -> np.ndarray:
    """[S, N + 1, N + 1]: nodes lo:hi as stage s, their slowdown on slot
    s's device: the forest's where the slot is slowed (all ranges in one
    call), its observed factor where not (1, or a speed-up)."""
    n = len(self.forward)
    lo, hi = np.triu_indices(n + 1, 1)
    out = np.ones((len(observed), n + 1, n + 1))
    for s, x in enumerate(observed):
      out[s] = x
      if x > 1.0:
        cur = self.features[current[s], current[s + 1]]
        rows = sample_features(x, cur, self.features[lo, hi])
        out[s][lo, hi] = np.maximum(self.predictor.predict(rows), 1.0)
    return out

  def _range_seconds(self, table) -> np.ndarray:
    """[S, N + 1, N + 1]: nodes lo:hi as stage s, their calibrated
    seconds times their slowdown on slot s's device (``table``, from
    ``_slowdown_table``)."""
    prefix = np.concatenate([[0.0], np.cumsum(self.forward + self.backward)])
    return (prefix[None, :] - prefix[:, None])[None] * table

  def predict_measured(self, stage_seconds, boundaries) -> float:
    """Seconds per call of the split ``boundaries`` from its measured
    stage seconds per microbatch (split into forward and backward as its
    nodes' calibrated times are)."""
    b = boundaries
    f, bwd = stage_costs(self.forward, b), stage_costs(self.backward, b)
    share = f / np.maximum(f + bwd, 1e-300)
    stages = tuple(range(len(b)))
    t = np.asarray(stage_seconds, np.float64)
    # Measured on the replicas already: a slowdown of r cancels predict's
    # division by them.
    speed = self._speed(len(b) - 1)
    return self.predict(stages, speed, t * share, t * (1 - share))

  def predict(self, boundaries, sigma, forward=None, backward=None) -> float:
    """Seconds per call of the split under ``sigma`` (jpipe's simulator
    on the calibrated node times, or on ``forward`` / ``backward`` node
    times, each slot's divided by its replicas). A streaming schedule has
    no fill or drain per call: its steady state is a long 1F1B's time per
    microbatch."""
    sigma = self.on_replicas(sigma)
    forward = self.forward if forward is None else forward
    backward = self.backward if backward is None else backward
    m = self.num_microbatches
    if self.schedule_name in STREAMS:
      long = 8 * len(boundaries)
      per_call = predicted_step_seconds(
        forward,
        backward,
        boundaries,
        sigma,
        schedule="1f1b",
        microbatches=long,
      )
      return m / long * per_call
    return predicted_step_seconds(
      forward,
      backward,
      boundaries,
      sigma,
      schedule=self.schedule_name,
      microbatches=m,
    )


def _of_split(table, split) -> np.ndarray:
  """Per stage of ``split``, its entry of a [S, N + 1, N + 1] table."""
  b = np.asarray(split)
  return table[np.arange(len(b) - 1), b[:-1], b[1:]]
