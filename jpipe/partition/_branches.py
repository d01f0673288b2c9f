"""PipeDream's branch compression (``Graph.compress_branches``): chains
of single-in/single-out nodes after a fork merged into one node each,
so that the antichain DAG of a wide model (Inception-v3) stays small."""

import collections
import dataclasses

import numpy as np

from jpipe.partition._graph_txt import ProfileGraph


@dataclasses.dataclass(frozen=True)
class CompressedGraph:
  """A graph with chains merged, and which original nodes each node holds.

  ``members[i]`` are the original node indices merged into node i of
  ``graph`` (one index for a node left as it was).
  """

  graph: ProfileGraph
  members: tuple[tuple[int, ...], ...]

  def expand(self, stage_of: dict[str, int], original: ProfileGraph):
    """Stage of every original node from a stage of every compressed one."""
    out = {}
    for name, members in zip(self.graph.names, self.members, strict=True):
      for i in members:
        out[original.names[i]] = stage_of[name]
    return out


def compress_branches(graph: ProfileGraph) -> CompressedGraph:
  """PipeDream's ``compress_graph_branches`` (``Graph.compress_branches``).

  Walking from the sources, every out-edge of a node with several
  out-edges starts a branch; the single-in/single-out chain that follows is
  merged into one node ``compressed_nodeK`` ("Branch K", or the last
  node's description for a chain of one): F, B and P summed, A the last
  node's. Nodes are ordered as PipeDream writes the compressed graph.txt
  (insertion order; edges grouped by destination), which fixes the order
  its optimizer then sees.

  One deliberate difference: when a chain runs into a sink, PipeDream
  replaces the sink by the chain without adding the sink's costs (its
  ``check_fidelity`` assertion then fails unless they are ~0); here the
  sink is merged like any chain node, so no cost is lost.
  """
  n = graph.num_nodes
  succ = [[] for _ in range(n)]
  pred = [[] for _ in range(n)]
  for u, v in graph.edges:
    succ[u].append(v)
    pred[v].append(u)
  # A record per new node: [name, desc, f, b, a, p, members].
  records = {}
  order = []
  in_edges = {}

  def original(i):
    key = ("o", i)
    if key not in records:
      records[key] = [
        graph.names[i],
        graph.descriptions[i],
        graph.forward_seconds[i],
        graph.backward_seconds[i],
        graph.activation_bytes[i],
        graph.parameter_bytes[i],
        [i],
      ]
    return key

  def add_edge(u, v):
    for key in (u, v):
      if key not in in_edges:
        in_edges[key] = []
        order.append(key)
    in_edges[v].append(u)

  def merge(rec, i):
    rec[2] += graph.forward_seconds[i]
    rec[3] += graph.backward_seconds[i]
    rec[4] = graph.activation_bytes[i]
    rec[5] += graph.parameter_bytes[i]
    rec[6].append(i)

  def helper(node, k):
    """(compressed key or None, last old node it replaces)."""
    if len(pred[node]) > 1:
      return None, node
    key = ("c", k)
    rec = [f"compressed_node{k}", f"Branch {k}", 0.0, 0.0, 0.0, 0.0, []]
    chain = 0
    while len(pred[node]) == 1 and len(succ[node]) == 1:
      chain += 1
      nxt = succ[node][0]
      merge(rec, node)
      if len(pred[nxt]) > 1:
        break
      node = nxt
      if not succ[node]:
        merge(rec, node)  # PipeDream drops the sink's costs here.
        records[key] = rec
        return key, node
    if chain == 0:
      return original(node), node
    if chain == 1:
      rec[1] = graph.descriptions[node]
    if len(succ[node]) > 1:
      merge(rec, node)
    records[key] = rec
    return key, node

  mapping = {}
  queue = collections.deque(i for i in range(n) if not pred[i])
  seen = set()
  counter = 0
  while queue:
    node = queue.popleft()
    if node in seen:
      continue
    here = mapping.get(node, original(node))
    if len(succ[node]) > 1:
      for out in succ[node]:
        compressed, old = helper(out, counter)
        counter += 1
        if compressed is None:
          add_edge(here, original(out))
        else:
          mapping[old] = compressed
          add_edge(here, compressed)
        if old not in seen:
          queue.append(old)
    else:
      for out in succ[node]:
        add_edge(here, mapping.get(out, original(out)))
        if out not in seen:
          queue.append(out)
    seen.add(node)
  for i in range(n):  # isolated nodes (PipeDream would drop them)
    if not pred[i] and not succ[i]:
      key = original(i)
      in_edges[key] = []
      order.append(key)
  index = {key: k for k, key in enumerate(order)}
  recs = [records[key] for key in order]
  return CompressedGraph(
    graph=ProfileGraph(
      names=tuple(r[0] for r in recs),
      descriptions=tuple(r[1] for r in recs),
      forward_seconds=np.array([r[2] for r in recs], np.float64),
      backward_seconds=np.array([r[3] for r in recs], np.float64),
      activation_bytes=np.array([r[4] for r in recs], np.float64),
      parameter_bytes=np.array([r[5] for r in recs], np.float64),
      edges=tuple((index[u], index[v]) for v in order for u in in_edges[v]),
    ),
    members=tuple(tuple(r[6]) for r in recs),
  )
