"""SD-Pipe's partial-reduce scheduler against a plain restatement."""

import itertools
import threading
import time

import numpy as np
import pytest

from jpipe import parallel


def _reference_groups(gaps, n, rounds, ssp_bound, pairwise):
  """SD-Pipe's getPartner as a plain simulation over known arrival times.

  Worker r computes for ``gaps[r][k]`` seconds before its k-th arrival;
  returns per round (sorted members of each group, graph_sync)."""
  arrive = [gaps[r][0] for r in range(n)]
  count = [0] * n
  wait = [1.0] * n  # ms, per worker
  parent = list(range(n))

  def find(i):
    while parent[i] != i:
      i = parent[i]
    return i

  acc, need_sync, out = 0, False, []
  while len(out) < rounds:
    order = sorted(range(n), key=lambda r: (arrive[r], r))
    first = order[0]
    graph_sync = need_sync
    joined = []
    if graph_sync:  # Everyone in one component, no deadline.
      for r in order:
        joined.append(r)
        parent[find(r)] = find(joined[0])
        if len({find(i) for i in range(n)}) == 1:
          break
      close = arrive[joined[-1]]
    else:
      deadline = arrive[first] + wait[first] / 1000.0
      joined = [r for r in order if arrive[r] < deadline]
      close = arrive[joined[-1]] if len(joined) == n else deadline
      for r in joined:
        parent[find(r)] = find(joined[0])
    members = sorted(joined)
    if pairwise and not graph_sync:
      groups = [tuple(members[i : i + 2]) for i in range(0, len(members), 2)]
    else:
      groups = [tuple(members)]
    out.append((groups, graph_sync))
    for g in groups:
      for r in g:
        wait[r] = (
          min(2 * wait[r], 10.0) if len(g) < 2 else max(0.9 * wait[r], 0.01)
        )
    for r in joined:
      count[r] += 1
      arrive[r] = close + gaps[r][count[r]]
    before, acc = acc, acc + len(joined)
    if acc // (n * ssp_bound) > before // (n * ssp_bound):
      need_sync = True
    if graph_sync:
      parent = list(range(n))
      need_sync = False
  return out


def _run_rounds(gaps, n, rounds, ssp_bound, pairwise):
  """The library's state machine driven by the same arrivals."""
  core = parallel.PartialReduceRounds(n, ssp_bound=ssp_bound, pairwise=pairwise)
  waits = [parallel.AdaptiveWait() for _ in range(n)]
  arrive = [gaps[r][0] for r in range(n)]
  count = [0] * n
  out = []
  while len(out) < rounds:
    r = min(range(n), key=lambda i: (arrive[i], i))
    rounds_before = core.rounds
    if (
      core.deadline is not None
      and not core.graph_sync
      and core.deadline <= arrive[r]
    ):
      now = core.deadline
      core.poll(now)
    else:
      now = arrive[r]
      core.arrive(r, count[r], waits[r].ms, now)
      arrive[r] = np.inf
    if core.rounds == rounds_before:
      continue
    handed = {}
    for rank in range(n):
      group = core.collect(rank)
      if group is not None:
        handed[rank] = group
        waits[rank].update(len(group.members))
        count[rank] += 1
        arrive[rank] = now + gaps[rank][count[rank]]
    groups = sorted({g.members for g in handed.values()})
    out.append((groups, next(iter(handed.values())).graph_sync))
  return out


@pytest.mark.parametrize(
  "n, pairwise, seed",
  [(4, False, 0), (4, False, 1), (6, False, 2), (10, True, 3)],
)
def test_groups_equal_plain_statement(n, pairwise, seed):
  rng = np.random.default_rng(seed)
  # Heterogeneous workers: each has its own speed, plus jitter (seconds).
  speed = rng.uniform(0.001, 0.02, size=n)
  gaps = [speed[r] * rng.uniform(0.5, 1.5, size=400) for r in range(n)]
  ssp_bound = 3
  got = _run_rounds(gaps, n, 120, ssp_bound, pairwise)
  expected = _reference_groups(gaps, n, 120, ssp_bound, pairwise)
  assert got == expected
  # Properties: groups partition a round's arrivals; graph syncs happen.
  assert any(sync for _, sync in got)
  assert any(len(g) < n for groups, _ in got for g in groups)  # partial


def _connected(n, edges):
  parent = list(range(n))

  def find(i):
    while parent[i] != i:
      i = parent[i]
    return i

  for a, b in edges:
    parent[find(a)] = find(b)
  return len({find(i) for i in range(n)}) == 1


def test_graph_sync_connects_every_ssp_bound_window():
  """Between consecutive graph syncs, the union of the groups up to and
  including the graph-sync round connects every worker."""
  n, ssp_bound = 5, 2
  rng = np.random.default_rng(7)
  gaps = [rng.uniform(0.0005, 0.03, size=400) for _ in range(n)]
  rounds = _run_rounds(gaps, n, 150, ssp_bound, False)
  edges = []
  syncs = 0
  for groups, sync in rounds:
    edges += [(g[0], r) for g in groups for r in g]
    if sync:
      assert _connected(n, edges)
      edges, syncs = [], syncs + 1
  assert syncs >= 3


def test_full_round_closes_before_the_deadline():
  core = parallel.PartialReduceRounds(3)
  core.arrive(0, 0, 10.0, now=0.0)
  core.arrive(2, 0, 1.0, now=0.001)
  assert core.collect(0) is None
  core.arrive(1, 0, 1.0, now=0.002)  # All three: closes at once.
  groups = {core.collect(r).members for r in range(3)}
  assert groups == {(0, 1, 2)}


def test_deadline_and_leave():
  core = parallel.PartialReduceRounds(3)
  core.arrive(1, 0, 2.0, now=0.0)
  core.poll(0.0019)
  assert core.collect(1) is None
  core.poll(0.002)  # The first arrival's window (2 ms) passed.
  assert core.collect(1).members == (1,)
  core.arrive(0, 1, 5.0, now=0.01)
  core.arrive(2, 1, 5.0, now=0.011)
  core.leave(1, now=0.012)  # Nobody waits for a drained worker.
  assert core.collect(0).members == (0, 2)
  with pytest.raises(ValueError, match="left the epoch"):
    core.arrive(1, 2, 1.0, now=0.02)


def test_adaptive_wait_doubles_and_shrinks():
  wait = parallel.AdaptiveWait()
  assert [wait.update(1) for _ in range(5)] == [2.0, 4.0, 8.0, 10.0, 10.0]
  assert wait.update(2) == pytest.approx(9.0)
  for _ in range(200):
    wait.update(3)
  assert wait.ms == 0.01


def test_epoch_end_records_each_workers_next_batch():
  """A plain statement: once N * sync_every steps are counted, each
  worker's next arrival is where it stops."""
  epoch = parallel.EpochEnd(3, sync_every=2)
  steps = [(0, 0), (1, 0), (2, 0), (0, 1), (0, 2), (1, 1)]  # 6 = 3 * 2
  for rank, batch in steps:
    epoch.arrive(rank, batch)
    epoch.add(1)
  assert epoch.stops == {}
  for rank, batch in [(0, 3), (0, 4), (2, 1), (1, 2)]:
    epoch.arrive(rank, batch)
    epoch.add(1)
  assert epoch.stops == {0: 3, 2: 1, 1: 2}
  assert epoch.over


def test_epoch_end_of_a_given_length_then_whole_ones():
  """``new_epoch(batches)`` (the rest of an epoch a stop request cut
  short): that epoch ends after N * batches steps; the next ones after
  N * sync_every again, counted on from there."""
  epoch = parallel.EpochEnd(3, sync_every=4)
  epoch.new_epoch(batches=1)
  for k in range(3):
    assert epoch.stops == {}
    epoch.arrive(k, 0)
    epoch.add(1)
  for k in range(3):  # Each worker's next arrival: its stop.
    epoch.arrive(k, 1)
    epoch.add(1)
  assert epoch.over and epoch.stops == {0: 1, 1: 1, 2: 1}
  # The count is at 12 + 3 (the stops' steps): the next epoch ends at 24,
  # its overshoot carried as between whole epochs.
  epoch.new_epoch()
  for k in range(9):
    assert not epoch.pending
    epoch.arrive(k % 3, 2 + k // 3)
    epoch.add(1)
  assert epoch.pending and epoch.stops == {}


def test_epoch_end_in_the_last_stage_scheduler():
  core = parallel.PartialReduceRounds(2, sync_every=2)
  for k in range(2):  # Two full rounds: 4 steps = 2 * 2.
    core.arrive(0, k, 1.0, now=k)
    core.arrive(1, k, 1.0, now=k)
    core.collect(0), core.collect(1)
  assert core.epoch.stops == {}
  core.arrive(1, 2, 1.0, now=5.0)
  assert core.epoch.stops == {1: 2}


def test_threads_get_consistent_groups():
  """Real time: every member of a group is handed the same group, and a
  round's groups never share a worker."""
  n, rounds = 4, 15
  scheduler = parallel.PartialReduceScheduler(
    parallel.PartialReduceRounds(n, ssp_bound=2)
  )
  seen = [[] for _ in range(n)]

  def worker(r):
    wait = parallel.AdaptiveWait()
    for k in range(rounds):
      time.sleep(0.001 * (r + 1))
      group = scheduler.get_group(r, k, wait.ms)
      wait.update(len(group.members))
      seen[r].append(group)
    scheduler.leave(r)

  threads = [threading.Thread(target=worker, args=(r,)) for r in range(n)]
  for t in threads:
    t.start()
  for t in threads:
    t.join(timeout=30)
  assert not any(t.is_alive() for t in threads)
  by_round = {}
  for r in range(n):
    for g in seen[r]:
      assert r in g.members
      by_round.setdefault(g.round, set()).add(g.members)
  for groups in by_round.values():
    assert len(groups) == 1  # One group per round (no pairs below 9).
  assert any(g.graph_sync for gs in seen for g in gs)


def test_gossip_pairs_shared_shuffle():
  pairs = parallel.GossipPairs(6, seed=0)
  rng = np.random.default_rng(0)
  for k in range(5):
    order = rng.permutation(6)
    expected = tuple(
      tuple(sorted(map(int, order[i : i + 2]))) for i in range(0, 6, 2)
    )
    assert pairs.pairs(k) == expected
    assert sorted(itertools.chain(*pairs.pairs(k))) == list(range(6))
  assert parallel.GossipPairs(6, seed=0).pairs(3) == pairs.pairs(3)
  with pytest.raises(ValueError, match="even number"):
    parallel.GossipPairs(3)


def test_hetpipe_cadence_and_push():
  assert [
    b for b in range(1, 31) if parallel.hetpipe_syncs(b, 10, last=False)
  ] == [10, 20, 30]
  assert parallel.hetpipe_syncs(7, 10, last=True)
  server, params, base = np.ones(3), np.array([3.0, 1.0, 0.0]), np.zeros(3)
  out = parallel.push_pull([server], [params], [base], 4)
  np.testing.assert_allclose(out[0], server + (params - base) / 4)


def test_heterogeneity_is_seeded_and_has_its_rate():
  h = parallel.Heterogeneity(
    hetero=0.1, slowdown={3: 2.0}, base_seconds=0.01, seed=5
  )
  delays = [h.delay(1, i) for i in range(4000)]
  assert delays == [h.delay(1, i) for i in range(4000)]
  rate = np.mean([d > 0.01 for d in delays])
  assert rate == pytest.approx(parallel.HETERO_PROBABILITY, abs=0.02)
  assert min(h.delay(3, i) for i in range(100)) == pytest.approx(0.02)
  assert parallel.parse_slowdown("3:2.0, 5:1.5") == {3: 2.0, 5: 1.5}
  with pytest.raises(ValueError, match="DEVICE:FACTOR"):
    parallel.parse_slowdown("3=2")
  with pytest.raises(ValueError, match="below 1"):
    parallel.Heterogeneity(slowdown={0: 0.5})
