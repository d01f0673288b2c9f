"""PipeDream's antichain DAG of a layer graph, and its branch compression.

PipeDream's optimizer does not cut one topological order: its states are
the *antichains* of the layer graph (sets of mutually unordered nodes, the
frontier of "what is done"). A stage is what lies between two antichains
where the first precedes the second. The DAG of antichains is built by BFS
from the first source: the next antichains of an antichain are made by
replacing one node of its *augmented* antichain (the antichain plus the
predecessors whose outputs leave the done set) by a successor that has no
successor inside that set. For a chain, state j means "layers 0..j done".

Sets are Python ints used as bitsets over node indices (fast unions and
subset tests). Where PipeDream iterates a Python set (an arbitrary order),
this port uses ascending node index, so results are deterministic.

References:
  Narayanan et al., "PipeDream: Generalized Pipeline Parallelism for DNN
  Training", SOSP 2019; msr-fiddle/pipedream ``graph/graph.py``.
"""

import collections
import dataclasses
import itertools
import operator

import numpy as np

from jpipe.partition._graph_txt import ProfileGraph


@dataclasses.dataclass(frozen=True)
class AntichainDag:
  """The optimizer's view of a graph: states in topological order.

  ``S`` states, ``N`` graph nodes (indices into the ProfileGraph).

  Attributes:
    antichains: augmented antichain of every state (node indices).
    done: per state, the bitset of nodes finished at that state (the
      antichain and all its predecessors).
    ancestors: bool [S, S]; ``ancestors[j, k]`` if state k precedes state j
      in the antichain DAG (the allowed split points before j).
    compute_seconds: [S] forward + backward seconds of ``done``.
    activation_bytes, parameter_bytes: [S] sums over ``done``.
    output_bytes: [S] activation bytes of the augmented antichain (what
      crosses a cut right after the state).
    removed_inputs: ``Input`` sources PipeDream removes (back in stage 0).
    removed_sinks: ``__getitem__`` sinks PipeDream removes.
  """

  antichains: tuple[tuple[int, ...], ...]
  done: tuple[int, ...]
  ancestors: np.ndarray
  compute_seconds: np.ndarray
  activation_bytes: np.ndarray
  parameter_bytes: np.ndarray
  output_bytes: np.ndarray
  removed_inputs: tuple[int, ...]
  removed_sinks: tuple[int, ...]

  @property
  def num_states(self) -> int:
    return len(self.antichains)


def bits(mask: int) -> list[int]:
  """Indices of the set bits of a bitset, ascending."""
  if mask.bit_count() > 8:  # one pass over the bytes beats a loop per bit
    raw = mask.to_bytes((mask.bit_length() + 7) // 8, "little")
    flags = np.unpackbits(np.frombuffer(raw, np.uint8), bitorder="little")
    return np.flatnonzero(flags).tolist()
  out = []
  while mask:
    low = mask & -mask
    out.append(low.bit_length() - 1)
    mask ^= low
  return out


def bitset_rows(masks, width: int) -> np.ndarray:
  """Bitsets as a bool matrix [len(masks), width]."""
  nbytes = (width + 7) // 8
  raw = b"".join(m.to_bytes(nbytes, "little") for m in masks)
  flat = np.frombuffer(raw, np.uint8).reshape(len(masks), nbytes)
  return np.unpackbits(flat, axis=1, bitorder="little")[:, :width].astype(bool)


class _Dag:
  """Adjacency of the kept nodes, with transitive closures as bitsets."""

  def __init__(self, num_nodes, edges, keep):
    self.succ = [[] for _ in range(num_nodes)]
    self.indeg = [0] * num_nodes
    for u, v in edges:
      if keep[u] and keep[v]:
        self.succ[u].append(v)
        self.indeg[v] += 1
    self.out = [sum(1 << v for v in set(s)) for s in self.succ]
    order = _kahn(num_nodes, self.succ, keep)
    self.pred = [0] * num_nodes  # strict ancestors
    for u in order:
      for v in self.succ[u]:
        self.pred[v] |= self.pred[u] | (1 << u)
    self.desc = [0] * num_nodes  # strict descendants
    for u in reversed(order):
      for v in self.succ[u]:
        self.desc[u] |= self.desc[v] | (1 << v)
    self._frontier = _frontiers(num_nodes, self.succ, self.out, self.desc)

  def frontier(self, a: int) -> int:
    """Predecessors of ``a`` with an out-edge leaving pred(a) + {a}."""
    return self._frontier[a]

  def augment(self, antichain):
    extra = 0
    for a in antichain:
      extra |= self.frontier(a)
    # PipeDream: list(extra_nodes) + antichain (extra in set order).
    return bits(extra) + list(antichain)

  def next_antichains(self, antichain, aug):
    """PipeDream's next antichains of ``antichain``, in its order, as
    (bitset, u, v): ``aug`` (its augmented antichain) with node u replaced
    by a successor v, less every node with a descendant in that set
    (PipeDream's ``deaugment``; ``listed`` gives its node order).

    ``aug`` repeats no node (the frontier precedes the antichain, whose
    nodes are unordered) and v is not in it, so a replacement is the
    bitset ``aug - u + v`` and its nodes with a descendant in it are those
    in the ancestors of its other nodes: the union of ``pred`` over ``aug``
    less u (prefix and suffix unions) and ``pred[v]``.
    """
    pred, desc = self.pred, self.desc
    aug_mask = sum(1 << x for x in aug)
    current = sum(1 << x for x in antichain)
    before = list(itertools.accumulate((pred[x] for x in aug), operator.or_))
    after = list(
      itertools.accumulate((pred[x] for x in reversed(aug)), operator.or_)
    )
    last = len(aug) - 1
    result = []
    for i, u in enumerate(aug):
      others = (before[i - 1] if i else 0) | (
        after[last - i - 1] if i < last else 0
      )
      rest = aug_mask ^ (1 << u)
      for v in self.succ[u]:
        if current >> v & 1 or desc[v] & aug_mask:
          continue
        result.append(((rest | 1 << v) & ~(others | pred[v]), u, v))
    return result


def _frontiers(num_nodes, succ, out, desc, block_bytes=2**24) -> list[int]:
  """Per node a, the bitset of its predecessors p with an out-edge
  leaving pred(a) + {a}.

  Turned around: a successor v of p is in pred(a) + {a} exactly when a
  is in desc(v) + {v}, so p is in a's frontier for the a in desc(p) less
  the intersection of desc(v) + {v} over p's successors. Only a p with
  two or more successors has such a's (one successor lies on the path to
  a). Those sets, one per p, are transposed as a bit matrix, a block of
  ``block_bytes`` at a time.
  """
  owners = [u for u, o in enumerate(out) if o & o - 1]
  if not owners:
    return [0] * num_nodes
  covered = []
  for p in owners:
    both = -1
    for v in set(succ[p]):
      both &= desc[v] | (1 << v)
    covered.append(desc[p] & ~both)
  by_owner = bitset_rows(covered, num_nodes)  # [owner, a]
  out = []
  step = max(1, block_bytes // num_nodes)  # Rows of a at a time.
  for start in range(0, num_nodes, step):
    block = by_owner[:, start : start + step]
    matrix = np.zeros((block.shape[1], num_nodes), bool)  # [a, p]
    matrix[:, owners] = block.T
    rows = np.packbits(matrix, axis=1, bitorder="little")
    out += [int.from_bytes(row.tobytes(), "little") for row in rows]
  return out


def listed(aug, u, v, mask):
  """The nodes of bitset ``mask`` in ``aug``'s order, v in u's place."""
  return [w for w in (v if x == u else x for x in aug) if mask >> w & 1]


def _kahn(num_nodes, succ, keep):
  indeg = [0] * num_nodes
  for u in range(num_nodes):
    for v in succ[u]:
      indeg[v] += 1
  ready = collections.deque(
    u for u in range(num_nodes) if keep[u] and not indeg[u]
  )
  order = []
  while ready:
    u = ready.popleft()
    order.append(u)
    for v in succ[u]:
      indeg[v] -= 1
      if not indeg[v]:
        ready.append(v)
  if len(order) != sum(map(bool, keep)):
    raise ValueError("the profile graph has a cycle")
  return order


def optimizer_nodes(graph: ProfileGraph):
  """(keep mask, removed inputs, removed sinks) as PipeDream's optimizer.

  Sources whose description starts with ``Input`` are removed (their time
  is data loading; they go back to stage 0), then sinks whose description
  starts with ``__getitem__``.
  """
  n = graph.num_nodes
  indeg, outdeg = [0] * n, [0] * n
  for u, v in graph.edges:
    outdeg[u] += 1
    indeg[v] += 1
  inputs = [
    i
    for i in range(n)
    if not indeg[i] and graph.descriptions[i].startswith("Input")
  ]
  keep = [True] * n
  for i in inputs:
    keep[i] = False
  outdeg = [0] * n
  for u, v in graph.edges:
    if keep[u] and keep[v]:
      outdeg[u] += 1
  sinks = [
    i
    for i in range(n)
    if keep[i]
    and not outdeg[i]
    and graph.descriptions[i].startswith("__getitem__")
  ]
  for i in sinks:
    keep[i] = False
  return keep, tuple(inputs), tuple(sinks)


def antichain_dag(graph: ProfileGraph, max_states: int = 10_000):
  """PipeDream's antichain DAG of ``graph`` (``Graph.antichain_dag`` plus
  the optimizer's preprocessing and topological sort of states).

  Args:
    graph: the profile.
    max_states: raise a ValueError past this many states (branchy graphs
      have exponentially many antichains; compress them first).

  Returns:
    The states with their cumulative costs.
  """
  keep, inputs, sinks = optimizer_nodes(graph)
  if not any(keep):
    raise ValueError("the graph has no nodes besides its inputs")
  dag = _Dag(graph.num_nodes, graph.edges, keep)
  # PipeDream starts from sources()[0]: the first source in file order.
  source = next(
    i for i in range(graph.num_nodes) if keep[i] and not dag.indeg[i]
  )
  start = [source]
  ids = {1 << source: 0}  # an antichain's bitset -> its state
  found = [start]
  out_edges = [[]]
  # BFS over states, each queued once, when first reached, and expanded
  # from the list it was first reached as (PipeDream queues every visit,
  # but a later one is popped after the first and skipped); that list's
  # order fixes the order of its next antichains.
  queue = collections.deque([0])
  augmented = {}  # state -> its augmented antichain, made when expanded
  while queue:
    key = queue.popleft()
    aug = augmented[key] = dag.augment(found[key])
    for nkey, u, v in dag.next_antichains(found[key], aug):
      if nkey not in ids:
        if len(found) >= max_states:
          raise ValueError(
            f"the antichain DAG has more than {max_states} states; "
            "compress the graph's branches first (compress_branches=True, "
            "--compress-branches) or "
            "raise max_states"
          )
        ids[nkey] = len(found)
        found.append(listed(aug, u, v, nkey))
        out_edges.append([])
        queue.append(ids[nkey])
      out_edges[key].append(ids[nkey])
  order = _dfs_topological(out_edges)
  # Ancestors per state (PipeDream's antichain_gr.predecessors).
  anc = [0] * len(order)
  for here, k in enumerate(order):  # here: k's position in the order
    mine = anc[k] | (1 << here)
    for j in out_edges[k]:
      anc[j] |= mine
  ancestors = bitset_rows([anc[k] for k in order], len(order))
  # The first list a state was reached by is the one it was expanded from.
  augmented = [augmented[k] for k in order]
  done = []
  for aug in augmented:
    mask = 0
    for a in aug:
      mask |= dag.pred[a] | (1 << a)
    done.append(mask)
  done_rows = bitset_rows(done, graph.num_nodes).astype(np.float64)
  # Removed inputs are zeroed by PipeDream and never in ``done``.
  compute = graph.forward_seconds + graph.backward_seconds
  return AntichainDag(
    antichains=tuple(tuple(a) for a in augmented),
    done=tuple(done),
    ancestors=ancestors,
    compute_seconds=done_rows @ compute,
    activation_bytes=done_rows @ graph.activation_bytes,
    parameter_bytes=done_rows @ graph.parameter_bytes,
    output_bytes=np.array(
      [
        _crossing_bytes(graph, a, m)
        for a, m in zip(augmented, done, strict=True)
      ]
    ),
    removed_inputs=inputs,
    removed_sinks=sinks,
  )


def _crossing_bytes(graph: ProfileGraph, antichain, done: int) -> float:
  """Bytes crossing the cut after ``done`` (a bit mask of nodes) from the
  augmented ``antichain``: PipeDream's sum of its nodes' activations, or
  with ``graph.edge_bytes`` each node's edges to nodes beyond the cut
  (at most its activation: a value read twice there crosses once; a node
  without edges, whose output leaves the graph, its activation)."""
  act = graph.activation_bytes
  if graph.edge_bytes is None:
    return float(act[list(antichain)].sum())
  members = set(antichain)
  out = dict.fromkeys(members, 0.0)
  has_edges = set()
  for (u, v), w in zip(graph.edges, graph.edge_bytes, strict=True):
    if u in members:
      has_edges.add(u)
      if not done >> v & 1:
        out[u] += w
  return float(
    sum(min(act[u], b) if u in has_edges else act[u] for u, b in out.items())
  )


def _dfs_topological(out_edges):
  """PipeDream's ``Graph.topological_sort``: DFS over nodes in insertion
  order, children in edge order, each finished node pushed to the front."""
  marked = [False] * len(out_edges)
  finished = []
  for root in range(len(out_edges)):
    if marked[root]:
      continue
    marked[root] = True
    stack = [(root, iter(out_edges[root]))]
    while stack:
      node, children = stack[-1]
      for child in children:
        if not marked[child]:
          marked[child] = True
          stack.append((child, iter(out_edges[child])))
          break
      else:
        stack.pop()
        finished.append(node)
  return finished[::-1]


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
