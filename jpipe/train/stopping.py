"""Stopping a run on request: SIGTERM / SIGINT, agreed across processes."""

import signal

import numpy as np
from jax.experimental import multihost_utils


class StopRequest:
  """SIGTERM / SIGINT while inside: ``signal`` holds its name (the loop
  finishes its step or epoch, checkpoints and exits)."""

  def __init__(self):
    self.signal = None
    self._old = {}

  def __enter__(self):
    for sig in (signal.SIGTERM, signal.SIGINT):
      self._old[sig] = signal.signal(sig, self._handle)
    return self

  def _handle(self, signum, frame):
    del frame
    self.signal = signal.Signals(signum).name

  def __exit__(self, *exc):
    for sig, old in self._old.items():
      signal.signal(sig, old)


def agreed(signal_name, multiprocess):
  """A stop request any process received, known to all (they must stop
  at the same step: the flush and the save are collective)."""
  if not multiprocess:
    return signal_name
  names = ("", "SIGTERM", "SIGINT")
  got = multihost_utils.process_allgather(
    np.int32(names.index(signal_name or ""))
  )
  return names[int(np.max(got))] or None


def exit_code(signal_name) -> int:
  """What a run stopped by ``signal_name`` exits with (128 + its number)."""
  return 128 + signal.Signals[signal_name].value
