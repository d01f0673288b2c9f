"""FTPipe's acyclic partitioning: stages as acyclic subgraphs of the DAG.

A contiguous split cuts one topological order; an acyclic partition may
put any nodes together as long as the stage graph (stage a -> stage b when
a value of a is read in b) has no cycle. Branchy models (Inception,
NASNet, DenseNet, an encoder feeding every decoder layer) balance better
that way: two parallel branches can sit on different stages.

FTPipe's method (autopipe ``-m acyclic``; spec "Automatic partitioner"):

1. an initial split: a random Kahn order of the nodes cut into ``k``
   chunks of equal weight (jpipe: cut by the exact contiguous DP of that
   order -- never worse, and what finds PipeDream's antichain splits on
   the ResNets, which local moves from the program order miss);
2. refinement by moves that keep the stage graph acyclic -- a node may
   move to any stage between its producers' last and its consumers' first
   ("advanced moves"), Fiduccia-Mattheyses passes between two stages
   that also take moves which worsen the objective, then keep the best
   prefix, and "global moves" to any stage, Kahn-checked -- under a balance constraint: no stage's time (or parameter
   bytes) above ``(1 + epsilon)`` times the mean;
3. objective ``stage_time`` (the slowest stage's time, then the spread of
   stage times, then the bytes cut) or ``edge_cut`` (bytes cut, then the
   slowest stage);
4. optionally multilevel: refine a coarsened graph (single-producer /
   single-consumer edges contracted: no cycle can appear) first, then
   each finer level;
5. several random restarts, each also perturbed and refined again a few
   times (iterated local search); the best kept.

jpipe adds one start: the exact contiguous split of the given order
(``solve_contiguous``), so the result is never worse than the contiguous
method under the same cost model; stage times, transfers and memory are
counted exactly as ``solve_contiguous`` counts them. Stages are numbered
in a topological order of the stage graph and the order's last node (the
loss) stays on the last stage, as the runtime needs.
"""

import dataclasses
import heapq

import numpy as np

from jpipe.partition._contiguous import solve_contiguous
from jpipe.partition._cost_model import GraphCosts, MemoryModel, TooFewNodes

OBJECTIVES = ("stage_time", "edge_cut")
CONSTRAINTS = ("time", "memory")


@dataclasses.dataclass(frozen=True)
class AcyclicSolution:
  """Stage of every node and the costs (seconds, bytes), per stage.

  ``stage_of_node[i]`` is node i's stage; every edge u -> v has
  ``stage_of_node[u] <= stage_of_node[v]`` (stages in topological order).
  """

  stage_of_node: tuple[int, ...]
  stage_seconds: tuple[float, ...]
  compute_seconds: tuple[float, ...]
  memory_bytes: tuple[float, ...]
  bottleneck_seconds: float
  cut_bytes: float


def solve_acyclic(
  costs: GraphCosts,
  num_stages: int,
  *,
  memory: MemoryModel | None = None,
  objective: str = "stage_time",
  constraint: str = "time",
  epsilon: float = 0.1,
  multilevel: bool = False,
  runs: int = 8,
  rounds: int = 10,
  kicks: int = 8,
  seed: int = 0,
) -> AcyclicSolution:
  """Acyclic partition of a DAG's N nodes into ``num_stages`` stages.

  Args:
    costs: the nodes' compute, edges and transfers (``GraphCosts``; the
      nodes in a topological order: every edge goes from a lower to a
      higher index), priced as ``solve_contiguous`` prices them.
    num_stages: stages, 1 <= num_stages <= N.
    memory: each node's bytes and the per-stage limit (``MemoryModel``);
      with a limit no move takes a stage over it.
    objective: "stage_time" or "edge_cut" (see the module docstring).
    constraint, epsilon: FTPipe's balance constraint: no move may take a
      stage's compute ("time") or parameter bytes ("memory", needs the
      memory model's ``param_bytes``) above ``(1 + epsilon)`` times the
      mean (``float("inf")``: none).
    multilevel: refine a coarsened graph first (FTPipe's multilevel).
    runs: random restarts besides the contiguous start.
    rounds: refinement rounds per start (each: advanced moves, one
      Fiduccia-Mattheyses pass over every pair of stages, global moves).
    kicks: per start, times the refined partition is perturbed (a few
      nodes moved at random, keeping it acyclic) and refined again, kept
      when better (iterated local search: it leaves local optima that no
      single pass escapes).
    seed: the restarts' random seed (the result is deterministic).

  Returns:
    The best partition found.
  """
  n = costs.num_nodes
  memory = memory or MemoryModel()
  _check_options(n, num_stages, memory, objective, constraint, epsilon)
  # The exact contiguous split of this order: a start (and the error,
  # naming the stage to relieve, when nothing fits the memory limit).
  contiguous = solve_contiguous(costs, num_stages, memory=memory)
  node = memory.nodes(n)
  cost = costs.compute_seconds
  graph = _Graph(
    cost=cost,
    last_cost=costs.last_compute,
    balance=cost if constraint == "time" else node["param_bytes"],
    held=node["static_bytes"] + node["working_bytes"],
    params=node["param_bytes"],
    acts=node["activation_bytes"],
    edges=costs.edges,
  )
  model = _Model(
    num_stages,
    costs,
    memory,
    objective=objective,
    limit=(1.0 + epsilon) * graph.balance.sum() / num_stages,
    scale=float(cost.sum()) or 1.0,
  )
  rng = np.random.default_rng(seed)
  starts = [np.asarray(contiguous.stage_of_node())]
  for _ in range(runs):
    order = _random_kahn_order(graph, rng)
    starts.append(_split_order(order, costs, memory, num_stages))
  best = None
  for start in starts:
    if multilevel:
      start = _refine_coarse_first(graph, model, start, rounds, rng)
    state = _State(model, graph, start)
    _refine(state, rounds, rng)
    state = _kick_and_refine(state, kicks, rounds, rng)
    if best is None or state.score() < best.score():
      best = state
  return best.solution()


def _check_options(n, num_stages, memory, objective, constraint, epsilon):
  if not 1 <= num_stages <= n:
    raise TooFewNodes(
      f"cannot split {n} nodes into {num_stages} stages: use between 1 and "
      f"{n} stages, or trace the model at a larger depth to get more nodes"
    )
  if objective not in OBJECTIVES:
    raise ValueError(f"unknown objective {objective!r}: one of {OBJECTIVES}")
  if constraint not in CONSTRAINTS:
    raise ValueError(f"unknown constraint {constraint!r}: one of {CONSTRAINTS}")
  if constraint == "memory" and memory.param_bytes is None:
    raise ValueError("constraint 'memory' balances param_bytes: give them")
  if not epsilon >= 0:
    raise ValueError(f"epsilon must be >= 0, got {epsilon}")


class _Graph:
  """A DAG's per-node weights and adjacency (lists, for the inner loops).

  ``cost``: compute seconds (``last_cost`` on the last stage); ``balance``: what the balance constraint
  sums; ``held``: static + working bytes; ``params``, ``acts``: param and
  activation bytes; all [n]. The last node is the loss.
  """

  def __init__(self, cost, last_cost, balance, held, params, acts, edges):
    self.n = len(cost)
    self.cost = np.asarray(cost, np.float64)
    self.last_cost = np.asarray(last_cost, np.float64)
    self.balance = np.asarray(balance, np.float64)
    self.held = np.asarray(held, np.float64)
    self.params = np.asarray(params, np.float64)
    self.acts = np.asarray(acts, np.float64)
    self.edges = edges
    self.succ = [[] for _ in range(self.n)]  # (node, bytes)
    self.pred = [[] for _ in range(self.n)]
    for (u, v), w in edges.items():
      self.succ[u].append((v, float(w)))
      self.pred[v].append((u, float(w)))

  def contract(self, group) -> "_Graph":
    """The graph of node groups (weights summed, edges merged)."""
    size = int(group.max()) + 1
    edges: dict[tuple[int, int], float] = {}
    for (u, v), w in self.edges.items():
      a, b = int(group[u]), int(group[v])
      if a != b:
        edges[(a, b)] = edges.get((a, b), 0.0) + w
    s = lambda x: np.bincount(group, x, minlength=size)  # noqa: E731
    return _Graph(
      s(self.cost),
      s(self.last_cost),
      s(self.balance),
      s(self.held),
      s(self.params),
      s(self.acts),
      edges,
    )


def _random_kahn_order(graph: _Graph, rng) -> np.ndarray:
  """A random topological order (Kahn's algorithm, a random ready node
  each time); the last node stays last (it computes the loss)."""
  n = graph.n
  indeg = np.array([len(p) for p in graph.pred])
  ready = [i for i in range(n) if indeg[i] == 0 and i != n - 1]
  order = []
  while ready:
    i = ready.pop(int(rng.integers(len(ready))))
    order.append(i)
    for v, _ in graph.succ[i]:
      indeg[v] -= 1
      if indeg[v] == 0 and v != n - 1:
        ready.append(v)
  order.append(n - 1)
  if len(order) != n:
    raise ValueError("the graph has a cycle (or the last node feeds another)")
  return np.asarray(order)


def _split_order(order, costs, memory, k) -> np.ndarray:
  """Stage of every node: the order cut by the exact contiguous DP under
  the same model (FTPipe cuts it into chunks of equal weight; the DP's
  cut is never worse, and a random order plus the DP is what finds
  PipeDream's antichain splits on the ResNets). Where no cut of this
  order fits the memory limit: chunks of equal compute."""
  n = len(order)
  position = np.empty(n, np.int64)
  position[order] = np.arange(n)
  try:
    solution = solve_contiguous(
      costs.permuted(order), k, memory=memory.permuted(order)
    )
    of_position = np.asarray(solution.stage_of_node())
  except ValueError:
    cum = np.cumsum(costs.compute_seconds[order])
    cuts = np.searchsorted(cum, cum[-1] * np.arange(1, k) / k) + 1
    cuts = np.maximum.accumulate(np.maximum(cuts, np.arange(1, k)))
    cuts = np.minimum(cuts, n - k + np.arange(1, k))  # Room for the rest.
    of_position = np.searchsorted(cuts, np.arange(n), side="right")
  return of_position[position]


class _Model:
  """What scores a partition: the stage count, transfers, objective and
  the limits (balance, memory)."""

  def __init__(self, k, costs, memory, *, objective, limit, scale):
    self.k = k
    self.bandwidth = costs.bandwidth
    self.comm_model = costs.comm_model
    self.objective = objective
    self.limit = limit
    self.memory_limit = memory.limit
    self.recompute = memory.recompute
    self.scale = scale  # Seconds that ties are compared relative to.
    self.extra = memory.versions(k) - 1.0  # Stashed copies.
    self.flight = memory.flight(k)


class _State:
  """A partition of ``graph`` with its per-stage sums, updated move by
  move (lists: k is small and these run in the inner loops)."""

  def __init__(self, model: _Model, graph: _Graph, stage):
    self.m = model
    self.g = g = graph
    k = model.k
    self.stage = stage = np.asarray(stage, np.int64).copy()
    sums = lambda x: np.bincount(stage, x, minlength=k).tolist()  # noqa: E731
    self.comp = sums(g.cost)
    self.comp[k - 1] = float(g.last_cost[stage == k - 1].sum())
    self.bal = sums(g.balance)
    self.held = sums(g.held)
    self.par = sums(g.params)
    self.act = sums(g.acts)
    self.size = np.bincount(stage, minlength=k).tolist()
    self.inb = [0.0] * k
    self.outb = [0.0] * k
    self.cut = 0.0
    self.links = [[0] * k for _ in range(k)]  # Edges from stage a to b.
    for (u, v), w in g.edges.items():
      if stage[u] != stage[v]:
        self.outb[stage[u]] += w
        self.inb[stage[v]] += w
        self.cut += w
        self.links[stage[u]][stage[v]] += 1
    self.times = [self._time(s) for s in range(k)]

  # -- costs ---------------------------------------------------------------

  def _time(self, s) -> float:
    c = self.comp[s]
    bw = self.m.bandwidth
    if bw is None:
      return c
    t_in, t_out = 2.0 * self.inb[s] / bw, 2.0 * self.outb[s] / bw
    if self.m.comm_model == "overlapped":
      return max(c, t_in, t_out)
    return c + max(0.0, t_in - c) + max(0.0, t_out - c)

  def memory(self, s) -> float:
    m = self.m
    kept = self.inb[s] if m.recompute else self.act[s]
    return self.held[s] + m.extra[s] * self.par[s] + m.flight[s] * kept

  def score(self) -> tuple:
    """Smaller is better: first the bytes over the memory limit (and, for
    "edge_cut", over the balance), then the objective. Times compare to
    1e-9 of the total so that float rounding in the running sums does not
    decide ties."""
    m = self.m
    over = 0.0
    if m.memory_limit is not None:
      worst_memory = max(self.memory(s) for s in range(m.k))
      over = max(0.0, worst_memory - m.memory_limit)
    worst = round(max(self.times) / m.scale, 9)
    if m.objective == "edge_cut":
      return (over, max(0.0, max(self.bal) - m.limit), self.cut, worst)
    spread = round(sum((t / m.scale) ** 2 for t in self.times), 9)
    return (over, worst, spread, self.cut)

  # -- moves ---------------------------------------------------------------

  def movable_range(self, v) -> tuple[int, int]:
    """Stages v may move to keeping every edge non-decreasing."""
    g = self.g
    if v == g.n - 1:  # The loss stays on the last stage.
      return self.m.k - 1, self.m.k - 1
    lo = max((self.stage[u] for u, _ in g.pred[v]), default=0)
    hi = min((self.stage[w] for w, _ in g.succ[v]), default=self.m.k - 1)
    return int(lo), int(hi)

  def allowed(self, v, dst) -> bool:
    """The balance constraint and the memory limit hold after the move
    (a stage already over keeps what it has but takes no more)."""
    g, m = self.g, self.m
    src = self.stage[v]
    if self.size[src] == 1:
      return False  # Every stage keeps a node.
    if self.bal[dst] + g.balance[v] > m.limit and g.balance[v] > 0:
      return False
    if m.memory_limit is None:
      return True
    before = {s: self.memory(s) for s in self._touched(v, dst)}
    self.move(v, dst)
    ok = all(self.memory(s) <= max(m.memory_limit, before[s]) for s in before)
    self.move(v, src)
    return ok

  def _touched(self, v, dst):
    g = self.g
    out = {int(self.stage[v]), int(dst)}
    out.update(int(self.stage[u]) for u, _ in g.pred[v])
    out.update(int(self.stage[w]) for w, _ in g.succ[v])
    return out

  def move(self, v, dst) -> None:
    g = self.g
    src = int(self.stage[v])
    if src == dst:
      return
    touched = self._touched(v, dst)
    st = self.stage
    links = self.links
    for u, w in g.pred[v]:
      if st[u] != src:
        self.outb[st[u]] -= w
        self.inb[src] -= w
        self.cut -= w
        links[st[u]][src] -= 1
      if st[u] != dst:
        self.outb[st[u]] += w
        self.inb[dst] += w
        self.cut += w
        links[st[u]][dst] += 1
    for x, w in g.succ[v]:
      if st[x] != src:
        self.outb[src] -= w
        self.inb[st[x]] -= w
        self.cut -= w
        links[src][st[x]] -= 1
      if st[x] != dst:
        self.outb[dst] += w
        self.inb[st[x]] += w
        self.cut += w
        links[dst][st[x]] += 1
    last = self.m.k - 1
    self.comp[src] -= g.last_cost[v] if src == last else g.cost[v]
    self.comp[dst] += g.last_cost[v] if dst == last else g.cost[v]
    for arr, x in (
      (self.bal, g.balance[v]),
      (self.held, g.held[v]),
      (self.par, g.params[v]),
      (self.act, g.acts[v]),
      (self.size, 1),
    ):
      arr[src] -= x
      arr[dst] += x
    st[v] = dst
    for s in touched:
      self.times[s] = self._time(s)

  def stage_order(self) -> list[int] | None:
    """The stages in a topological order of the stage graph, the loss's
    stage last; None when the stage graph has a cycle or the loss's
    stage feeds another (Kahn's algorithm, O(k^2))."""
    k, links = self.m.k, self.links
    loss = int(self.stage[-1])
    if any(links[loss]):
      return None
    indegree = [sum(links[a][b] > 0 for a in range(k)) for b in range(k)]
    ready = [s for s in range(k) if indegree[s] == 0 and s != loss]
    order = []
    while ready:
      a = min(ready)
      ready.remove(a)
      order.append(a)
      for b in range(k):
        if links[a][b] > 0:
          indegree[b] -= 1
          if indegree[b] == 0 and b != loss:
            ready.append(b)
    return order + [loss] if len(order) == k - 1 else None

  def renumber(self) -> None:
    """Stages renumbered in ``stage_order`` (every edge goes forward)."""
    order = self.stage_order()
    if order == list(range(self.m.k)):
      return
    label = np.empty(self.m.k, np.int64)
    label[np.asarray(order)] = np.arange(self.m.k)
    fresh = _State(self.m, self.g, label[self.stage])
    self.__dict__.update(fresh.__dict__)

  def score_after(self, v, dst) -> tuple:
    src = int(self.stage[v])
    self.move(v, dst)
    score = self.score()
    self.move(v, src)
    return score

  def solution(self) -> AcyclicSolution:
    """The partition, its costs summed afresh (not the running sums)."""
    fresh = _State(self.m, self.g, self.stage)
    return AcyclicSolution(
      stage_of_node=tuple(int(s) for s in fresh.stage),
      stage_seconds=tuple(float(t) for t in fresh.times),
      compute_seconds=tuple(float(c) for c in fresh.comp),
      memory_bytes=tuple(float(fresh.memory(s)) for s in range(self.m.k)),
      bottleneck_seconds=float(max(fresh.times)),
      cut_bytes=float(fresh.cut),
    )


def _refine(state: _State, rounds: int, rng) -> None:
  """Advanced moves, Fiduccia-Mattheyses passes and global moves until
  none helps."""
  for _ in range(rounds):
    before = state.score()
    _advanced_moves(state, rng)
    _fm_passes(state, rng)
    _global_moves(state, rng)
    if not state.score() < before:
      return


def _kick_and_refine(state: _State, kicks: int, rounds: int, rng) -> _State:
  """Iterated local search: ``kicks`` times, move a few random nodes to a
  random stage of their movable range, refine, keep the result if it is
  better than the best so far."""
  best = state
  count = max(2, state.g.n // 20)
  for _ in range(kicks):
    trial = _State(best.m, best.g, best.stage)
    for v in rng.choice(
      trial.g.n - 1, min(count, trial.g.n - 1), replace=False
    ):
      lo, hi = trial.movable_range(v)
      dst = int(rng.integers(lo, hi + 1))
      if dst != trial.stage[v] and trial.allowed(v, dst):
        trial.move(v, dst)
    _refine(trial, rounds, rng)
    if trial.score() < best.score():
      best = trial
  return best


def _global_moves(state: _State, rng) -> None:
  """FTPipe's global moves: each node, in random order, to whichever
  stage improves the objective most while the stage graph stays acyclic
  (checked by Kahn's algorithm: the move may reorder the stages, which
  are then renumbered). A move to a stage that one of the node's
  consumers' stages reaches, or that reaches one of its producers'
  stages, would close a cycle: those are skipped without trying."""
  g, k = state.g, state.m.k
  reach = _reachable(state.links)
  for v in rng.permutation(g.n - 1):  # The loss stays.
    src = int(state.stage[v])
    lo, hi = state.movable_range(v)
    producers = {int(state.stage[u]) for u, _ in g.pred[v]}
    consumers = {int(state.stage[w]) for w, _ in g.succ[v]}
    best, best_dst = state.score(), None
    for dst in range(k):
      if lo <= dst <= hi:  # Advanced moves' ground: already tried.
        continue
      if any(reach[q, dst] for q in consumers if q != dst) or any(
        reach[dst, p] for p in producers if p != dst
      ):
        continue
      if not state.allowed(v, dst):
        continue
      state.move(v, dst)
      if state.stage_order() is not None and state.score() < best:
        best, best_dst = state.score(), dst
      state.move(v, src)
    if best_dst is not None:
      state.move(v, best_dst)
      state.renumber()
      reach = _reachable(state.links)


def _reachable(links) -> np.ndarray:
  """reach[a, b]: a path of one or more edges leads from stage a to b."""
  reach = np.asarray(links) > 0
  for m in range(len(reach)):  # Warshall.
    reach = reach | (reach[:, m : m + 1] & reach[m : m + 1, :])
  return reach


def _advanced_moves(state: _State, rng) -> None:
  """Greedy: each node, in random order, to the stage in its movable
  range that improves the objective most; until no move improves."""
  n = state.g.n
  improved = True
  while improved:
    improved = False
    for v in rng.permutation(n):
      lo, hi = state.movable_range(v)
      if lo == hi:
        continue
      current = state.score()
      best, best_dst = current, None
      for dst in range(lo, hi + 1):
        if dst != state.stage[v] and state.allowed(v, dst):
          score = state.score_after(v, dst)
          if score < best:
            best, best_dst = score, dst
      if best_dst is not None:
        state.move(v, best_dst)
        improved = True


def _fm_passes(state: _State, rng) -> None:
  """One Fiduccia-Mattheyses pass per pair of stages, in random order."""
  k = state.m.k
  pairs = [(a, b) for a in range(k) for b in range(a + 1, k)]
  for idx in rng.permutation(len(pairs)):
    _fm_pass(state, *pairs[idx], rng)


def _fm_pass(state: _State, a: int, b: int, rng, patience: int = 64) -> None:
  """Fiduccia-Mattheyses between stages a < b: move the best movable node
  -- of a, with all its consumers at b or later, to b; of b, with all its
  producers at a or earlier, to a -- even when that worsens the
  objective, each node once, until ``patience`` moves bring nothing; then
  return to the best partition seen. Priorities are lazy: a node's score
  is re-evaluated when it surfaces; ties go a random way (each restart
  explores its own path)."""
  g = state.g

  def target(v):
    s = state.stage[v]
    if v == g.n - 1:
      return None
    if s == a and all(state.stage[w] >= b for w, _ in g.succ[v]):
      return b
    if s == b and all(state.stage[u] <= a for u, _ in g.pred[v]):
      return a
    return None

  heap = []

  def push(v):
    dst = target(v)
    if dst is not None and state.allowed(v, dst):
      tie = float(rng.random())
      heapq.heappush(heap, (state.score_after(v, dst), tie, int(v), dst))

  for v in np.flatnonzero((state.stage == a) | (state.stage == b)):
    push(v)
  best = state.score()
  since_best: list[tuple[int, int]] = []  # (node, its stage before)
  locked = set()
  while heap and len(since_best) < patience:
    _, tie, v, dst = heapq.heappop(heap)
    if v in locked or target(v) != dst or not state.allowed(v, dst):
      continue
    score = state.score_after(v, dst)
    if heap and score > heap[0][0]:  # Stale: re-queue at its real score.
      heapq.heappush(heap, (score, tie, v, dst))
      continue
    locked.add(v)
    since_best.append((v, int(state.stage[v])))
    state.move(v, dst)
    if state.score() < best:
      best = state.score()
      since_best.clear()
    for w, _ in g.succ[v] + g.pred[v]:  # Moving v may free them.
      if w not in locked:
        push(w)
  for v, src in reversed(since_best):
    state.move(v, src)


def _refine_coarse_first(graph, model, start, rounds, rng) -> np.ndarray:
  """FTPipe's multilevel refinement: contract edges within a stage until
  the graph has about 2k nodes (or stops shrinking), refine the coarsest
  graph, then project to each finer one and refine again; returns the
  finest level's stages before its own refinement."""
  levels = []  # (finer graph, group of each of its nodes)
  g, stage = graph, np.asarray(start)
  while g.n > 2 * model.k:
    group = _matching(g, stage)
    size = int(group.max()) + 1
    if size >= g.n:
      break
    coarse_stage = np.zeros(size, np.int64)
    coarse_stage[group] = stage
    levels.append((g, group))
    g, stage = g.contract(group), coarse_stage
  for finer, group in reversed(levels):
    state = _State(model, g, stage)
    _refine(state, rounds, rng)
    g, stage = finer, state.stage[group]
  return stage


def _matching(g: _Graph, stage) -> np.ndarray:
  """Group index of each node: pairs joined along an edge that is its
  source's only out-edge or its target's only in-edge (contracting it
  creates no cycle), both ends on one stage, heaviest bytes first; the
  last node (the loss) stays alone and last."""
  group = -np.ones(g.n, np.int64)
  candidates = sorted(
    (-w, u, v)
    for u in range(g.n)
    for v, w in g.succ[u]
    if stage[u] == stage[v]
    and (len(g.succ[u]) == 1 or len(g.pred[v]) == 1)
    and v != g.n - 1
  )
  for _, u, v in candidates:
    if group[u] < 0 and group[v] < 0:
      group[u] = group[v] = u
  singles = group < 0
  group[singles] = np.flatnonzero(singles)
  # Number groups by their first node: the loss (alone) gets the last.
  ids, first = np.unique(group, return_index=True)
  new_id = np.empty(len(ids), np.int64)
  new_id[np.argsort(first)] = np.arange(len(ids))
  return new_id[np.searchsorted(ids, group)]
