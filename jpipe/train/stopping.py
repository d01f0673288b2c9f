"""Stopping a run on request: SIGTERM / SIGINT, agreed across processes."""

import os
import signal

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


def exit_code(signal_name) -> int:
  """What a run stopped by ``signal_name`` exits with (128 + its number)."""
  return 128 + signal.Signals[signal_name].value
