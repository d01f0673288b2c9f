"""Stopping a run on request: SIGTERM / SIGINT, agreed across processes."""

import math
import os
import signal
import time

from jpipe import distributed

_NAMES = ("", "SIGTERM", "SIGINT")


class StopRequest:
  """SIGTERM / SIGINT while inside: ``signal`` holds its name (the loop
  finishes its step or epoch, checkpoints and exits). A second one stops
  the process at once (128 + its number), as a second Ctrl-C does in
  most programs: the user has stopped waiting for the checkpoint."""

  def __init__(self):
    self.signal = None
    self._old = {}

  def __enter__(self):
    for sig in (signal.SIGTERM, signal.SIGINT):
      self._old[sig] = signal.signal(sig, self._handle)
    return self

  def _handle(self, signum, frame):
    del frame
    if self.signal is not None:
      name = signal.Signals(signum).name
      # (os.write: a signal handler must not take print's locks.)
      os.write(
        2,
        f"\n{name} again: exiting at once, without a checkpoint (status "
        f"{128 + signum}); the run resumes from its latest checkpoint.\n".encode(),
      )
      os._exit(128 + signum)
    self.signal = signal.Signals(signum).name

  def __exit__(self, *exc):
    for sig, old in self._old.items():
      signal.signal(sig, old)


def agreed(signal_name):
  """A stop request any process received, known to all (they must stop
  at the same step: the flush and the save are collective). A host
  exchange through the coordinator, made every step: it needs no device,
  so it is safe while the step's transfers are still in flight."""
  got = distributed.agree("stop request", _NAMES.index(signal_name or ""))
  return _NAMES[got] or None


class StopAgreement:
  """``agreed`` at the steps where it is due, for a loop of short steps.

  The exchange costs ~0.3-1 ms (two processes on one machine, measured by
  ``experiments/distributed/sync_cost.py``): every step, ~10 % of a
  small model's step. So processes agree every k steps, k as long as
  keeps the exchange at ~1 % of the time (from its quickest measured
  cost and the last step's time) but no longer than ``max_wait_s`` of
  steps, so a stop request waits at most about that. Process 0 picks
  the next step at each agreement, for everyone: all agree at the same
  steps. In one process every step's request is known at once (free).
  """

  def __init__(self, share: float = 0.01, max_wait_s: float = 1.0):
    self.share, self.max_wait_s = share, max_wait_s
    self.due = 1  # The step count at which the next agreement is made.
    self.fastest = None  # The quickest exchange seen (seconds).

  def __call__(self, done: int, signal_name, step_seconds=None, now=False):
    """The agreed request after ``done`` steps (None: go on); the last
    step took ``step_seconds`` (None: unknown, e.g. it compiled); ``now``:
    agree at this step though not due (every process must pass it alike:
    e.g. an epoch a stop request ended, as every process saw)."""
    if distributed.client() is None:
      return signal_name
    if done < self.due and not now:
      return None
    start = time.perf_counter()
    request = _NAMES.index(signal_name or "")
    got = distributed.exchange(
      "stop request", f"{request} {self._interval(step_seconds)}".encode()
    )
    took = time.perf_counter() - start
    self.fastest = took if self.fastest is None else min(self.fastest, took)
    requests, intervals = zip(*(map(int, g.split()) for g in got), strict=True)
    self.due = done + intervals[0]  # Process 0's choice, for everyone.
    return _NAMES[max(requests)] or None

  def _interval(self, step_seconds) -> int:
    if not step_seconds or self.fastest is None:
      return 1
    affordable = math.ceil(self.fastest / (self.share * step_seconds))
    return max(1, min(affordable, int(self.max_wait_s / step_seconds)))


def exit_code(signal_name) -> int:
  """What a run stopped by ``signal_name`` exits with (128 + its number)."""
  return 128 + signal.Signals[signal_name].value
