"""Plan: the partitioner's result, frozen and JSON-serialisable."""

import dataclasses
import json
import re
import warnings
from collections.abc import Mapping, Sequence
from typing import Any

import jax.extend.core as jcore
import numpy as np

from jpipe.partition._acyclic import solve_acyclic
from jpipe.partition._contiguous import solve_contiguous
from jpipe.partition._cost_model import (
  GraphCosts,
  MemoryBudget,
  MemoryLimitError,
  StageBytes,
  TooFewNodes,
)
from jpipe.partition._graph_txt import ProfileGraph
from jpipe.partition._mixed import solve_mixed
from jpipe.partition._pipedream import PipeDreamSolution, solve_pipedream
from jpipe.partition._profile import NodeCosts
from jpipe.partition._trace import TracedModel

METHODS = ("contiguous", "acyclic", "mixed", "pipedream", "pipedream_hybrid")


def steady_state_delay(num_stages: int, stage: int) -> int:
  """Steps between a microbatch's forward and the step applying its
  gradient on ``stage`` of a ``num_stages`` asynchronous 1F1B pipeline in
  steady state (step every backward): ``n - 1 - s``, the stage's warm-up
  forwards. Weight stashing keeps that many extra param versions. A
  replicated stage splits each microbatch among its replicas, so its
  delay is its unreplicated one (PipeDream's 1F1B-RR instead deals whole
  microbatches round-robin: ``(R - 1 - first device) // replicas``)."""
  if not 0 <= stage < num_stages:
    raise ValueError(f"stage {stage} is not in 0..{num_stages - 1}")
  return num_stages - 1 - stage


# A slowest stage of one node this many times the even share is reported
# (``Plan.indivisible_note``): the ratio the tests hold balanced splits to.
INDIVISIBLE_FACTOR = 1.3


@dataclasses.dataclass(frozen=True)
class Plan:
  """Which node goes to which stage, where stages run, what they cost.

  Times are seconds per microbatch; memory is bytes. Stage s of n holds
  ``n - s`` microbatches in flight under 1F1B, and ``n - 1 - s`` extra
  param versions under weight stashing.

  Attributes:
    method: the solver that made it.
    node_names: node names, in the order of ``stage_of_node``.
    stage_of_node: stage index of every node (non-decreasing for straight
      pipelines).
    stage_devices: device indices of every stage (several for a replicated
      stage; a device may hold several stages in a mixed pipe).
    stage_forward_seconds, stage_backward_seconds: compute per stage.
    stage_seconds: the stage's time in the cost model (compute, or
      communication where that dominates).
    stage_param_bytes: parameters each stage holds.
    stage_activation_bytes: activations kept per microbatch in flight.
    stage_stash_bytes: extra param versions of weight stashing
      (``steady_state_delay`` versions of the stage's params).
    bottleneck_seconds: the busiest device's time per microbatch in steady
      state: its stages' times summed (one stage a device: the slowest
      stage's time).
    sequential_seconds: forward + backward of the whole model on one
      device.
  """

  method: str
  node_names: tuple[str, ...]
  stage_of_node: tuple[int, ...]
  stage_devices: tuple[tuple[int, ...], ...]
  stage_forward_seconds: tuple[float, ...]
  stage_backward_seconds: tuple[float, ...]
  stage_seconds: tuple[float, ...]
  stage_param_bytes: tuple[float, ...]
  stage_activation_bytes: tuple[float, ...]
  stage_stash_bytes: tuple[float, ...]
  bottleneck_seconds: float
  sequential_seconds: float

  @property
  def num_stages(self) -> int:
    return len(self.stage_devices)

  @property
  def predicted_speedup(self) -> float:
    """Sequential time over the bottleneck (ideal pipeline, steady state)."""
    return self.sequential_seconds / self.bottleneck_seconds

  @property
  def indivisible_note(self) -> str | None:
    """One line when the slowest stage is a single node over
    ``INDIVISIBLE_FACTOR`` times the even share (the model's time over the
    stage count): no split is faster, the node itself must be cut. None
    otherwise."""
    n = self.num_stages
    slowest = int(np.argmax(self.stage_seconds))
    nodes = [
      name
      for name, s in zip(self.node_names, self.stage_of_node, strict=True)
      if s == slowest
    ]
    share = self.sequential_seconds / n
    if n < 2 or len(nodes) != 1 or share <= 0:
      return None
    ratio = self.stage_seconds[slowest] / share
    if ratio <= INDIVISIBLE_FACTOR:
      return None
    node_seconds = (
      self.stage_forward_seconds[slowest] + self.stage_backward_seconds[slowest]
    )
    return (
      f"node {nodes[0]!r} alone is {node_seconds / self.sequential_seconds:.0%}"
      f" of the model's time, {ratio:.1f}x the even share of {n} stages: "
      "no split is faster; cut it into smaller modules (unroll its layers, "
      "or scan them over stacked params) or use fewer stages"
    )

  @property
  def stage_of(self) -> dict[str, int]:
    return dict(zip(self.node_names, self.stage_of_node, strict=True))

  def to_json(self) -> str:
    data = dataclasses.asdict(self)
    data["predicted_speedup"] = self.predicted_speedup
    return json.dumps(data, indent=1)

  @classmethod
  def from_json(cls, text: str) -> "Plan":
    data = json.loads(text)
    data.pop("predicted_speedup", None)
    data.pop("schedule_choice", None)  # A training run's plan.json.
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = set(data) - names
    if unknown or names - set(data):
      raise ValueError(
        f"not a jpipe Plan: unknown keys {sorted(unknown)}, missing "
        f"{sorted(names - set(data))}"
      )
    for key, value in data.items():
      if isinstance(value, list):
        data[key] = tuple(tuple(v) if isinstance(v, list) else v for v in value)
    return cls(**data)


def plan_traced(
  traced: TracedModel,
  costs: NodeCosts,
  num_devices: int,
  *,
  method: str = "contiguous",
  bandwidth: float | None = None,
  comm_model: str = "overlapped",
  memory: MemoryBudget | None = None,
  devices: Sequence[int] | None = None,
  stage_slowdown: Sequence[float] | None = None,
  acyclic_options: Mapping[str, Any] | None = None,
  last_stage_costs: NodeCosts | None = None,
  mixed_blocks: Sequence[int] | None = None,
) -> Plan:
  """Partitions a traced model onto ``num_devices`` devices.

  Args:
    traced: from :func:`jpipe.partition.trace`.
    costs: from :func:`jpipe.partition.profile_nodes`.
    num_devices: devices of the pipeline.
    method: "contiguous" (one stage per device, exact min-max over the
      traced program order, memory-limited), "acyclic" (FTPipe's default:
      one stage per device, each an acyclic subgraph of the DAG rather
      than a run of one order -- parallel branches may sit on different
      stages; ``solve_acyclic``, never worse than "contiguous" under the
      same model, memory-limited alike), "mixed" (FTPipe's mixed
      pipe: several stages per device, each device's stages within the
      memory limit)
      or "pipedream" (PipeDream's DP over the graph's antichains, straight:
      one device per stage, as jpipe's runtime runs stages; transfers
      count when ``bandwidth`` is given; the memory limit uses PipeDream's
      stash model); or "pipedream_hybrid" (the same DP with stage
      replication, PipeDream's hybrid data parallelism: the DP picks the
      stages and how many of the ``num_devices`` devices each runs on,
      contiguously; all-reduce over a stage's replicas costs its params
      at ``bandwidth``, 1e9 bytes/s when None). jpipe's runtime splits each
      microbatch among a stage's replicas, so their count must divide it.
    bandwidth: bytes/s between devices; None ignores communication.
    memory: the limit per device and how stages hold the model's bytes
      (``MemoryBudget``; default: no limit, Adam's state). "contiguous"
      and "acyclic" keep to all of it; "mixed" to the limit, the
      optimizer's state, recomputation and stashing (its own in-flight
      counts: S - s over its S stages); PipeDream's methods to the limit
      (their own stash model).
    devices: the device index of each of the ``num_devices`` slots;
      default ``range(num_devices)``.
    stage_slowdown: "contiguous" only: per device slot, how much slower
      than the cost model it computes (DynPipe's re-partitioning of a
      slowed device); the plan's stage times include it.
    comm_model: how transfers add to a stage's time, "overlapped"
      (PipeDream: max of compute and transfers) or "ftpipe" (compute plus
      the transfer time compute cannot hide); see ``solve_contiguous``.
    acyclic_options: "acyclic"'s keywords of ``solve_acyclic``
      (``objective``, ``constraint``, ``epsilon``, ``multilevel``,
      ``runs``, ``rounds``, ``seed``).
    last_stage_costs: FTPipe's async meta-algorithm (``-a``): ``costs``
      price recomputation, these the same nodes without it (the last
      stage runs its forward and backward as one and never recomputes).
      The nodes of the last stage are priced with these, the rest with
      ``costs``: exactly by "contiguous", "acyclic" and "mixed" (their
      solvers price the last stage so); PipeDream's DP is solved again
      until the last stage's nodes are those it was priced with (at most
      10 solves; otherwise the fastest plan seen, with a warning).
    mixed_blocks: "mixed" only: the block counts L it tries (FTPipe's
      ``--L``; ``solve_mixed``'s ``block_counts``: the stages are at most
      L); None: its default, P to 16P.

  Returns:
    The plan.
  """
  _check_method_options(method, acyclic_options, stage_slowdown)
  if mixed_blocks is not None and method != "mixed":
    raise ValueError(f"mixed_blocks are for method 'mixed', not {method!r}")
  memory = MemoryBudget() if memory is None else memory
  if last_stage_costs is not None and method.startswith("pipedream"):
    return _price_last_stage_plain(
      lambda c: plan_traced(
        traced,
        c,
        num_devices,
        method=method,
        bandwidth=bandwidth,
        comm_model=comm_model,
        memory=memory,
        devices=devices,
      ),
      costs,
      last_stage_costs,
    )
  devices = tuple(range(num_devices)) if devices is None else tuple(devices)
  if len(devices) != num_devices:
    raise ValueError(f"devices needs {num_devices} entries, got {devices}")
  if method.startswith("pipedream"):
    if comm_model != "overlapped":
      raise ValueError(f"method {method!r} has only the 'overlapped' model")
    return _plan_pipedream(
      traced, costs, devices, method, bandwidth, memory.limit
    )
  last_compute = None
  if last_stage_costs is not None:
    last_compute = (
      last_stage_costs.forward_seconds + last_stage_costs.backward_seconds
    )
  graph = GraphCosts(
    costs.forward_seconds + costs.backward_seconds,
    edges=traced.edges(),
    bandwidth=bandwidth,
    comm_model=comm_model,
    last_stage_compute=last_compute,
  )
  stage_of, stage_devices, stage_seconds = _solve_graph(
    traced,
    graph,
    memory,
    devices,
    method,
    stage_slowdown,
    acyclic_options,
    mixed_blocks,
  )
  plan = _finish(traced, costs, method, stage_of, stage_devices, stage_seconds)
  return _priced_last_stage(plan, costs, last_stage_costs)


def _check_method_options(method, acyclic_options, stage_slowdown) -> None:
  if method not in METHODS:
    raise ValueError(f"unknown method {method!r}: one of {METHODS}")
  if acyclic_options and method != "acyclic":
    raise ValueError(
      f"acyclic_options are for method 'acyclic', not {method!r}"
    )
  if stage_slowdown is not None and method != "contiguous":
    raise ValueError(
      f"stage_slowdown is for method 'contiguous', not {method!r}"
    )


def _solve_graph(
  traced,
  graph,
  memory,
  devices,
  method,
  stage_slowdown,
  acyclic_options,
  mixed_blocks=None,
):
  """``(stage of each node, devices of each stage, stage seconds)`` by
  the "contiguous", "acyclic" or "mixed" solver."""
  model = memory.model(
    traced.node_param_bytes(), traced.node_intermediate_bytes()
  )
  if method == "mixed":
    mixed = solve_mixed(
      graph,
      len(devices),
      memory=dataclasses.replace(
        model, in_flight=None, param_versions=None, stashing=memory.stashing
      ),
      block_counts=mixed_blocks,
    )
    stage_devices = [(devices[d],) for d in mixed.stage_device]
    return mixed.stage_of_node(), stage_devices, mixed.stage_seconds
  if method == "acyclic":
    solution = _solve_named(
      traced,
      graph,
      len(devices),
      memory=model,
      solver=solve_acyclic,
      **(acyclic_options or {}),
    )
    stage_of = solution.stage_of_node
  else:
    solution = _solve_named(
      traced,
      graph,
      len(devices),
      memory=model,
      stage_slowdown=stage_slowdown,
    )
    stage_of = solution.stage_of_node()
  return stage_of, [(d,) for d in devices], solution.stage_seconds


def _plan_pipedream(traced, costs, devices, method, bandwidth, limit) -> Plan:
  """PipeDream's DP ("pipedream": straight; "pipedream_hybrid": with stage
  replication over contiguous devices)."""
  solution = solve_pipedream(
    _traced_graph(traced, costs),
    len(devices),
    bandwidth=1e9 if bandwidth is None else bandwidth,
    memory_bytes=1.0 if limit is None else limit,
    use_memory_constraint=limit is not None,
    straight=method == "pipedream",
    activation_compression_ratio=None if bandwidth is None else 1.0,
  )
  starts = np.concatenate([[0], np.cumsum(solution.replicas)]).astype(int)
  return _finish(
    traced,
    costs,
    method,
    [solution.stage_of[n] for n in traced.node_names],
    [devices[a:b] for a, b in zip(starts[:-1], starts[1:], strict=True)],
    solution.stage_seconds,
  )


def _priced_last_stage(plan, costs, last_stage_costs) -> Plan:
  """``plan`` with its forward / backward seconds as the solver priced
  them: the last stage's nodes at ``last_stage_costs`` (when given)."""
  if last_stage_costs is None:
    return plan
  # One device runs each node once, without recomputation: the speed-up's
  # reference (FTPipe's "vs seq no recomp").
  sequential = float(
    np.sum(last_stage_costs.forward_seconds + last_stage_costs.backward_seconds)
  )
  n = plan.num_stages
  of = np.asarray(plan.stage_of_node)
  last = of == n - 1
  fwd = np.where(last, last_stage_costs.forward_seconds, costs.forward_seconds)
  bwd = np.where(
    last, last_stage_costs.backward_seconds, costs.backward_seconds
  )
  return dataclasses.replace(
    plan,
    stage_forward_seconds=tuple(float(fwd[of == s].sum()) for s in range(n)),
    stage_backward_seconds=tuple(float(bwd[of == s].sum()) for s in range(n)),
    sequential_seconds=sequential,
  )


def _price_last_stage_plain(solve, costs, last_stage_costs) -> Plan:
  """FTPipe's async meta-algorithm over ``solve(costs) -> Plan`` (for
  PipeDream's DP, which cannot price one stage apart): price the last
  stage's nodes with ``last_stage_costs``, the rest with ``costs``, until
  the last stage keeps the nodes it was priced with (at most 10 solves;
  otherwise the fastest plan seen, with a warning)."""
  if last_stage_costs.forward_seconds.shape != costs.forward_seconds.shape:
    raise ValueError("last_stage_costs must cost the same nodes as costs")
  plain = np.zeros(costs.forward_seconds.shape, bool)
  seen = []
  for _ in range(10):
    plan = solve(
      dataclasses.replace(
        costs,
        forward_seconds=np.where(
          plain, last_stage_costs.forward_seconds, costs.forward_seconds
        ),
        backward_seconds=np.where(
          plain, last_stage_costs.backward_seconds, costs.backward_seconds
        ),
      )
    )
    of = np.asarray(plan.stage_of_node)
    last = of == of.max()
    if np.array_equal(last, plain):
      return _priced_last_stage(plan, costs, last_stage_costs)
    seen.append(plan)
    plain = last
  warnings.warn(
    "the async meta-algorithm's last stage did not settle in 10 solves: "
    "keeping the fastest plan seen (its last stage priced as the solve "
    "before it chose)",
    stacklevel=3,
  )
  best = min(seen, key=lambda p: p.bottleneck_seconds)
  return dataclasses.replace(
    best,
    sequential_seconds=float(
      np.sum(
        last_stage_costs.forward_seconds + last_stage_costs.backward_seconds
      )
    ),
  )


def _solve_named(traced, *args, solver=solve_contiguous, **kwargs):
  """``solver`` (``solve_contiguous``); its error's node indices named
  ("nodes 0-5" -> "nodes embedding .. block_1/mlp")."""
  try:
    return solver(*args, **kwargs)
  except ValueError as e:
    names = traced.node_names

    def name(match):
      a, b = int(match.group(1)), int(match.group(2))
      return f"nodes {names[a]} .. {names[b]}"

    kind = (
      type(e) if isinstance(e, TooFewNodes | MemoryLimitError) else ValueError
    )
    raise kind(re.sub(r"nodes (\d+)-(\d+)", name, str(e))) from None


def stage_memory_bytes(
  traced: TracedModel,
  plan: Plan,
  memory: MemoryBudget | None = None,
  replica_routing: str = "split",
) -> StageBytes:
  """Each stage's predicted bytes under the partitioner's model (the one
  ``plan_traced`` keeps to; ``memory``'s limit plays no part): params,
  gradients and optimizer state, stashed versions, the kept activations
  of the microbatches in flight (the budget's in-flight counts when the
  plan has that many stages, else S - s; a recomputing stage keeps its
  inputs) -- persistent -- and one microbatch's working memory
  (``StageBytes``: ``.total`` per stage, ``.per_device(plan.stage_devices)``
  what each device holds).

  A stage on r replicas holds per replica: with ``replica_routing``
  "split" (or "weighted", taken as even), 1/r of each microbatch's
  activations and working values, every param version; with
  "round_robin" (1F1B-RR), whole microbatches, PipeDream's runtime
  count of them (``(R - 1 - replicas before s) // r + 1``, R the
  replicas of all stages; S - s on a straight plan), and at most as
  many stashed versions."""
  memory = MemoryBudget() if memory is None else memory
  model = memory.per_stage_counts_for(plan.num_stages).model(
    traced.node_param_bytes(), traced.node_intermediate_bytes()
  )
  replicas = np.array([len(ds) for ds in plan.stage_devices], np.float64)
  edges = traced.edges()
  if np.all(replicas == 1):
    return model.bytes_of(plan.stage_of_node, edges)
  flight = model.flight(plan.num_stages)
  if replica_routing != "round_robin":
    whole = model.bytes_of(plan.stage_of_node, edges, flight / replicas)
    values = np.bincount(
      plan.stage_of_node,
      weights=np.asarray(traced.node_intermediate_bytes(), np.float64),
      minlength=plan.num_stages,
    )  # The working bytes' activations, split like the kept ones.
    return StageBytes(
      whole.persistent, whole.working - values * (1.0 - 1.0 / replicas)
    )
  # PipeDream's runtime counts (jpipe's round-robin stream alike): with R
  # replicas in all, (R - 1 - replicas before s) // r_s + 1 per replica.
  before = np.concatenate([[0.0], np.cumsum(replicas)[:-1]])
  per_replica = (replicas.sum() - 1 - before) // replicas + 1
  versions = model.versions(plan.num_stages, flight)
  model = dataclasses.replace(
    model, param_versions=np.minimum(versions, per_replica)
  )
  return model.bytes_of(plan.stage_of_node, edges, per_replica)


def plan_from_boundaries(
  traced: TracedModel,
  costs: NodeCosts,
  boundaries: Sequence[int],
  *,
  devices: Sequence[int] | None = None,
  stage_slowdown: Sequence[float] | None = None,
  method: str = "contiguous",
) -> Plan:
  """The straight plan whose stage s holds nodes
  ``boundaries[s]:boundaries[s+1]`` (program order), stage s on device
  ``devices[s]`` (default s); its stage times are the nodes' costs times
  ``stage_slowdown`` (default 1)."""
  b = np.asarray(boundaries)
  n = len(b) - 1
  if b[0] != 0 or b[-1] != len(traced.node_names) or np.any(np.diff(b) < 1):
    raise ValueError(
      f"boundaries {tuple(boundaries)} must rise from 0 to "
      f"{len(traced.node_names)} with every stage non-empty"
    )
  devices = tuple(range(n)) if devices is None else tuple(devices)
  if len(devices) != n:
    raise ValueError(
      f"boundaries {tuple(boundaries)} cut {n} stages, for {len(devices)} "
      f"devices (stage slots): give {len(devices) + 1} boundaries"
    )
  slowdown = (
    np.ones(n) if stage_slowdown is None else np.asarray(stage_slowdown)
  )
  compute = costs.forward_seconds + costs.backward_seconds
  prefix = np.concatenate([[0.0], np.cumsum(compute)])
  seconds = (prefix[b[1:]] - prefix[b[:-1]]) * slowdown
  of = np.repeat(np.arange(n), np.diff(b))
  return _finish(traced, costs, method, of, [(d,) for d in devices], seconds)


def _finish(
  traced, costs, method, stage_of_node, stage_devices, stage_seconds
) -> Plan:
  n = len(stage_devices)
  of = np.asarray(stage_of_node)
  leaf_avals = [v.aval for v in traced.jaxpr.invars[: traced.num_param_leaves]]
  leaf_bytes = np.array(
    [np.prod(a.shape) * a.dtype.itemsize for a in leaf_avals], np.float64
  )
  used = traced.node_param_leaves()
  stage_params = []
  for s in range(n):
    leaves = set().union(*[used[i] for i in np.flatnonzero(of == s)])
    if s == n - 1:  # (What nothing reads: the last stage holds it.)
      leaves |= set(traced.unread_param_leaves())
    stage_params.append(float(sum(leaf_bytes[i] for i in leaves)))
  acts = traced.node_output_bytes()

  def per_stage(x):
    return tuple(float(x[of == s].sum()) for s in range(n))

  # Stages sharing a device (a V, interleaving) share its time: the
  # busiest device, not the slowest stage, paces the pipeline. (The mixed
  # pipe's stage times already count their device's whole compute.)
  load = {}
  for ds, t in zip(stage_devices, stage_seconds, strict=True):
    for d in ds:
      load.setdefault(d, []).append(float(t))
  combine = max if method == "mixed" else sum
  bottleneck = max(combine(times) for times in load.values())
  return Plan(
    method=method,
    node_names=traced.node_names,
    stage_of_node=tuple(int(s) for s in stage_of_node),
    stage_devices=tuple(tuple(int(d) for d in ds) for ds in stage_devices),
    stage_forward_seconds=per_stage(costs.forward_seconds),
    stage_backward_seconds=per_stage(costs.backward_seconds),
    stage_seconds=tuple(float(t) for t in stage_seconds),
    stage_param_bytes=tuple(stage_params),
    stage_activation_bytes=per_stage(acts),
    stage_stash_bytes=_stash_bytes(stage_params),
    bottleneck_seconds=bottleneck,
    sequential_seconds=float(
      np.sum(costs.forward_seconds + costs.backward_seconds)
    ),
  )


def _stash_bytes(stage_param_bytes) -> tuple[float, ...]:
  """Weight stashing's extra versions per stage, in bytes."""
  n = len(stage_param_bytes)
  return tuple(
    float(steady_state_delay(n, s) * b) for s, b in enumerate(stage_param_bytes)
  )


def plan_from_pipedream(
  graph: ProfileGraph, solution: PipeDreamSolution
) -> Plan:
  """A Plan from PipeDream's solution for a profile.

  Stage s runs on the contiguous devices ``sum(replicas[:s])`` onwards, as
  PipeDream's ``hybrid_conf.json`` maps ranks. Weight stashing keeps
  ``steady_state_delay(n, s)`` extra versions of stage s's params, as
  jpipe's runtime does (it splits each microbatch among a stage's
  replicas). Input nodes cost nothing, as in PipeDream's optimizer.
  """
  n = solution.num_stages
  of = np.array([solution.stage_of[name] for name in graph.names])
  inputs = np.array([graph.is_input(i) for i in range(graph.num_nodes)])

  def per_stage(x):
    return tuple(float(v) for v in np.bincount(of, x, minlength=n))

  starts = np.concatenate([[0], np.cumsum(solution.replicas)])
  params = per_stage(graph.parameter_bytes)
  return Plan(
    method="pipedream",
    node_names=graph.names,
    stage_of_node=tuple(int(s) for s in of),
    stage_devices=tuple(
      tuple(range(int(starts[s]), int(starts[s + 1]))) for s in range(n)
    ),
    stage_forward_seconds=per_stage(
      np.where(inputs, 0.0, graph.forward_seconds)
    ),
    stage_backward_seconds=per_stage(
      np.where(inputs, 0.0, graph.backward_seconds)
    ),
    stage_seconds=solution.stage_seconds,
    stage_param_bytes=params,
    stage_activation_bytes=per_stage(graph.activation_bytes),
    stage_stash_bytes=_stash_bytes(params),
    bottleneck_seconds=solution.bottleneck_seconds,
    sequential_seconds=solution.sequential_seconds,
  )


def traced_profile_graph(traced, costs) -> ProfileGraph:
  """A traced model and its node costs as a PipeDream profile graph
  (what "pipedream" / "pipedream_hybrid" solve): a node's activation is
  the bytes of its distinct outputs read by other nodes, each edge's
  bytes those of the values it carries (``ProfileGraph.edge_bytes``)."""
  return _traced_graph(traced, costs)


def _traced_graph(traced, costs) -> ProfileGraph:
  """A traced model as a profile graph: a node's activation is the bytes
  of its distinct outputs read by other nodes."""
  producer = traced.producers()
  sent = [set() for _ in range(traced.num_nodes)]
  for eqn, node in zip(traced.jaxpr.eqns, traced.eqn_node, strict=True):
    for v in eqn.invars:
      if isinstance(v, jcore.Var) and producer.get(v, node) != node:
        sent[producer[v]].add(v)
  acts = [
    float(sum(np.prod(v.aval.shape) * v.aval.dtype.itemsize for v in vs))
    for vs in sent
  ]
  edges = traced.edges()
  return ProfileGraph(
    names=traced.node_names,
    descriptions=traced.node_names,
    forward_seconds=np.asarray(costs.forward_seconds, np.float64),
    backward_seconds=np.asarray(costs.backward_seconds, np.float64),
    activation_bytes=np.array(acts),
    parameter_bytes=traced.node_param_bytes(),
    edges=tuple(sorted(edges)),
    # A cut is charged what crosses it: a node may hand a large value to
    # its successor and a small one (an RNG key) to a far node.
    edge_bytes=tuple(float(edges[e]) for e in sorted(edges)),
  )
