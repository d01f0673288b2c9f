"""PipeDream's antichain DAG of a layer graph (its branch compression:
``_branches.py``).

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
  rows = np.unpackbits(flat, axis=1, count=width, bitorder="little")
  return rows.view(bool)


class _Dag:
  """Adjacency of the kept nodes, with transitive closures as bitsets."""

  def __init__(self, num_nodes, edges, keep):
    self.succ = succ = [[] for _ in range(num_nodes)]
    self.indeg = [0] * num_nodes
    for u, v in edges:
      if keep[u] and keep[v]:
        succ[u].append(v)
        self.indeg[v] += 1
    # Kahn's order, each node's ancestors complete when it is reached.
    self.pred = pred = [0] * num_nodes  # strict ancestors
    self.down = down = [1 << u for u in range(num_nodes)]  # pred + self
    left = list(self.indeg)
    order = [u for u in range(num_nodes) if keep[u] and not left[u]]
    for u in order:  # extended while read
      here = down[u] = pred[u] | down[u]
      for v in succ[u]:
        pred[v] |= here
        left[v] -= 1
        if not left[v]:
          order.append(v)
    if len(order) != sum(map(bool, keep)):
      raise ValueError("the profile graph has a cycle")
    self.below = below = [1 << u for u in range(num_nodes)]  # desc + self
    for u in reversed(order):
      for v in succ[u]:
        below[u] |= below[v]
    self._frontier, self.front_lists = _frontiers(num_nodes, succ, below)

  def frontier(self, a: int) -> int:
    """Predecessors of ``a`` with an out-edge leaving pred(a) + {a}."""
    return self._frontier[a]


def _states(dag: _Dag, source: int, max_states: int):
  """PipeDream's states from ``source``: per state, its antichain (a list),
  its done set, its augmented antichain and its next states, by index.

  States are expanded once, in the order first reached (as PipeDream pops
  them; it queues every visit, but a later one is skipped), from the list
  they were first reached as: that list's order fixes the order of its
  next antichains. PipeDream replaces a node u of the augmented antichain
  (the frontier of the antichain, ascending, then the antichain) by a
  successor v outside the done set, and keeps the nodes with no
  descendant in the result. Those are v and the antichain's nodes outside
  pred(v) (every frontier node precedes a kept node, or u, which precedes
  v), in that list's order with v in u's place: before all of the
  antichain when u is a frontier node. The new done set is
  ``done | pred(v) | v``; it names the state (a downset has one
  antichain), so a v met again from another u is the same state (listed
  again, as PipeDream's repeated edge).
  """
  pred, down, succ, frontier = dag.pred, dag.down, dag.succ, dag._frontier
  ids = {down[source]: 0}  # a state's done set -> its index
  found, done = [[source]], [down[source]]

  def add(mask, antichain):
    if len(found) >= max_states:
      raise ValueError(
        f"the antichain DAG has more than {max_states} states; "
        "compress the graph's branches first (compress_branches=True, "
        "--compress-branches) or raise max_states"
      )
    k = ids[mask] = len(found)
    found.append(antichain)
    done.append(mask)
    return k

  augmented, out_edges = [], []
  fronts = dag.front_lists  # frontier of one node
  for anti, here in zip(found, done, strict=True):  # add() extends both
    if len(anti) == 1:
      front = fronts[anti[0]]
    else:
      extra = 0
      for a in anti:
        extra |= frontier[a]
      front = bits(extra)
    nexts = []
    for u in front:
      for v in succ[u]:
        if not here >> v & 1:
          mask = here | down[v]
          k = ids.get(mask)
          if k is None:
            above = pred[v]
            k = add(mask, [v] + [x for x in anti if not above >> x & 1])
          nexts.append(k)
    # The antichain's own successors: v takes u's place (the same walk as
    # above, written out twice: this is the solver's innermost loop).
    for u in anti:
      for v in succ[u]:
        if not here >> v & 1:
          mask = here | down[v]
          k = ids.get(mask)
          if k is None:
            above = pred[v]
            k = add(
              mask,
              [
                v if x == u else x for x in anti if x == u or not above >> x & 1
              ],
            )
          nexts.append(k)
    augmented.append((*front, *anti))
    out_edges.append(nexts)
  return found, done, augmented, out_edges


def _frontiers(num_nodes, succ, below, block_bytes=2**24, bits_per_node=16):
  """Per node a, its predecessors p with an out-edge leaving pred(a) + {a}
  (``below``: each node's descendants and itself), as (bitsets, ascending
  lists).

  Turned around: a successor v of p is in pred(a) + {a} exactly when a
  is in below(v), so p is in a's frontier for the a in desc(p) (the union
  of below(v) over p's successors) less the intersection of those. Only a
  p with two or more successors has such a's. Those sets, one per p, are
  transposed: bit by bit when they hold at most ``bits_per_node`` bits
  per node in all, else as a bit matrix, a block of ``block_bytes`` at a
  time.
  """
  owners, covered = [], []
  for p, s in enumerate(succ):
    if len(s) > 1 and len(set(s)) > 1:
      either, both = 0, -1
      for v in s:
        either |= below[v]
        both &= below[v]
      owners.append(p)
      covered.append(either & ~both)
  out, lists = [0] * num_nodes, [[] for _ in range(num_nodes)]
  if sum(c.bit_count() for c in covered) <= bits_per_node * num_nodes:
    for p, c in zip(owners, covered, strict=True):  # p ascending
      for a in bits(c):
        out[a] |= 1 << p
        lists[a].append(p)
    return out, lists
  by_owner = bitset_rows(covered, num_nodes)  # [owner, a]
  out = []
  step = max(1, block_bytes // num_nodes)  # Rows of a at a time.
  for start in range(0, num_nodes, step):
    block = by_owner[:, start : start + step]
    matrix = np.zeros((block.shape[1], num_nodes), bool)  # [a, p]
    matrix[:, owners] = block.T
    rows = np.packbits(matrix, axis=1, bitorder="little")
    out += [int.from_bytes(row.tobytes(), "little") for row in rows]
  return out, [bits(f) if f else [] for f in out]


def topological_order(succ, indeg, keep=None) -> list[int]:
  """Kahn's order of the nodes (the kept ones: ``keep``, a flag per node);
  ``indeg``: their in-degrees, consumed."""
  n = len(succ)
  keep = keep or [True] * n
  ready = collections.deque(u for u in range(n) if keep[u] and not indeg[u])
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
  starts with ``__getitem__`` (an input is no edge's destination, so its
  removal leaves every other node's out-degree as it was).
  """
  n = graph.num_nodes
  sources, sinks = set(range(n)), set(range(n))
  sinks.difference_update(u for u, _ in graph.edges)
  sources.difference_update(v for _, v in graph.edges)
  descs = graph.descriptions
  inputs = tuple(i for i in sorted(sources) if descs[i].startswith("Input"))
  keep = [True] * n
  for i in inputs:
    keep[i] = False
  sinks = tuple(
    i for i in sorted(sinks) if keep[i] and descs[i].startswith("__getitem__")
  )
  for i in sinks:
    keep[i] = False
  return keep, inputs, sinks


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
  _, done, augmented, out_edges = _states(dag, source, max_states)
  order = _dfs_topological(out_edges)
  # Ancestors per state (PipeDream's antichain_gr.predecessors).
  anc = [0] * len(order)
  for here, k in enumerate(order):  # here: k's position in the order
    mine = anc[k] | (1 << here)
    for j in out_edges[k]:
      anc[j] |= mine
  ancestors = bitset_rows([anc[k] for k in order], len(order))
  augmented = [augmented[k] for k in order]
  done = [done[k] for k in order]
  done_rows = bitset_rows(done, graph.num_nodes).astype(np.float64)
  # Removed inputs are zeroed by PipeDream and never in ``done``.
  compute = graph.forward_seconds + graph.backward_seconds
  return AntichainDag(
    antichains=tuple(augmented),
    done=tuple(done),
    ancestors=ancestors,
    compute_seconds=done_rows @ compute,
    activation_bytes=done_rows @ graph.activation_bytes,
    parameter_bytes=done_rows @ graph.parameter_bytes,
    output_bytes=_output_bytes(graph, augmented, done),
    removed_inputs=inputs,
    removed_sinks=sinks,
  )


def _output_bytes(graph: ProfileGraph, augmented, done) -> np.ndarray:
  """``_crossing_bytes`` of every state, [S]. Without ``edge_bytes``, each
  state's activations added in its list's order at once (numpy's own sum
  of fewer than 8 values; longer lists summed again by numpy, unless the
  bytes are integers that any order adds exactly)."""
  act = graph.activation_bytes
  if graph.edge_bytes is not None:
    return np.array(
      [
        _crossing_bytes(graph, a, m)
        for a, m in zip(augmented, done, strict=True)
      ]
    )
  lengths = np.fromiter(map(len, augmented), np.intp, len(augmented))
  nodes = np.fromiter(
    itertools.chain.from_iterable(augmented), np.intp, lengths.sum()
  )
  rows = np.repeat(np.arange(len(augmented)), lengths)
  out = np.bincount(rows, act[nodes], minlength=len(augmented))
  long = np.flatnonzero(lengths >= 8)
  if long.size and not (
    np.all(act == np.round(act)) and np.abs(act).sum() < 2**53
  ):
    for s in long.tolist():
      out[s] = act[list(augmented[s])].sum()
  return out


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
