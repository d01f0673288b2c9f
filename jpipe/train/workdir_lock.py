"""One live run per workdir: a lock that dies with its process.

Two runs on one workdir both trained into the same checkpoints (steps
40-60 written by both), or the second told the user to delete a
checkpoint the first had rotated away. ``held(workdir, say)`` holds the
workdir for a run's whole life, taken once the workdir is checked
writable and before any data, trace or compile:

- The lock is ``fcntl.flock`` on ``WORKDIR/.jpipe.lock``. The kernel
  drops it when its process ends, however it ends (``kill -9``, a
  watchdog's or a failed process's ``os._exit``): a dead run never holds
  a workdir. (On NFS, Linux emulates flock with a whole-file lock that
  other hosts see.)
- The holder writes who it is into the file (host, pid, start time, its
  run's process count, its command). A run refused reads it and names
  the holder in one line: ``--workdir W is in use by another run (pid
  1234 on host h, since 04:40:12); wait for it to finish, stop it, or
  use another --workdir``.
- A run that ends through Python (finished, an error, SIGTERM's
  checkpoint-and-exit, which is a ``SystemExit``) empties the file, then
  unlocks. The file stays: deleting it would race with a run that has
  just opened it (that run would lock a file no longer in the folder
  while a third creates and locks a new one). So a file whose lock is
  free but that still names a holder was left by a process that died
  holding it: the next run takes it over with a one-line note naming
  the dead pid and host.
- Across processes (``jpipe.launch``, SLURM) every process of one run
  shares the workdir: process 0 alone takes the lock, and every process
  learns the outcome from it through the coordinator's key-value store
  (one host exchange, before any device work, issued by every process
  at the same point: ``jpipe.distributed``'s rule 1). A refused run is
  refused in every process there, each exiting with the same line, none
  left waiting in a collective for a process 0 that is gone. The
  processes of one run never compete for the file, and those of another
  run hear only their own process 0, so no run identity needs comparing.
- A file system without locks (``ENOLCK``, ``EOPNOTSUPP``: some network
  mounts): a note, and the run goes on unguarded.
"""

import contextlib
import dataclasses
import fcntl
import json
import os
import socket
import sys
import time
from collections.abc import Callable, Iterator

import jax

from jpipe import distributed
from jpipe.train.errors import UsageError

FILE_NAME = ".jpipe.lock"
# A holder writes its details just after locking, and empties the file
# just before unlocking: a refused run reads them this long (seconds)
# before it names the holder only as "another run".
_READ_S = 2.0


class WorkdirInUse(UsageError):
  """Another live run holds the workdir (the message names it)."""


@dataclasses.dataclass(frozen=True)
class Holder:
  """Who holds (or held) a workdir's lock, as its file says.

  Attributes:
    host, pid: the holding process (process 0 of its run).
    since: when it took the lock (``time.time()``).
    processes: its run's process count.
    command: its command line.
  """

  host: str
  pid: int
  since: float
  processes: int = 1
  command: str = ""

  def describe(self) -> str:
    """E.g. "pid 1234 on host h, since 04:40:12" (the date too when it
    is not today's)."""
    when = time.localtime(self.since)
    today = time.localtime()[:3] == when[:3]
    since = time.strftime("%H:%M:%S" if today else "%Y-%m-%d %H:%M:%S", when)
    of = f", process 0 of {self.processes}" if self.processes > 1 else ""
    return f"pid {self.pid} on host {self.host}{of}, since {since}"

  def text(self) -> str:
    return json.dumps(dataclasses.asdict(self)) + "\n"

  @classmethod
  def parse(cls, text: str) -> "Holder | None":
    """The holder a lock file names; None for an empty or unreadable one."""
    try:
      fields = json.loads(text)
      return cls(
        host=str(fields["host"]),
        pid=int(fields["pid"]),
        since=float(fields["since"]),
        processes=int(fields.get("processes", 1)),
        command=str(fields.get("command", "")),
      )
    except (ValueError, TypeError, KeyError):
      return None


class WorkdirLock:
  """The lock of one workdir, held by this process (``acquire`` /
  ``release``, or a with-block)."""

  def __init__(self, workdir: str):
    self.workdir = workdir
    self.path = os.path.join(workdir, FILE_NAME)
    self._fd = None

  def acquire(self, processes: int = 1) -> Holder | None:
    """Takes the lock, writing this process's details (``processes``: its
    run's process count).

    Returns:
      The dead holder taken over (its file still named it), or None.

    Raises:
      WorkdirInUse: a live process holds it (the message names it).
      OSError: the file cannot be made or locked (a file system without
        locks).
    """
    if self._fd is not None:
      raise RuntimeError(f"{self.path} is already held by this lock")
    fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    try:
      deadline = time.monotonic() + _READ_S
      while not _try_lock(fd):
        holder = Holder.parse(_read(fd))
        if holder is not None or time.monotonic() > deadline:
          raise WorkdirInUse(_in_use(self.workdir, holder))
        time.sleep(0.02)  # Its details not written yet, or being released.
      dead = Holder.parse(_read(fd))
      me = Holder(
        socket.gethostname(),
        os.getpid(),
        time.time(),
        processes,
        " ".join(sys.argv),
      )
      os.ftruncate(fd, 0)
      os.pwrite(fd, me.text().encode(), 0)
      os.fsync(fd)  # Seen by a refused run on another host (NFS).
    except BaseException:
      os.close(fd)  # (Unlocks, where it was locked.)
      raise
    self._fd = fd
    return dead

  def release(self) -> None:
    """Empties the file and unlocks it (nothing where not held)."""
    if self._fd is None:
      return
    fd, self._fd = self._fd, None
    try:
      os.ftruncate(fd, 0)
      # Explicitly: a forked child's copy of fd would keep it locked past
      # the close.
      fcntl.flock(fd, fcntl.LOCK_UN)
    finally:
      os.close(fd)

  def __enter__(self) -> "WorkdirLock":
    self.acquire()
    return self

  def __exit__(self, *exc) -> None:
    self.release()


@contextlib.contextmanager
def held(workdir: str, say: Callable[[str], None] = print) -> Iterator[None]:
  """The workdir held for the block by this run (process 0's lock, every
  process told the outcome; module docstring). Raises WorkdirInUse in
  every process of a refused run; ``say`` gets the one-line notes (a dead
  holder taken over, no locks on this file system)."""
  lock = WorkdirLock(workdir)
  refusal, note = "", None
  if jax.process_index() == 0:
    try:
      dead = lock.acquire(jax.process_count())
    except WorkdirInUse as e:
      refusal = str(e)
    except OSError as e:
      note = (
        f"note: --workdir {workdir}: cannot lock {lock.path} "
        f"({e.strerror or e}); this run goes on, but a second run on this "
        "workdir would not be refused"
      )
    else:
      if dead is not None:
        note = (
          f"note: --workdir {workdir}: taking over the lock of a run that "
          f"ended without releasing it ({dead.describe()}; killed or "
          "crashed)"
        )
  try:
    got = distributed.exchange("workdir lock", refusal.encode())
    refusal = got[0].decode()
    if refusal:
      raise WorkdirInUse(refusal)
    if note:
      say(note)
    yield
  finally:
    lock.release()


def _try_lock(fd: int) -> bool:
  try:
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
  except BlockingIOError:  # Held by another open file: another run.
    return False
  return True


def _read(fd: int) -> str:
  return os.pread(fd, 1 << 16, 0).decode(errors="replace")


def _in_use(workdir: str, holder: Holder | None) -> str:
  who = f" ({holder.describe()})" if holder else ""
  return (
    f"--workdir {workdir} is in use by another run{who}; wait for it to "
    "finish, stop it, or use another --workdir"
  )
