"""DynPipe's slowdown predictor: a random forest over per-stage features.

How much an interfering job slows a stage depends on what the stage
computes, so DynPipe predicts each candidate stage's slowdown on a device
instead of assuming the device's measured one for any layers:
``sigma = RF([device metrics || stage features])``, trained on runs
with injected interference. jpipe's counterpart, on data it collects
itself (``collect``: the same pipeline on several splits, with
``Interference`` slowing its devices by known factors):

- stage features (``node_features`` summed over a stage's nodes, as
  DynPipe's prefix differences; ``range_features`` for every node range):
  FLOPs, parameter bytes, equations, matrix products, convolutions,
  nonlinearities, pooling, nodes, and the bytes it receives from earlier
  stages and sends to later ones (DynPipe: MACs, parameters, #ReLU,
  #Linear, #Conv2d, #MaxPool2d);
- device metrics: what jpipe sees of the device in a window -- the
  slowdown the stage now on it shows and that stage's features (DynPipe's
  nsys GPU metrics likewise see the device with its current stage on it);
- label: the candidate stage's slowdown on that device (its seconds per
  microbatch there over its seconds unslowed).

A stage's fixed cost (dispatch, transfers) does not slow with its
device under a sleep-like interference, so a small stage reads a smaller
slowdown than a large one on the same device: the forest learns that
from the data; the measured rule cannot. ``SlowdownPredictor.fit`` is
DynPipe's ``RandomForestRegressor(n_estimators=500, random_state=42)``
with a 70/30 held-out check (reported against the measured rule), then
refit on all samples. Files are pickles (as DynPipe's ``rf.pkl``): load
only files you wrote.
"""

import dataclasses
import json
import math
import pickle
from collections.abc import Callable, Sequence

import jax.extend.core as jcore
import numpy as np

from jpipe.dynamic._measure import stage_seconds_per_microbatch
from jpipe.dynamic._replan import jpipe_split
from jpipe.runtime import Slowdown

NODE_FEATURES = (
  "flops",
  "param_bytes",
  "equations",
  "matmuls",
  "convolutions",
  "nonlinearities",
  "pooling",
  "nodes",
)
STAGE_FEATURES = (*NODE_FEATURES, "bytes_in", "bytes_out")
FORMAT = "jpipe-slowdown-predictor/1"

_NONLINEAR = {
  "max",
  "tanh",
  "logistic",
  "exp",
  "exp2",
  "erf",
  "log",
  "log1p",
  "rsqrt",
  "sqrt",
  "integer_pow",
  "pow",
}


def _count(eqn, counts: np.ndarray) -> None:
  """Adds an equation's counts by kind (``NODE_FEATURES[2:7]``) into
  ``counts``; for pjit, custom_jvp (relu), remat: what runs inside."""
  inner = list(jcore.jaxprs_in_params(eqn.params))
  if inner:
    for jaxpr in inner:
      for e in getattr(jaxpr, "jaxpr", jaxpr).eqns:
        _count(e, counts)
    return
  name = eqn.primitive.name
  counts[0] += 1
  counts[1] += name == "dot_general"
  counts[2] += name == "conv_general_dilated"
  counts[3] += name in _NONLINEAR
  counts[4] += name.startswith("reduce_window")


def node_features(traced) -> np.ndarray:
  """Per node of a ``jpipe.partition.TracedModel``, ``NODE_FEATURES``,
  float64 [num_nodes, 8]."""
  counts = np.zeros((traced.num_nodes, 5))
  for eqn, node in zip(traced.jaxpr.eqns, traced.eqn_node, strict=True):
    _count(eqn, counts[node])
  return np.column_stack(
    [
      traced.node_flops(),
      traced.node_param_bytes(),
      counts,
      np.ones(traced.num_nodes),
    ]
  )


def range_features(node_feats, edges=None) -> np.ndarray:
  """Every contiguous node range's ``STAGE_FEATURES``.

  Args:
    node_feats: ``node_features``, [N, 8].
    edges: (producer node, consumer node) -> bytes
      (``TracedModel.edges()``); None: no transfers.

  Returns:
    float64 [N + 1, N + 1, 10]; ``[lo, hi]`` is nodes ``lo:hi`` as a stage
    (meaningful for lo < hi): sums of the node features, then bytes
    received from nodes before ``lo`` and sent to nodes from ``hi`` on.
  """
  feats = np.asarray(node_feats, np.float64)
  n = feats.shape[0]
  prefix = np.concatenate([np.zeros((1, feats.shape[1])), feats.cumsum(0)])
  sums = prefix[None, :, :] - prefix[:, None, :]  # [lo, hi] = hi - lo
  lo = np.arange(n + 1)[:, None]
  hi = np.arange(n + 1)[None, :]
  bytes_in = np.zeros((n + 1, n + 1))
  bytes_out = np.zeros((n + 1, n + 1))
  for (src, dst), size in (edges or {}).items():
    # Received: the consumer is inside, the producer before it.
    bytes_in += size * ((src < lo) & (lo <= dst) & (dst < hi))
    # Sent: the producer is inside, the consumer after it.
    bytes_out += size * ((lo <= src) & (src < hi) & (hi <= dst))
  return np.concatenate([sums, bytes_in[..., None], bytes_out[..., None]], -1)


def sample_features(observed, current, candidate) -> np.ndarray:
  """The forest's input rows: ``[observed slowdown, current stage's
  features, candidate stage's features, candidate / current FLOPs and
  nodes]``.

  Args:
    observed: [...], the slowdown the device shows with its current
      stage.
    current, candidate: [..., 10] ``STAGE_FEATURES``.

  Returns:
    float64 [..., 23].
  """
  observed = np.asarray(observed, np.float64)
  current = np.asarray(current, np.float64)
  candidate = np.asarray(candidate, np.float64)
  current, candidate = np.broadcast_arrays(current, candidate)
  observed = np.broadcast_to(observed, current.shape[:-1])
  relative = np.stack(
    [
      candidate[..., 0] / np.maximum(current[..., 0], 1.0),
      candidate[..., 7] / np.maximum(current[..., 7], 1.0),
    ],
    -1,
  )
  return np.concatenate([observed[..., None], current, candidate, relative], -1)


@dataclasses.dataclass(frozen=True)
class Measurements:
  """Collected stage times (``collect``).

  Attributes:
    splits: the measured splits' boundaries, K of them.
    factors: the injected slowdown factors, [F] (all > 1).
    reference: per split and stage slot, seconds per microbatch
      unslowed, [K, S].
    slowed: the same with the slot's device slowed by each factor,
      [K, F, S].
    features: per split and slot, the stage's ``STAGE_FEATURES``,
      [K, S, 10].
  """

  splits: tuple[tuple[int, ...], ...]
  factors: np.ndarray
  reference: np.ndarray
  slowed: np.ndarray
  features: np.ndarray

  def samples(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(x, y, observed)``: every (split A, split B, slot, factor): the
    slot's slowdown under A with A's and B's stage features ->
    its slowdown under B. ``observed`` is A's slowdown (the measured
    rule's prediction for B)."""
    ratio = self.slowed / self.reference[:, None, :]  # [K, F, S]
    k, f, s = ratio.shape
    a, b, fi, si = np.meshgrid(
      np.arange(k), np.arange(k), np.arange(f), np.arange(s), indexing="ij"
    )
    a, b, fi, si = (v.ravel() for v in (a, b, fi, si))
    observed = ratio[a, fi, si]
    x = sample_features(observed, self.features[a, si], self.features[b, si])
    return x, ratio[b, fi, si], observed

  def to_json(self) -> str:
    return json.dumps(
      {
        "splits": [list(b) for b in self.splits],
        "factors": self.factors.tolist(),
        "reference": self.reference.tolist(),
        "slowed": self.slowed.tolist(),
        "features": self.features.tolist(),
      }
    )

  @classmethod
  def from_json(cls, text: str) -> "Measurements":
    d = json.loads(text)
    return cls(
      tuple(tuple(b) for b in d["splits"]),
      np.asarray(d["factors"], np.float64),
      np.asarray(d["reference"], np.float64),
      np.asarray(d["slowed"], np.float64),
      np.asarray(d["features"], np.float64),
    )


class SlowdownPredictor:
  """A fitted forest: ``predict(x)`` for ``sample_features`` rows.

  ``info``: what it was fitted on (samples, held-out mean absolute
  errors of the forest and of the measured rule, the model's name).
  """

  def __init__(self, forest, info: dict):
    self.forest = forest
    self.info = dict(info)

  @classmethod
  def fit(
    cls,
    measurements: Measurements,
    *,
    n_estimators: int = 500,
    seed: int = 42,
    test_fraction: float = 0.3,
    **info,
  ) -> "SlowdownPredictor":
    """DynPipe's forest on ``measurements.samples()``: a held-out check
    first (``test_fraction`` of the samples, seeded), then refit on all.
    """
    from sklearn.ensemble import RandomForestRegressor

    x, y, observed = measurements.samples()
    if len(y) < 4:
      raise ValueError(
        f"{len(y)} samples are too few to fit a slowdown predictor: collect "
        "more splits or factors"
      )
    order = np.random.default_rng(seed).permutation(len(y))
    cut = max(1, int(round(len(y) * (1 - test_fraction))))
    train, test = order[:cut], order[cut:]

    def forest():
      return RandomForestRegressor(
        n_estimators=n_estimators, random_state=seed, n_jobs=1
      )

    checked = forest().fit(x[train], y[train])
    errors = {}
    if len(test):
      errors = {
        "heldout_mae": float(
          np.mean(np.abs(checked.predict(x[test]) - y[test]))
        ),
        "heldout_mae_measured_rule": float(
          np.mean(np.abs(observed[test] - y[test]))
        ),
      }
    return cls(
      forest().fit(x, y),
      {"samples": int(len(y)), "factors": measurements.factors.tolist()}
      | errors
      | info,
    )

  def predict(self, x) -> np.ndarray:
    """Slowdowns for ``sample_features`` rows, [...]."""
    x = np.asarray(x, np.float64)
    return self.forest.predict(x.reshape(-1, x.shape[-1])).reshape(x.shape[:-1])

  def save(self, path: str) -> None:
    with open(path, "wb") as f:
      pickle.dump(
        {
          "format": FORMAT,
          "features": STAGE_FEATURES,
          "forest": self.forest,
          "info": self.info,
        },
        f,
      )

  @classmethod
  def load(cls, path: str) -> "SlowdownPredictor":
    """Reads a ``save``d predictor (a pickle: only files you wrote)."""
    try:
      with open(path, "rb") as f:
        d = pickle.load(f)
    except (OSError, pickle.UnpicklingError, EOFError) as e:
      raise ValueError(
        f"cannot read a slowdown predictor from {path!r} ({e}); write one "
        "with `python -m jpipe.train.slowdowns --config ... --out PATH`"
      ) from None
    if not isinstance(d, dict) or d.get("format") != FORMAT:
      raise ValueError(
        f"{path!r} is not a jpipe slowdown predictor ({FORMAT}); write one "
        "with `python -m jpipe.train.slowdowns --config ... --out PATH`"
      )
    if tuple(d["features"]) != STAGE_FEATURES:
      raise ValueError(
        f"{path!r} was fitted on other stage features {d['features']}; "
        "collect and fit it again with this version"
      )
    return cls(d["forest"], d["info"])


def collect(
  dyn,
  state,
  batch_at: Callable[[int], object],
  *,
  factors: Sequence[float] = (1.5, 2.0, 3.0, 4.0),
  num_splits: int = 8,
  steps_per_window: int = 3,
  seed: int = 0,
  progress: Callable[[str], None] | None = None,
):
  """Measures stage times on several splits with injected slowdowns.

  The splits: the one in force, jpipe's split for each slot slowed by
  each factor (where the controller will look), then seeded random ones,
  ``num_splits`` in all (fewer when the model has fewer). On each: a
  warm-up window (compilation), an unslowed reference window, then one
  window per factor, the factors rotated over the devices (each slot
  sees each factor once). A window is ``steps_per_window`` training
  steps (they train: the state moves on), each profiled, their stage
  times averaged.

  Args:
    dyn: a ``DynamicPipeline`` (its ``Interference`` is driven here;
      use policy "static").
    state: its state; returned moved on.
    batch_at: step -> batch.
    factors: slowdown factors, each > 1.

  Returns:
    ``(state, Measurements)``; the pipeline is back on its first split.
  """
  factors = np.asarray(sorted(set(float(f) for f in factors)), np.float64)
  if factors.size == 0 or np.any(factors <= 1.0):
    raise ValueError(f"factors must be > 1, got {factors.tolist()}")
  if steps_per_window < 1:
    raise ValueError(f"steps_per_window must be >= 1, got {steps_per_window}")
  first = dyn.boundaries
  stages = len(first) - 1
  splits = _splits_to_measure(dyn, first, factors, num_splits, seed)
  windows = _Windows(dyn, state, batch_at, steps_per_window, stages)
  interference = dyn.interference
  reference = np.zeros((len(splits), stages))
  slowed = np.zeros((len(splits), factors.size, stages))
  saved = interference.slowdowns
  try:
    for k, split in enumerate(splits):
      windows.state = dyn.move_to(windows.state, split)
      reference[k], slowed[k] = windows.measure_split(factors)
      if progress is not None:
        progress(f"split {k + 1}/{len(splits)} {list(split)} measured")
  finally:
    interference.slowdowns = saved
  state = dyn.move_to(windows.state, first)
  stage_feats = np.stack(
    [boundaries_of_features(dyn.features, b) for b in splits]
  )
  return state, Measurements(
    tuple(splits), factors, reference, slowed, stage_feats
  )


class _Windows:
  """Measurement windows on the split in force: each ``steps_per_window``
  profiled training steps (they train: ``state`` moves on)."""

  def __init__(self, dyn, state, batch_at, steps_per_window, stages):
    self.dyn, self.state, self.batch_at = dyn, state, batch_at
    self.steps_per_window, self.stages = steps_per_window, stages
    self.step = 0
    self.interference = dyn.interference

  def measure(self) -> np.ndarray:
    """Per stage, seconds per microbatch: the mean over the window's
    steps, each profiled (one profiled step is a noisy sample)."""
    self.interference.take_slept()
    seconds = np.zeros(self.stages)
    for _ in range(self.steps_per_window):
      self.state, metrics = self.dyn.pipeline.step(
        self.state, self.batch_at(self.step), profile=True
      )
      self.step += 1
      seconds += stage_seconds_per_microbatch(
        metrics["timeline"], self.interference.take_slept(), self.stages
      )
    return seconds / self.steps_per_window

  def measure_split(self, factors) -> tuple[np.ndarray, np.ndarray]:
    """On the split in force: a warm-up window, the unslowed reference
    (per stage) and, per factor, each stage's time slowed by it
    ([factor, stage]); the factors rotate over the devices, so each
    stage sees each factor once."""
    interference, stages = self.interference, self.stages
    devices = list(interference.stage_devices)
    interference.slowdowns = ()
    self.measure()  # Compiles a new split's programs, refills the stream.
    reference = self.measure()
    if interference.model_seconds is None:
      # Without simulated compute a slowed device sleeps its extra
      # share of the model's measured time.
      interference.model_seconds = float(reference.sum())
    slowed = np.zeros((factors.size, stages))
    for j in range(factors.size):
      interference.slowdowns = tuple(
        Slowdown(devices[s], float(factors[(s + j) % factors.size]), 0)
        for s in range(stages)
      )
      seconds = self.measure()
      for s in range(stages):
        slowed[(s + j) % factors.size, s] = seconds[s]
    return reference, slowed


def _splits_to_measure(dyn, first, factors, num_splits, seed):
  n = len(dyn.forward)
  stages = len(first) - 1
  splits = [tuple(first)]
  for s in range(stages):
    for f in factors:
      sigma = np.ones(stages)
      sigma[s] = f
      b, _ = jpipe_split(dyn.forward, dyn.backward, sigma)
      if b not in splits:
        splits.append(b)
  splits = splits[:num_splits]
  rng = np.random.default_rng(seed)
  possible = _count_splits(n, stages)
  while len(splits) < min(num_splits, possible):
    cuts = np.sort(rng.choice(np.arange(1, n), stages - 1, replace=False))
    b = (0, *(int(c) for c in cuts), n)
    if b not in splits:
      splits.append(b)
  return splits


def _count_splits(nodes, stages) -> int:
  return math.comb(nodes - 1, stages - 1)


def boundaries_of_features(features, boundaries) -> np.ndarray:
  """Per stage of ``boundaries``, its features: [S, 10]."""
  b = np.asarray(boundaries)
  return features[b[:-1], b[1:]]
