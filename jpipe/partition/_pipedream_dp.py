"""The dynamic program of PipeDream's optimizer, vectorized over states.

``compute_partitioning`` of ``optimizer_graph_hierarchical.py`` fills
``A[i][j][m]`` (states i..j on m+1 machines) with Python loops over
(i, m, j, k, m'). Here, for each (i, m, m'), all (k, j) pairs with k a
predecessor of j are evaluated at once and reduced per j with
``np.minimum.reduceat``; only the values are kept. The backtrack
re-evaluates the few cells it visits, with the same arithmetic, to find
the choice (PipeDream's ``(time, split, replicas)`` tuple) in PipeDream's
order: one replicated stage, then (with ``use_fewer_machines``) m-1
machines, then splits by ascending m' and predecessor state, keeping the
first strictly better one.
"""

import math

import numpy as np


class RangeTable:
  """PipeDream's range table of per-state sums, entries made when indexed.

  ``T[0][j]`` is the sum of ``parts`` at state j; ``T[i][j]`` for i >= 1
  is that less the sum at state i-1 (states i..j), ``fill`` where j < i
  (PipeDream's None). Indexed like the dense (S+1, S) array would be (a
  row ``T[i]``, or ``T[rows, cols]``) without building it: a one-level DP
  reads row 0 and one entry per split pair. Several parts are differenced
  one by one and then added, in order (the stash is act + params).
  """

  def __init__(self, parts: tuple[np.ndarray, ...], fill: float):
    self.parts = parts
    self.fill = fill
    self.num_states = parts[0].shape[0]
    self._rows = {}  # The DP and its backtrack read a few rows often.

  def __getitem__(self, index) -> np.ndarray:
    if isinstance(index, tuple):
      return self._entries(*(np.asarray(x) for x in index))
    if index not in self._rows:
      self._rows[index] = self._entries(
        np.full(self.num_states, index), np.arange(self.num_states)
      )
    return self._rows[index]

  def pairs(self, k, counts):
    """``T[k+1][j]`` for split pairs (each k < j), as ``T[k+1, j]`` would
    give them: a part's difference at j and k, the parts then added.
    ``counts[j]`` pairs end at each j, in order."""
    total = None
    for part in self.parts:
      diff = np.repeat(part, counts)  # part[j] per pair
      diff -= part[k]
      total = diff if total is None else total + diff
    return total

  def _entries(self, rows, cols):
    before = np.maximum(rows - 1, 0)
    total = None
    for part in self.parts:
      diff = part[cols] - np.where(rows > 0, part[before], 0.0)
      total = diff if total is None else total + diff
    return np.where(cols >= rows, total, self.fill)


class Model:
  """One PipeDream problem: the DAG's range tables and the flags.

  Args:
    dag: an ``_antichain.AntichainDag``.
    machines, bandwidths: per level, innermost first.
    memory: bytes per machine, or None for no memory constraint.
    straight, fewer: ``--straight_pipeline``, ``--use_fewer_machines``.
    rc: activation compression ratio, or None (transfers ignored).
  """

  def __init__(self, dag, machines, bandwidths, memory, straight, fewer, rc):
    self.dag = dag
    self.machines = machines
    self.bandwidths = bandwidths
    self.memory = memory
    self.straight = straight
    self.fewer = fewer
    self.rc = rc
    self.num_states = s = dag.num_states
    self.compute = RangeTable((dag.compute_seconds,), np.inf)
    self.par = RangeTable((dag.parameter_bytes,), 0.0)
    self.stash = RangeTable((dag.activation_bytes, dag.parameter_bytes), 0.0)
    # Pairs (k, j), k a predecessor of j, sorted by j then k: pair_k, and
    # where each j's pairs start (j itself only where a level needs it).
    flat = np.flatnonzero(dag.ancestors)  # j * s + k
    self.first_pair = np.searchsorted(flat, np.arange(s + 1) * s)
    flat -= np.repeat(np.arange(0, s * s, s), np.diff(self.first_pair))
    self.pair_k = flat
    self.out = dag.output_bytes
    self.not_last = np.arange(s) < s - 1

  def work(self) -> float:
    """Element operations of the DP, to refuse ones that run for minutes."""
    total = 0.0
    for level, m in enumerate(self.machines):
      final = level == len(self.machines) - 1
      pairs = self.pair_k.size * (1 if final else self.num_states / 3)
      total += pairs * m * (m - 1) / 2 + self.num_states * m
    return total

  def solve(self, need: bool = False):
    """Per level (innermost first), (costs, A of shape [rows, S, M]).

    ``need``: instead of the time, the smallest memory under which each
    entry is feasible (min over choices of the largest stash).
    """
    out = []
    time_table = self.compute
    need_table = RangeTable((np.zeros(self.num_states),), np.inf)
    g = 1
    for level, m in enumerate(self.machines):
      final = level == len(self.machines) - 1
      costs = LevelCosts(self, level, g, time_table, need_table, need)
      rows = [0] if final else list(range(self.num_states + 1))
      a = level_dp(costs, rows)
      out.append((costs, a))
      if need:
        need_table = a[:, :, m - 1]
      else:
        time_table = a[:, :, m - 1]
      g = m
    return out


class LevelCosts:
  """Base-case and last-stage terms of one level (time or memory need)."""

  def __init__(self, model, level, g, time_table, need_table, need):
    self.model = model
    self.m_total = model.machines[level]
    self.b = model.bandwidths[level]
    self.g = g
    self.need = need
    self.time = time_table
    self.need_table = need_table
    self._base = {}
    self._x = {}  # m' -> last-stage time per pair (no memory mask)
    self._stash_p = self._par_p = None  # per pair, made when first read
    if need:
      self.need_p = _pair_values(model, need_table)
    else:
      self.t_p = _pair_values(model, time_table)

  def stash_p(self):
    """Stashed bytes of the last stage, per pair (made when first used:
    only memory constraints read it)."""
    if self._stash_p is None:
      self._stash_p = _pair_values(self.model, self.model.stash)
    return self._stash_p

  def x(self, mp):
    """Last-stage time per pair on m' machines (no memory mask)."""
    if mp not in self._x:
      if mp == 1:  # no all-reduce: 4 (m'-1) P is 0
        self._x[mp] = self.t_p
      else:
        if self._par_p is None:
          self._par_p = _pair_values(self.model, self.model.par)
        dp = (4 * (mp - 1) * self._par_p) / (self.b * mp)
        self._x[mp] = (self.t_p + dp) / mp
    return self._x[mp]

  def replicas(self):
    """Replica counts a single stage may have at this level."""
    return range(1, 2 if self.model.straight else self.m_total + 1)

  def splits(self, m):
    """Machines m' the last stage may take out of m+1."""
    return (1,) if self.model.straight else range(1, m + 1)

  def base(self, i):
    """``make_base(i)``, kept (read-only): the backtrack asks for the same
    few rows at each of its steps."""
    if i not in self._base:
      self._base[i] = self.make_base(i)
    return self._base[i]

  def make_base(self, i):
    """[S, M]: states i..j as one stage on r = m+1 machines."""
    model, m_total = self.model, self.m_total
    r = np.arange(1, len(self.replicas()) + 1, dtype=np.float64)
    if self.need or model.memory is not None:
      mem = np.ceil((m_total - r) / r)[None, :] * model.stash[i][:, None]
    if self.need:
      vals = np.maximum(mem, self.need_table[i][:, None])
    else:
      dp = (4 * (r - 1) * model.par[i][:, None]) / (self.b * r) / self.g
      vals = (self.time[i][:, None] + dp) / r
      if model.memory is not None:
        vals = np.where(mem <= model.memory, vals, np.inf)
    out = np.full((model.num_states, m_total), np.inf)
    out[:, : r.size] = vals
    return out

  def last(self, m, mp, sl):
    """Last stage on m' of m+1 machines, for the pairs in slice ``sl``."""
    if self.need or self.model.memory is not None:
      mult = math.ceil((self.m_total - (m + 1)) / mp)
      stash = self.stash_p()[sl] * mult
      if self.need:
        return np.maximum(stash, self.need_p[sl])
      return np.where(stash <= self.model.memory, self.x(mp)[sl], np.inf)
    return self.x(mp)[sl]

  def floors(self, mp):
    """(per k, per j) transfer times that bound a split, or (None, None)."""
    model = self.model
    if self.need or model.rc is None:
      return None, None
    scale = self.b * mp * model.rc
    k_floor = 2.0 * model.out / scale
    j_floor = np.where(model.not_last, 2.0 * model.out / scale, 0.0)
    return k_floor, j_floor

  def previous(self, a_row, i, m, mp):
    """A[i][k][m-m'] per state k, with the excluded k set to +inf."""
    prev = a_row[:, m - mp]
    if i > 0:  # k may not be a predecessor of state i-1
      prev = np.where(self.model.dag.ancestors[i - 1], np.inf, prev)
    k_floor, _ = self.floors(mp)
    if k_floor is not None:
      prev = np.maximum(prev, k_floor)
    return prev


def _pair_values(model, table):
  """``table[k+1][j]`` per split pair: a RangeTable's, or a level's A."""
  counts = np.diff(model.first_pair)
  if isinstance(table, RangeTable):
    return table.pairs(model.pair_k, counts)
  return table[model.pair_k + 1, np.repeat(np.arange(model.num_states), counts)]


def level_dp(costs, rows):
  """A[i][j][m] for the given rows i: [len(rows), S, M]."""
  model = costs.model
  s, m_total = model.num_states, costs.m_total
  a = np.full((len(rows), s, m_total), np.inf)
  for ri, i in enumerate(rows):
    a[ri] = costs.make_base(i)
    if i + 1 >= s:
      continue
    p0 = model.first_pair[i + 1]
    sl = slice(p0, model.pair_k.size)
    ks = model.pair_k[sl]
    starts = model.first_pair[i + 1 : s] - p0  # every j >= 1 has pairs
    for m in range(1, m_total):
      best = a[ri, i + 1 :, m]
      if model.fewer:
        best = np.minimum(best, a[ri, i + 1 :, m - 1])
      for mp in costs.splits(m):
        prev = costs.previous(a[ri], i, m, mp)
        vals = prev[ks]
        v = np.minimum.reduceat(
          np.maximum(vals, costs.last(m, mp, sl), out=vals), starts
        )
        _, j_floor = costs.floors(mp)
        if j_floor is not None:
          v = np.maximum(v, j_floor[i + 1 :])
        best = np.minimum(best, v)
      a[ri, i + 1 :, m] = best
  return a


def choose(costs, a_row, i, j, m):
  """PipeDream's (split state k or None, machines left, replicas) of
  A[i][j][m], re-evaluated with the DP's arithmetic."""
  model = costs.model
  best = costs.base(i)[j, m]
  choice = (None, -1, m + 1)
  if m < 1 or j < i + 1:  # PipeDream's recurrence skips these cells
    return choice
  if model.fewer and (np.isinf(best) or a_row[j, m - 1] < best):
    best = a_row[j, m - 1]
    choice = choose(costs, a_row, i, j, m - 1)
  sl = slice(model.first_pair[j], model.first_pair[j + 1])
  ks = model.pair_k[sl]
  for mp in costs.splits(m):
    prev = costs.previous(a_row, i, m, mp)
    vals = np.maximum(prev[ks], costs.last(m, mp, sl))
    _, j_floor = costs.floors(mp)
    if j_floor is not None:
      vals = np.maximum(vals, j_floor[j])
    idx = int(vals.argmin())
    if vals[idx] < best:
      best = vals[idx]
      choice = (int(ks[idx]), m - mp, mp)
  return choice


def backtrack(model, levels):
  """PipeDream's ``analyze_partitioning``, outermost level first.

  Returns (innermost stages as ((start, end), replication per level
  innermost first), printout per level innermost first: ((start, end),
  compute seconds, replication) per stage).
  """
  ranges = [((0, model.num_states), ())]
  printed = []
  c = model.dag.compute_seconds
  for level in range(len(levels) - 1, -1, -1):
    costs, a = levels[level]
    final = level == len(levels) - 1
    new_ranges, shown = [], []
    for (start, end), outer in ranges:
      ri = 0 if final else start
      j, m = end - 1, costs.m_total - 1
      cuts, factors = [], []
      while True:
        k, rest, r = choose(costs, a[ri], start, j, m)
        factors.append(r)
        if k is None:
          break
        cuts.append(k + 1)
        j, m = k, rest
      prev = start
      for cut, r in zip(cuts[::-1] + [end], factors[::-1], strict=True):
        t = c[cut - 1] - (c[prev - 1] if prev > 0 else 0.0)
        shown.append(((prev, cut), float(t), r))
        new_ranges.append(((prev, cut), (r, *outer)))
        prev = cut
    printed.append(tuple(shown))
    ranges = new_ranges
  return ranges, tuple(printed[::-1])


def max_stages(ancestors: np.ndarray) -> int:
  """Longest chain of states ending at the last one (most stages)."""
  depth = np.ones(ancestors.shape[0], np.int64)
  for j in range(ancestors.shape[0]):
    if ancestors[j].any():
      depth[j] = 1 + depth[ancestors[j]].max()
  return int(depth[-1])
