"""A plan given by hand: how many nodes each stage holds, how many devices
each runs on (SD-Pipe's [4, 4, 4, 4], PipeDream's 15-1).

``Split`` is resolved on the traced model: its node counts pick the depth
whose node count they add up to (the shallowest), its replica counts give
each stage a run of consecutive devices (a replicated stage runs data
parallel over them). Without node counts the contiguous solver splits the
nodes, each stage priced as running ``replicas[s]`` times faster, so a
replicated stage takes more nodes.
"""

import dataclasses

import numpy as np

from jpipe.partition._granularity import Granularity, choose_depth
from jpipe.partition._plan import Plan, _finish, plan_traced
from jpipe.partition._profile import NodeCosts
from jpipe.partition._trace import TracedModel


class SplitMismatch(ValueError):
  """A Split that does not fit the model (its node counts): the training
  CLI prints it as one line."""


@dataclasses.dataclass(frozen=True)
class Split:
  """Nodes and devices per stage, given (``jpipe.Pipeline``'s
  ``partition=``; the config's ``pipeline.split`` / ``pipeline.replicas``).

  Attributes:
    nodes_per_stage: nodes of each stage, in program order; None: the
      contiguous solver splits them.
    replicas: devices of each stage (consecutive, in stage order); None:
      one each.
  """

  nodes_per_stage: tuple[int, ...] | None = None
  replicas: tuple[int, ...] | None = None

  def __post_init__(self):
    given = [x for x in (self.nodes_per_stage, self.replicas) if x is not None]
    if not given:
      raise ValueError("a Split needs nodes_per_stage, replicas or both")
    for name in ("nodes_per_stage", "replicas"):
      counts = getattr(self, name)
      if counts is not None and (not counts or min(counts) < 1):
        raise ValueError(f"Split {name} {counts}: counts of at least 1")
    if len({len(x) for x in given}) > 1:
      raise ValueError(
        f"Split: {len(self.nodes_per_stage)} stages of nodes but "
        f"{len(self.replicas)} replica counts: give one per stage"
      )

  @property
  def num_stages(self) -> int:
    return len(self.nodes_per_stage or self.replicas)

  @property
  def num_devices(self) -> int:
    return sum(self.replicas) if self.replicas else self.num_stages

  def describe(self) -> str:
    """E.g. "nodes 4-4-4-4, replicas 15-1"."""
    parts = []
    if self.nodes_per_stage:
      parts.append("nodes " + "-".join(map(str, self.nodes_per_stage)))
    if self.replicas:
      parts.append("replicas " + "-".join(map(str, self.replicas)))
    return ", ".join(parts)

  def depth_of(self, traced: TracedModel) -> tuple[TracedModel, Granularity]:
    """The trace cut where the node counts apply: the shallowest depth
    with as many nodes as they add up to (without node counts, the
    automatic depth for the stage count)."""
    if self.nodes_per_stage is None:
      return choose_depth(traced, self.num_stages)
    total = sum(self.nodes_per_stage)
    counts = {}
    for depth in range(1, traced.max_depth + 1):
      cut = traced.at_depth(depth)
      counts[depth] = cut.num_nodes
      if cut.num_nodes == total:
        why = (
          f"depth {depth}: the one with the {total} nodes of {self.describe()}"
        )
        return cut, Granularity(depth, total, {}, why)
    seen = ", ".join(f"{n} at depth {d}" for d, n in counts.items())
    raise SplitMismatch(
      f"split {self.describe()} covers {total} nodes, but this model has "
      f"{seen}: give counts adding up to one of them"
    )

  def plan(self, traced: TracedModel, costs: NodeCosts) -> Plan:
    """The plan on ``traced`` (cut where ``depth_of`` says); stage times
    are the nodes' costs over the stage's replicas."""
    n = self.num_stages
    replicas = np.asarray(self.replicas or [1] * n, np.float64)
    starts = np.concatenate([[0], np.cumsum(replicas)]).astype(int)
    groups = [tuple(range(starts[s], starts[s + 1])) for s in range(n)]
    if self.nodes_per_stage is None:
      solved = plan_traced(
        traced, costs, n, method="contiguous", stage_slowdown=1.0 / replicas
      )
      return dataclasses.replace(
        solved, method="split", stage_devices=tuple(groups)
      )
    if sum(self.nodes_per_stage) != traced.num_nodes:
      raise SplitMismatch(
        f"split {self.describe()} covers {sum(self.nodes_per_stage)} nodes; "
        f"this model has {traced.num_nodes} at depth {traced.depth}"
      )
    of = np.repeat(np.arange(n), self.nodes_per_stage)
    compute = costs.forward_seconds + costs.backward_seconds
    seconds = [compute[of == s].sum() / replicas[s] for s in range(n)]
    return _finish(traced, costs, "split", of, groups, seconds)
