"""Automatic granularity: the module-path depth at which to cut nodes.

A model's depth-1 nodes are its root's children: a model whose
``__call__`` calls ``encode`` / ``decode``, whose blocks sit in one
``nnx.List`` or one ``Decoder`` submodule, is 1-3 nodes there, too few to
balance 4 stages. Deeper cuts give more, smaller nodes, and cost the
partitioner more time. ``choose_depth`` regroups one trace at every depth
(linear in the equations per depth, no retrace), splits each depth's
analytic FLOPs into the stage count (exact min-max, by bisection), and
takes the shallowest depth whose slowest stage is within ``tolerance`` of
the best over all depths.
"""

import dataclasses

import numpy as np

from jpipe.partition._cost_model import TooFewNodes
from jpipe.partition._inline_calls import enclosing_equations
from jpipe.partition._trace import TracedModel


@dataclasses.dataclass(frozen=True)
class Granularity:
  """The depth chosen and why.

  Attributes:
    depth: module-path depth of the nodes.
    num_nodes: nodes at that depth.
    balance: per depth tried, the slowest stage's FLOPs over an even share
      (total / stages; 1.0 is perfect), inf where there are fewer nodes
      than stages.
    reason: one line for people.
  """

  depth: int
  num_nodes: int
  balance: dict[int, float]
  reason: str


def min_max_split(costs: np.ndarray, num_stages: int) -> float:
  """The smallest possible largest stage sum of a contiguous split of
  ``costs`` into at most ``num_stages`` runs (inf when there are fewer
  nodes than stages)."""
  costs = np.asarray(costs, np.float64)
  if len(costs) < num_stages:
    return float("inf")
  lo, hi = float(costs.max(initial=0.0)), float(costs.sum())
  if hi <= 0:
    return 0.0

  def fits(limit):
    stages, load = 1, 0.0
    for c in costs:
      if load + c > limit:
        stages, load = stages + 1, c
      else:
        load += c
    return stages <= num_stages

  for _ in range(60):  # 2^-60 of the range: exact for any float use.
    mid = 0.5 * (lo + hi)
    if fits(mid):
      hi = mid
    else:
      lo = mid
  return hi


def choose_depth(
  traced: TracedModel, num_stages: int, *, tolerance: float = 0.05
) -> tuple[TracedModel, Granularity]:
  """The shallowest depth whose ``num_stages``-stage split is within
  ``tolerance`` of the most balanced over all depths, and the trace cut
  there.

  Raises TooFewNodes (a ValueError) when no depth has ``num_stages``
  nodes.
  """
  balance, cuts = {}, {}
  for depth in range(1, traced.max_depth + 1):
    cut = traced.at_depth(depth)
    cuts[depth] = cut
    flops = cut.node_flops()
    total = float(flops.sum())
    worst = min_max_split(flops, num_stages)
    balance[depth] = worst / (total / num_stages) if total > 0 else 1.0
    if cut.num_nodes < num_stages:
      balance[depth] = float("inf")
  best = min(balance.values())
  if not np.isfinite(best):
    most = max(c.num_nodes for c in cuts.values())
    cause = (
      f"cannot split the model into {num_stages} stages: it has at most "
      f"{most} module-call nodes (at depth {traced.max_depth})"
    )
    raise TooFewNodes(
      f"{cause}; use at most {most} stages, or {_more_nodes_hint(traced)}",
      cause,
      most,
    )
  depth = min(d for d, b in balance.items() if b <= best * (1 + tolerance))
  tried = ", ".join(
    f"{d}: {cuts[d].num_nodes} nodes, "
    + ("too few" if not np.isfinite(b) else f"{b:.2f}x")
    for d, b in balance.items()
  )
  reason = (
    f"depth {depth} ({cuts[depth].num_nodes} nodes): the shallowest whose "
    f"{num_stages}-stage split is within {tolerance:.0%} of the most "
    f"balanced (slowest stage / even share by FLOPs, per depth: {tried})"
  )
  return cuts[depth], Granularity(depth, cuts[depth].num_nodes, balance, reason)


# What users write for the primitives that hold module calls.
_PRIMITIVES = {
  "while": "jax.lax.while_loop / fori_loop",
  "cond": "jax.lax.cond / switch",
  "scan": "jax.lax.scan",
  # The layer scan split (``_scan_layers``) runs forward only.
  "reverse_scan": "jax.lax.scan with reverse=True (layers are split "
  "from a forward scan only)",
}


def _more_nodes_hint(traced: TracedModel) -> str:
  """How to give ``traced`` more nodes: open the control flow that holds
  several module calls, else name plain-JAX blocks."""
  enclosing = enclosing_equations(traced.closed_jaxpr)
  if enclosing:
    name, paths = enclosing[0]
    name = _PRIMITIVES.get(name, name)
    return (
      f"split what one {name} holds ({paths} module paths, which "
      "no cut enters): call its modules outside it, or unroll a loop whose "
      "body calls several modules"
    )
  return "wrap parts of a plain-JAX loss in jax.named_scope to give it more"
