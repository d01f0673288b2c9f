"""What every solver knows of a graph: two frozen values, taken whole.

- ``GraphCosts``: N nodes in a topological order -- each node's compute
  seconds (forward + backward), the bytes on the edges between them, the
  bandwidth between stages, how transfers add to a stage's time
  (``comm_model``), and optionally each node's price on the last stage.
- ``MemoryModel``: each node's bytes and how a stage holds them
  (microbatches in flight, param versions, recomputation) under a
  per-device limit.

``solve_contiguous``, ``solve_acyclic`` and ``solve_mixed`` price a
stage from these alike. With ``t_in = 2 * bytes_in / bandwidth`` and
``t_out`` likewise (the factor 2: activations forward, their gradients
backward; bytes crossing a cut include long skips, so an edge from stage 1
to stage 4 counts as input of stage 4 and output of stage 1), a stage with
compute C takes

- ``"overlapped"`` (PipeDream): ``max(C, t_in, t_out)``;
- ``"ftpipe"`` (FTPipe's partitioner): ``C + max(0, t_in - C) +
  max(0, t_out - C)``, the communication that computation cannot hide;

and holds ``static + (versions - 1) * params + in_flight * kept +
working`` bytes, where ``kept`` is its nodes' activations, or the bytes
entering it when it recomputes.
"""

import dataclasses
from collections.abc import Mapping, Sequence

import numpy as np

COMM_MODELS = ("overlapped", "ftpipe")


class TooFewNodes(ValueError):
  """More stages asked for than the model has nodes to split: the
  message names the most stages possible (the training CLI prints it as
  one line). ``cause``: the message's part before its fixes, and ``most``
  the most stages, where the whole model was traced (None otherwise)."""

  def __init__(self, message: str, cause: str = "", most: int | None = None):
    super().__init__(message)
    self.cause, self.most = cause, most


def stage_seconds(compute, t_in, t_out, comm_model: str):
  """A stage's time from compute and transfer seconds (arrays broadcast)."""
  if comm_model == "overlapped":
    return np.maximum(compute, np.maximum(t_in, t_out))
  with np.errstate(invalid="ignore"):  # inf - inf for empty runs
    return (
      compute
      + np.maximum(0.0, t_in - compute)
      + np.maximum(0.0, t_out - compute)
    )


def per_node(values, n_nodes: int, name: str) -> np.ndarray:
  """``values`` as float64 [n_nodes] (zeros for None), or a clear error."""
  if values is None:
    return np.zeros(n_nodes)
  arr = np.asarray(values, np.float64)
  if arr.shape != (n_nodes,):
    raise ValueError(f"{name} needs {n_nodes} entries, got {arr.shape}")
  return arr


@dataclasses.dataclass(frozen=True)
class GraphCosts:
  """N nodes in a topological order, as the solvers price them.

  Attributes:
    compute_seconds: forward + backward time of each node, float64 [N].
    edges: (src, dst) -> bytes, with src < dst in the order.
    bandwidth: bytes/s between stages; None ignores communication.
    comm_model: "overlapped" or "ftpipe" (see the module docstring).
    last_stage_compute: each node's time when on the last stage, [N]
      (FTPipe's async pipelines: the last stage runs forward and backward
      together and never recomputes); None: ``compute_seconds``.
  """

  compute_seconds: np.ndarray
  edges: Mapping[tuple[int, int], float] = dataclasses.field(
    default_factory=dict
  )
  bandwidth: float | None = None
  comm_model: str = "overlapped"
  last_stage_compute: np.ndarray | None = None

  def __post_init__(self):
    cost = np.asarray(self.compute_seconds, np.float64)
    if cost.ndim != 1:
      raise ValueError(f"compute_seconds must be [N], got shape {cost.shape}")
    n = cost.shape[0]
    if self.bandwidth is not None and self.bandwidth <= 0:
      raise ValueError(f"bandwidth must be > 0 bytes/s, got {self.bandwidth}")
    if self.comm_model not in COMM_MODELS:
      raise ValueError(
        f"unknown comm_model {self.comm_model!r}: one of {COMM_MODELS}"
      )
    edges = dict(self.edges or {})
    for u, v in edges:
      if not 0 <= u < v < n:
        raise ValueError(
          f"edge {(u, v)} does not go forward in the order of {n} nodes"
        )
    object.__setattr__(self, "compute_seconds", cost)
    object.__setattr__(self, "edges", edges)
    if self.last_stage_compute is not None:
      last = per_node(self.last_stage_compute, n, "last_stage_compute")
      object.__setattr__(self, "last_stage_compute", last)

  @property
  def num_nodes(self) -> int:
    return int(self.compute_seconds.shape[0])

  @property
  def last_compute(self) -> np.ndarray:
    """Each node's seconds on the last stage, [N]."""
    if self.last_stage_compute is None:
      return self.compute_seconds
    return self.last_stage_compute

  def permuted(self, order) -> "GraphCosts":
    """The same graph with node ``order[i]`` as node i (``order`` a
    topological order: every edge still goes forward)."""
    order = np.asarray(order)
    position = np.empty(len(order), np.int64)
    position[order] = np.arange(len(order))
    last = self.last_stage_compute
    return dataclasses.replace(
      self,
      compute_seconds=self.compute_seconds[order],
      edges={(position[u], position[v]): w for (u, v), w in self.edges.items()},
      last_stage_compute=None if last is None else last[order],
    )

  def uniform(self) -> "GraphCosts":
    """Compute only: no transfers, the last stage priced like the rest."""
    return GraphCosts(self.compute_seconds)


@dataclasses.dataclass(frozen=True)
class StageBytes:
  """Each stage's predicted bytes in two parts, [S] each: ``persistent``
  (held all along: params, gradients, optimizer state, stashed versions,
  the activations kept for the microbatches in flight) and ``working``
  (one microbatch's programs while they run). A device running several
  stages runs one program at a time: it holds the sum of their
  persistent bytes and the largest working bytes."""

  persistent: np.ndarray
  working: np.ndarray

  @property
  def total(self) -> np.ndarray:
    """Each stage's bytes as if it had its device to itself, [S]."""
    return self.persistent + self.working

  def per_device(self, stage_devices) -> dict[int, float]:
    """Device -> bytes, stage s on the devices ``stage_devices[s]`` (an
    int or a tuple: each replica holds its stage's)."""
    held: dict[int, float] = {}
    peak: dict[int, float] = {}
    for s, devices in enumerate(stage_devices):
      for d in np.atleast_1d(devices):
        d = int(d)
        held[d] = held.get(d, 0.0) + float(self.persistent[s])
        peak[d] = max(peak.get(d, 0.0), float(self.working[s]))
    return {d: held[d] + peak[d] for d in sorted(held)}


@dataclasses.dataclass(frozen=True)
class MemoryModel:
  """Each node's bytes, how a stage holds them, and the limit.

  Attributes:
    static_bytes: per node, memory that does not scale with microbatches
      in flight (params, gradients, optimizer state), [N]; None: zeros
      (as for the other per-node fields).
    activation_bytes: per node, activations kept per microbatch in flight.
    param_bytes: per node, its params' bytes; a stage holding ``versions``
      param versions keeps ``versions - 1`` extra copies (weight stashing).
    working_bytes: per node, memory one microbatch's programs need while
      they run (counted once per stage).
    recompute: a microbatch in flight keeps the bytes entering the stage
      (the graph's edges), else its nodes' ``activation_bytes``.
    limit: bytes per stage (device); None for no limit.
    in_flight: microbatches in flight per stage, [S]; None: ``S - s``
      (1F1B).
    param_versions: param versions per stage, [S], each >= 1; None: one,
      or ``in_flight`` with ``stashing``.
    stashing: without ``param_versions``, each stage keeps a version per
      microbatch in flight (for solvers that choose the stage count).
  """

  static_bytes: Sequence[float] | None = None
  activation_bytes: Sequence[float] | None = None
  param_bytes: Sequence[float] | None = None
  working_bytes: Sequence[float] | None = None
  recompute: bool = False
  limit: float | None = None
  in_flight: Sequence[int] | None = None
  param_versions: Sequence[int] | None = None
  stashing: bool = False

  _PER_NODE = (
    "static_bytes",
    "activation_bytes",
    "param_bytes",
    "working_bytes",
  )

  def nodes(self, n_nodes: int) -> dict[str, np.ndarray]:
    """The per-node fields as float64 [n_nodes] arrays (zeros for None)."""
    return {k: per_node(getattr(self, k), n_nodes, k) for k in self._PER_NODE}

  def permuted(self, order) -> "MemoryModel":
    """The same model with node ``order[i]`` as node i."""
    return dataclasses.replace(
      self,
      **{
        k: np.asarray(getattr(self, k))[np.asarray(order)]
        for k in self._PER_NODE
        if getattr(self, k) is not None
      },
    )

  def flight(self, num_stages: int) -> np.ndarray:
    """Microbatches in flight per stage, float64 [num_stages]."""
    flight = np.asarray(
      self.in_flight
      if self.in_flight is not None
      else [num_stages - s for s in range(num_stages)],
      np.float64,
    )
    if flight.shape != (num_stages,):
      raise ValueError(f"in_flight needs {num_stages} entries")
    return flight

  def versions(self, num_stages: int, flight=None) -> np.ndarray:
    """Param versions per stage, float64 [num_stages] (``flight``: the
    in-flight counts stashing follows; default ``self.flight``)."""
    if self.param_versions is not None:
      versions = np.asarray(self.param_versions, np.float64)
    elif self.stashing:
      flight = self.flight(num_stages) if flight is None else flight
      versions = np.asarray(flight, np.float64)
    else:
      versions = np.ones(num_stages)
    if versions.shape != (num_stages,) or np.any(versions < 1):
      raise ValueError(f"param_versions needs {num_stages} entries >= 1")
    return versions

  def bytes_of(self, stage_of, edges, flight=None) -> StageBytes:
    """Bytes of each stage, nodes assigned by ``stage_of`` [N], ``edges``
    the graph's (what a recomputing stage keeps: its inputs); ``flight``
    per stage overrides ``in_flight``."""
    of = np.asarray(stage_of)
    count = int(of.max()) + 1
    flight = (
      self.flight(count) if flight is None else np.asarray(flight, np.float64)
    )
    versions = self.versions(count, flight)
    node = self.nodes(len(of))

    def per_stage(x):
      return np.bincount(of, weights=x, minlength=count)

    if self.recompute:  # The bytes entering each stage.
      kept = np.zeros(count)
      for (u, v), w in edges.items():
        if of[u] != of[v]:
          kept[of[v]] += w
    else:
      kept = per_stage(node["activation_bytes"])
    return StageBytes(
      per_stage(node["static_bytes"])
      + (versions - 1.0) * per_stage(node["param_bytes"])
      + flight * kept,
      per_stage(node["working_bytes"]),
    )

  def stage_bytes(self, bounds, edges, flight=None) -> StageBytes:
    """``bytes_of`` for contiguous stages ``bounds`` (0, b1, ..., N)."""
    b = np.asarray(bounds)
    return self.bytes_of(
      np.repeat(np.arange(len(b) - 1), np.diff(b)), edges, flight
    )


class MemoryLimitError(ValueError):
  """A plan or pipeline predicted not to fit its memory limit (the message
  names the fixes): no split under the limit, or a given split over it."""


@dataclasses.dataclass(frozen=True)
class MemoryBudget:
  """What a device may hold, and how a pipeline holds a traced model's
  bytes: ``plan_traced``'s memory, turned into each node's bytes by
  ``model``.

  Attributes:
    limit: bytes per device; None for no limit.
    optimizer_state_factor: optimizer state per parameter byte (2 for
      Adam's two moments, 1 for momentum SGD); gradients add one more.
    in_flight: microbatches in flight per stage of a pipeline of one
      stage per device, [S] (default ``S - s``, 1F1B).
    param_versions: param versions per stage, [S] (default 1; weight
      stashing keeps ``S - s``).
    recompute: a microbatch in flight keeps only the stage's inputs (the
      backward recomputes), else every value its nodes compute.
  """

  limit: float | None = None
  optimizer_state_factor: float = 2.0
  in_flight: Sequence[int] | None = None
  param_versions: Sequence[int] | None = None
  recompute: bool = False

  def model(self, param_bytes, value_bytes) -> MemoryModel:
    """The per-node model for nodes with these param and value bytes, [N]
    each: static bytes are params, gradients and optimizer state; one
    microbatch's values and the unpacked gradients count once more, as
    the programs' working memory (upper bounds: XLA fuses and frees)."""
    params = np.asarray(param_bytes, np.float64)
    values = np.asarray(value_bytes, np.float64)
    return MemoryModel(
      static_bytes=params * (2.0 + self.optimizer_state_factor),
      activation_bytes=values,
      param_bytes=params,
      working_bytes=values + params,
      recompute=self.recompute,
      limit=self.limit,
      in_flight=self.in_flight,
      param_versions=self.param_versions,
    )

  def per_stage_counts_for(self, num_stages: int) -> "MemoryBudget":
    """This budget for a plan of ``num_stages`` stages: its per-stage
    counts where they are that many, else the defaults (a plan of
    another stage count: mixed, replicated)."""
    fits = lambda x: x is not None and len(x) == num_stages  # noqa: E731
    return dataclasses.replace(
      self,
      in_flight=self.in_flight if fits(self.in_flight) else None,
      param_versions=self.param_versions if fits(self.param_versions) else None,
    )

  @property
  def stashing(self) -> bool:
    """Whether some stage keeps more than one param version."""
    return self.param_versions is not None and max(self.param_versions) > 1
