"""SD-Pipe's epoch end without a global barrier.

The last stage's scheduler counts replica steps (``acc``). When the count
crosses a multiple of ``N * sync_every`` (every worker's share of the
epoch, on average), the epoch is over: the next arrival of each of the N
workers records its batch id, and that worker's pipeline stops feeding
there and drains. Fast pipelines have done more batches than slow ones;
nobody waited for anybody.
"""

import threading


class EpochEnd:
  """Counts steps and records where each worker stops.

  Args:
    num_workers: N.
    sync_every: batches per worker in an epoch (on average).
  """

  def __init__(self, num_workers: int, sync_every: int):
    if sync_every < 1:
      raise ValueError(
        f"sync_every (batches per epoch) must be >= 1, got {sync_every}"
      )
    self.n = num_workers
    self.sync_every = sync_every
    self.acc = 0
    self.pending = False
    self.stops: dict[int, int] = {}  # rank -> batch id it stops at

  def arrive(self, rank: int, batch_id: int) -> None:
    """A worker's step of ``batch_id`` reached the last stage: it records
    its stop if the epoch is over and it has none yet."""
    if self.pending and rank not in self.stops:
      self.stops[rank] = batch_id

  def add(self, count: int) -> None:
    """``count`` more replica steps were taken."""
    before, self.acc = self.acc, self.acc + count
    every = self.n * self.sync_every
    if self.acc // every > before // every:
      self.pending = True

  @property
  def over(self) -> bool:
    """Every worker recorded its stop."""
    return len(self.stops) == self.n

  def new_epoch(self, batches: int | None = None) -> None:
    """A new epoch; ``batches``: one of that many batches per worker (on
    average) instead of ``sync_every`` (the rest of an epoch a stop
    request cut short: ``StopCalls.cut``)."""
    self.pending = False
    self.stops = {}
    if batches is not None:
      every = self.n * self.sync_every
      # The count crosses the next multiple after N * batches more steps.
      self.acc = (self.acc // every + 1) * every - self.n * min(
        batches, self.sync_every
      )


class SharedEpochEnd:
  """``EpochEnd`` for every pipeline's thread (and, across processes,
  served by process 0): each last-stage step counts."""

  def __init__(self, num_workers: int, sync_every: int):
    self._epoch = EpochEnd(num_workers, sync_every)
    self._lock = threading.Lock()

  def step(self, rank: int, batch_id: int) -> None:
    """``rank``'s last stage took the step of ``batch_id``."""
    with self._lock:
      self._epoch.arrive(rank, batch_id)
      self._epoch.add(1)

  def stop_of(self, rank: int) -> int | None:
    """The batch id at which ``rank``'s epoch stops (None: not yet)."""
    with self._lock:
      return self._epoch.stops.get(rank)

  def new_epoch(self, batches: int | None = None) -> None:
    with self._lock:
      self._epoch.new_epoch(batches)


class StopCalls:
  """Where each pipeline's feeding stops, in ``step`` calls, the same in
  every process that runs a part of it.

  A pipeline whose stages sit in several processes is fed by each of
  them, one ``step`` call at a time, and each must make the same calls
  (a call's transfers have two ends). Before each call a process asks
  ``grant(rank, call)``; the process of the last stage, once the epoch
  has recorded its stop, calls ``stop(rank)``, which fixes the stop at
  the most calls granted to any of the pipeline's processes so far: no
  process has passed it, and each runs on to it (the others' grants end
  there). In one process this is the stop at once, as before. With
  ``together`` (all-reduce: every step is a collective of all
  pipelines), one stop for every pipeline: the most calls granted to
  any. ``cut`` (a stop request, from any process) ends the epoch so for
  every pipeline at once, wherever it is.

  Args:
    num_pipelines: P.
    together: one stop for all pipelines.
  """

  def __init__(self, num_pipelines: int, together: bool = False):
    self.p = num_pipelines
    self.together = together
    self._lock = threading.Lock()
    self.new_epoch()

  def grant(self, rank: int, call: int) -> bool:
    """Whether pipeline ``rank`` runs its call ``call`` (0-based, this
    epoch) in the asking process."""
    with self._lock:
      if self._cut:
        self._stop(rank)
      stop = self._stops.get(rank)
      if stop is not None and call >= stop:
        return False
      self._granted[rank] = max(self._granted[rank], call + 1)
      return True

  def stop(self, rank: int) -> int:
    """Fixes (once) and returns the calls pipeline ``rank`` makes this
    epoch."""
    with self._lock:
      return self._stop(rank)

  def _stop(self, rank: int) -> int:
    if rank not in self._stops:
      ranks = range(self.p) if self.together else [rank]
      # At least one call an epoch: one cut before any still trains a
      # step (an epoch of none would count no step to save at).
      stop = max(1, *(self._granted[r] for r in ranks))
      for r in ranks:
        self._stops.setdefault(r, stop)
    return self._stops[rank]

  def cut(self) -> None:
    """Ends the epoch early: each pipeline stops at the calls granted to
    it so far, at least one (its calls under way finish; an all-reduce's
    pipelines at the most granted to any)."""
    with self._lock:
      self._cut = True

  def new_epoch(self) -> None:
    with self._lock:
      self._granted = [0] * self.p
      self._stops: dict[int, int] = {}
      self._cut = False
