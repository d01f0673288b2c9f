"""SD-Pipe's partial-reduce scheduler: which replicas of a stage average.

SD-Pipe (its ps-lite ``preduce_handler.cc`` and ``hetu/preduce.py``) runs
one scheduler per stage. After its local optimizer step, a replica (one
per pipeline: its *rank*) asks the scheduler for a group and the group
averages its weights. Groups form from arrival order:

- A round starts with its first arrival, which sets the deadline (now +
  that worker's wait window) and decides whether the round is a
  graph-sync round (one was asked for, no other stage holds the one
  graph-sync token, and every worker is still training).
- A normal round closes when every active worker has arrived or at the
  deadline. Beyond 8 workers it hands out consecutive pairs of the sorted
  arrivals (an odd one alone).
- A graph-sync round has no deadline: it closes once the union of the
  groups since the last graph sync (a disjoint set over ranks, each
  arrival joined to the round's first) is one connected component (with
  pairs: once the arrivals meet every component, and the round is one
  group). So the sync graph is connected at least every ``ssp_bound``
  rounds' worth of arrivals.
- Bookkeeping when a round closes: ``acc += |arrivals|``; crossing a
  multiple of ``N * ssp_bound`` asks for a graph sync; a graph-sync round
  resets the disjoint set. On the last stage, crossing a multiple of
  ``N * sync_every`` ends the epoch (``EpochEnd``).

``PartialReduceRounds`` is that state machine over explicit times (pure,
testable with scripted arrivals); ``PartialReduceScheduler`` runs it for
threads in real time. ``AdaptiveWait`` is the worker's window: 1 ms,
doubled (up to 10 ms) after a group of fewer than 2, else shrunk by 0.9
(down to 0.01 ms).
"""

import dataclasses
import threading
import time

from jpipe.parallel._epoch import EpochEnd

PAIRWISE_ABOVE = 8  # SD-Pipe pairs workers beyond this many.


class GraphSyncToken:
  """The one-stage-at-a-time lock on graph-sync rounds, shared by the
  schedulers of all stages (SD-Pipe's global key lock)."""

  def __init__(self):
    self.holder = None

  def try_take(self, key) -> bool:
    if self.holder in (None, key):
      self.holder = key
      return True
    return False

  def release(self, key) -> None:
    if self.holder == key:
      self.holder = None


class _DisjointSet:
  def __init__(self, n):
    self.parent = list(range(n))

  def find(self, i):
    while self.parent[i] != i:
      self.parent[i] = self.parent[self.parent[i]]
      i = self.parent[i]
    return i

  def union(self, i, j):
    self.parent[self.find(i)] = self.find(j)

  def components(self, members):
    return {self.find(i) for i in members}


@dataclasses.dataclass(frozen=True)
class Group:
  """A closed round's group: ``members`` (sorted ranks) average together;
  ``round`` numbers the stage's rounds; ``graph_sync`` marks a graph-sync
  round."""

  members: tuple[int, ...]
  round: int
  graph_sync: bool


class PartialReduceRounds:
  """One stage's partial-reduce scheduler as a state machine.

  Args:
    num_workers: N, the replicas of the stage (pipelines).
    ssp_bound: rounds' worth of arrivals (N each) between graph syncs.
    sync_every: on the last stage, batches per worker in an epoch (None:
      no epoch end here).
    key: the stage's scheduler key (SD-Pipe: ``S - 1 - stage``, 0 = last).
    token: the graph-sync token shared by all stages' schedulers.
    pairwise: hand out pairs (default: more than 8 workers).
  """

  def __init__(
    self,
    num_workers: int,
    *,
    ssp_bound: int = 10,
    sync_every: int | None = None,
    key: int = 0,
    token: GraphSyncToken | None = None,
    pairwise: bool | None = None,
  ):
    if num_workers < 1:
      raise ValueError(f"num_workers must be >= 1, got {num_workers}")
    if ssp_bound < 1:
      raise ValueError(f"ssp_bound must be >= 1, got {ssp_bound}")
    self.n = num_workers
    self.ssp_bound = ssp_bound
    self.key = key
    self.token = token or GraphSyncToken()
    self.pairwise = (
      num_workers > PAIRWISE_ABOVE if pairwise is None else pairwise
    )
    self.epoch = (
      None if sync_every is None else EpochEnd(num_workers, sync_every)
    )
    self.active = set(range(num_workers))
    self.sets = _DisjointSet(num_workers)
    self.acc = 0
    self.need_graph_sync = False
    self.rounds = 0
    # The open round.
    self.ready: list[int] = []
    self.deadline = None
    self.graph_sync = False
    # rank -> its group, from the round that closed (until it collects it).
    self.handed: dict[int, Group] = {}

  # -- events ----------------------------------------------------------------

  def arrive(self, rank: int, batch_id: int, wait_ms: float, now: float):
    """Worker ``rank`` asks for a group at time ``now`` (seconds) after
    its step of batch ``batch_id``; ``wait_ms`` is its window. Closes the
    round if this arrival completes it."""
    if rank not in self.active:
      raise ValueError(f"worker {rank} left the epoch; it cannot arrive")
    if rank in self.ready or rank in self.handed:
      raise ValueError(f"worker {rank} is already waiting for a group")
    if self.epoch is not None:
      self.epoch.arrive(rank, batch_id)
    if not self.ready:
      self.deadline = now + wait_ms / 1000.0
      self.graph_sync = (
        self.need_graph_sync
        and len(self.active) == self.n
        and self.token.try_take(self.key)
      )
    self.ready.append(rank)
    self.sets.union(rank, self.ready[0])
    self._try_close(now)

  def poll(self, now: float) -> None:
    """Closes the round if its deadline has passed."""
    self._try_close(now)

  def leave(self, rank: int, now: float) -> None:
    """Worker ``rank`` stops asking (its pipeline drains): rounds no
    longer wait for it."""
    self.active.discard(rank)
    self._try_close(now)

  def rejoin_all(self, batches: int | None = None) -> None:
    """A new epoch (of ``batches`` per worker, where not ``sync_every``):
    every worker takes part again."""
    self.active = set(range(self.n))
    if self.epoch is not None:
      self.epoch.new_epoch(batches)

  def collect(self, rank: int) -> Group | None:
    """The group handed to ``rank`` (once), or None while its round is
    open."""
    return self.handed.pop(rank, None)

  # -- closing a round -------------------------------------------------------

  def _closes(self, now: float) -> bool:
    if not self.ready:
      return False
    if self.graph_sync:
      if self.pairwise:  # The arrivals meet every component.
        return self.sets.components(self.ready) == self.sets.components(
          self.active
        )
      return len(self.sets.components(self.active)) == 1
    return len(self.ready) >= len(self.active) or now >= self.deadline

  def _try_close(self, now: float) -> None:
    if not self._closes(now):
      return
    ready, graph_sync = sorted(self.ready), self.graph_sync
    if self.pairwise and not graph_sync:
      groups = [tuple(ready[i : i + 2]) for i in range(0, len(ready), 2)]
    else:
      groups = [tuple(ready)]
    for members in groups:
      for r in members:
        self.handed[r] = Group(members, self.rounds, graph_sync)
    self.rounds += 1
    before, self.acc = self.acc, self.acc + len(ready)
    if _crossed(before, self.acc, self.n * self.ssp_bound):
      self.need_graph_sync = True
    if graph_sync:
      self.sets = _DisjointSet(self.n)
      self.need_graph_sync = False
      self.token.release(self.key)
    if self.epoch is not None:
      self.epoch.add(len(ready))
    self.ready, self.deadline, self.graph_sync = [], None, False


def _crossed(before: int, after: int, every: int) -> bool:
  """Whether (before, after] holds a multiple of ``every``."""
  return after // every > before // every


class AdaptiveWait:
  """A worker's wait window in ms (SD-Pipe's worker side)."""

  def __init__(self, start_ms: float = 1.0, max_ms: float = 10.0):
    self.ms = start_ms
    self.max_ms = max_ms

  def update(self, group_size: int) -> float:
    """The window after a group of ``group_size``."""
    if group_size < 2:
      self.ms = min(2.0 * self.ms, self.max_ms)
    else:
      self.ms = max(0.9 * self.ms, 0.01)
    return self.ms


class PartialReduceScheduler:
  """``PartialReduceRounds`` for threads, in real time: ``get_group``
  blocks like SD-Pipe's getPartner RPC."""

  def __init__(self, rounds: PartialReduceRounds, clock=time.monotonic):
    self.rounds = rounds
    self.clock = clock
    self.lock = threading.Condition()

  def get_group(self, rank: int, batch_id: int, wait_ms: float) -> Group:
    """Waits for ``rank``'s group after its step of ``batch_id``."""
    with self.lock:
      self.rounds.arrive(rank, batch_id, wait_ms, self.clock())
      self.lock.notify_all()
      while True:
        group = self.rounds.collect(rank)
        if group is not None:
          return group
        deadline = self.rounds.deadline
        if self.rounds.graph_sync or deadline is None:
          self.lock.wait()
        else:
          self.lock.wait(max(0.0, deadline - self.clock()))
        self.rounds.poll(self.clock())
        self.lock.notify_all()

  def should_stop(self, rank: int) -> int | None:
    """The batch id at which ``rank``'s epoch stops (None: not yet)."""
    with self.lock:
      epoch = self.rounds.epoch
      return None if epoch is None else epoch.stops.get(rank)

  def leave(self, rank: int) -> None:
    with self.lock:
      self.rounds.leave(rank, self.clock())
      self.lock.notify_all()

  def rejoin_all(self, batches: int | None = None) -> None:
    with self.lock:
      self.rounds.rejoin_all(batches)
