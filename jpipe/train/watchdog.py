"""Stops a run in which no step completes for too long (a hang).

A multi-process run whose processes wait for each other (a cross-process
operation issued in a different order, a peer stuck in a library) shows
no error: every process is alive, so the coordination service's heartbeat
never fires. The training loops call ``Watchdog.beat`` whenever a step,
an evaluation or a checkpoint completes; when none has for ``timeout``
seconds, every process writes its Python stacks (``faulthandler``) and
where its main thread waits, process 0 names where each process waits,
and all exit with ``EXIT_HUNG``. One process whose watchdog fires makes
the others' fire within a second (a key in the coordinator's key-value
store), so the stacks are of one moment.

The timeout: ``config.train.hang_timeout`` seconds, or with 0 (default)
max(300 s, 20x the median step so far, 3x the longest evaluation or
checkpoint so far): long enough for the first step's compilation on a
slow machine, short enough that a hang is reported within minutes. (An
evaluation longer than 300 s before any has been timed needs a larger
``hang_timeout``: the other processes wait for it without progress.)
"""

import faulthandler
import functools
import importlib.util
import linecache
import os
import statistics
import sys
import threading
import time
import traceback
from collections import deque

from jpipe import distributed

# What a process stopped by its watchdog exits with (as timeout(1) does).
EXIT_HUNG = 124

FLOOR_S = 300.0
MEDIAN_FACTOR = 20.0
_KEY = "jpipe/hang/"


class Watchdog:
  """The watchdog of one training loop (a context manager).

  Args:
    timeout_s: seconds without progress that count as a hang; 0 or None:
      max(``floor_s``, ``factor`` x the median step so far).
    floor_s, factor: the automatic timeout's parts.
    poll_s: how often it looks (seconds).
    out: where its report goes (stderr).
  """

  def __init__(
    self,
    timeout_s: float | None = None,
    *,
    floor_s: float = FLOOR_S,
    factor: float = MEDIAN_FACTOR,
    poll_s: float = 1.0,
    out=None,
  ):
    self.fixed = timeout_s or None
    self.floor_s, self.factor, self.poll_s = floor_s, factor, poll_s
    self.out = out or sys.stderr
    self.steps = deque(maxlen=101)  # Recent step seconds, for the median.
    self.longest_other = 0.0  # The longest evaluation or checkpoint (s).
    self.last = time.monotonic()
    self.doing = "before step 1 (compiling)"
    self._stop = threading.Event()
    self._thread = threading.Thread(
      target=self._watch, name="jpipe-watchdog", daemon=True
    )

  def timeout(self) -> float:
    """The timeout in force (seconds)."""
    if self.fixed:
      return self.fixed
    median = statistics.median(self.steps) if self.steps else 0.0
    return max(self.floor_s, self.factor * median, 3 * self.longest_other)

  def beat(
    self,
    doing: str,
    step_seconds: float | None = None,
    *,
    other_seconds: float | None = None,
  ) -> None:
    """Progress, and where the loop is now (``doing``, e.g. "after step
    7"): a step that took ``step_seconds`` (None: not a step, or one
    that compiled), or an evaluation or checkpoint that took
    ``other_seconds``."""
    if step_seconds is not None:
      self.steps.append(step_seconds)
    if other_seconds is not None:
      self.longest_other = max(self.longest_other, other_seconds)
    self.doing = doing
    self.last = time.monotonic()

  def __enter__(self):
    self.last = time.monotonic()
    self._thread.start()
    return self

  def __exit__(self, *exc):
    self._stop.set()
    self._thread.join(timeout=5)

  def _watch(self):
    client = distributed.client()
    while not self._stop.wait(self.poll_s):
      waited = time.monotonic() - self.last
      if waited > self.timeout():
        self._fire(client, f"no progress for {waited:.0f} s")
        return
      if client is not None and _peer_fired(client):
        self._fire(client, "another process's watchdog fired")
        return

  def _fire(self, client, why: str) -> None:
    """Reports where this process waits, and exits (never returns)."""
    me = _process_index()
    where = waiting_in(threading.main_thread())
    head = (
      f"process {me}: hung {self.doing}: {why} (timeout "
      f"{self.timeout():.0f} s); its main thread waits in {where}"
    )
    client = _publish(client, f"fired/{me}", "1")  # The others fire too.
    self.out.write(f"{head}\nStacks of process {me}:\n")
    self.out.flush()
    faulthandler.dump_traceback(file=self.out, all_threads=True)
    self.out.flush()
    # Published after the stacks are out: process 0 exits (and the
    # coordinator with it, which ends the others) once it has every
    # process's ``where``, so every process's stacks are printed by then.
    client = _publish(client, f"where/{me}", where)
    if me == 0:
      wheres = _wheres(client) if client is not None else {0: where}
      lines = "; ".join(
        f"process {q} waits in {w}" for q, w in sorted(wheres.items())
      )
      fix = (
        f"raise --config.train.hang_timeout (seconds; now "
        f"{self.timeout():.0f}) if a step really takes this long"
      )
      self.out.write(
        f"error: the run hung (no step, evaluation or checkpoint completed "
        f"for {self.timeout():.0f} s): {lines}. Stacks above. Processes "
        f"that wait for each other issued cross-process operations in "
        f"different orders (a bug: please report it with this log); {fix}.\n"
      )
      self.out.flush()
    os._exit(EXIT_HUNG)


def waiting_in(thread: threading.Thread) -> str:
  """Where ``thread`` is now: its innermost jpipe frames (up to three,
  outermost first, the last with its source line) and, when deeper, the
  innermost frame of all."""
  frame = sys._current_frames().get(thread.ident)
  if frame is None:
    return "(not running)"
  stack = [
    f
    for f in traceback.extract_stack(frame)
    if not f.name.startswith("<") or f.name == "<module>"
  ]
  if not stack:
    return "(no Python frame)"
  jpipe_folders = [d for name, d in _package_folders() if name == "jpipe"]
  ours = [
    f
    for f in stack
    if os.path.realpath(f.filename).startswith(tuple(jpipe_folders))
    and not f.filename.endswith("__main__.py")  # (an entry point)
  ][-4:]
  inner = stack[-1]
  if not ours:
    return _frame_name(inner)
  text = " > ".join(_frame_name(f) for f in ours) + f" ({_source(ours[-1])})"
  return text if ours[-1] is inner else f"{text}, inside {_frame_name(inner)}"


def _source(f, width: int = 100) -> str:
  """A frame's statement (all its lines, joined), without comments."""
  end = getattr(f, "end_lineno", None) or f.lineno
  lines = [linecache.getline(f.filename, n) for n in range(f.lineno, end + 1)]
  code = " ".join(line.split("  #")[0].strip() for line in lines).strip()
  code = code.replace("( ", "(").replace(" )", ")")
  return code if len(code) <= width else code[: width - 3] + "..."


# The packages whose frames are named from their own folder.
_NAMED_PACKAGES = ("jpipe", "jax", "jaxlib", "orbax", "flax")


@functools.cache
def _package_folders() -> tuple[tuple[str, str], ...]:
  """(name, folder + separator) of each of ``_NAMED_PACKAGES`` installed:
  where its own files are, wherever the checkout or environment lives (a
  clone named ``jpipe`` holds ``jpipe/jpipe/``)."""
  found = []
  for name in _NAMED_PACKAGES:
    try:
      spec = importlib.util.find_spec(name)
    except (ImportError, ValueError):
      continue
    for folder in (spec and spec.submodule_search_locations) or ():
      found.append((name, os.path.realpath(folder) + os.sep))
  return tuple(found)


def _frame_name(f) -> str:
  """``package/path.py:line in function``: the path within its package's
  own folder (any other file keeps its full path)."""
  path = f.filename
  real = os.path.realpath(path)
  for name, folder in _package_folders():
    if real.startswith(folder):
      path = name + os.sep + real[len(folder) :]
      break
  return f"{path}:{f.lineno} in {f.name}"


def _process_index() -> int:
  import jax

  return jax.process_index()


def _publish(client, key: str, value: str):
  """``value`` under the watchdog's ``key``; the client, or None where
  the coordinator is gone (this process then reports alone)."""
  if client is None:
    return None
  try:
    client.key_value_set(f"{_KEY}{key}", value)
  except Exception:
    return None
  return client


def _peer_fired(client) -> bool:
  try:
    return bool(client.key_value_dir_get(f"{_KEY}fired/"))
  except Exception:
    return False


def _wheres(client, wait_s: float = 10.0) -> dict[int, str]:
  """Every process's published ``where``, waiting up to ``wait_s`` for
  the others' watchdogs (they fire within a poll of this one's)."""
  import jax

  deadline = time.monotonic() + wait_s
  got = {}
  while True:
    try:
      got = {
        int(k.rsplit("/", 1)[1]): v
        for k, v in client.key_value_dir_get(f"{_KEY}where/")
      }
    except Exception:
      pass
    if len(got) == jax.process_count() or time.monotonic() > deadline:
      break
    time.sleep(0.2)
  for q in range(jax.process_count()):
    got.setdefault(q, "(no report: the process may hold the interpreter)")
  return got
