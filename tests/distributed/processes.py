"""Helpers of the tests that start processes: their environment, their
pids as the launcher's output announces them, whether one is alive."""

import contextlib
import os
import signal
import subprocess
import time

from tests.quick_compiles import (
  NO_OPTIMIZATIONS,
  with_quick_compiles,
  without_device_count,
)

ROOT = os.path.dirname(
  os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
)


def without_proxies() -> dict:
  """This environment without proxies (gRPC would route 127.0.0.1
  through them) and without ``XLA_FLAGS`` (the tests' fake-device count):
  for a script that sets up its own processes and devices."""
  return {k: v for k, v in _no_proxies().items() if k != "XLA_FLAGS"}


def _no_proxies() -> dict:
  return {
    k: v
    for k, v in os.environ.items()
    if k.lower() not in ("http_proxy", "https_proxy", "all_proxy")
  }


def environment(**extra) -> dict:
  """This environment without proxies (gRPC would route 127.0.0.1
  through them) and without the fake-device flag (each process sets its
  own device count), on CPU with quick compiles (tests/quick_compiles.py;
  both sides of a comparison alike)."""
  out = _no_proxies()
  out["XLA_FLAGS"] = without_device_count(
    with_quick_compiles(out.get("XLA_FLAGS", ""))
  )
  out["JAX_PLATFORMS"] = "cpu"
  out.setdefault(NO_OPTIMIZATIONS, "1")  # (A compute_bound test: "0".)
  out["PYTHONPATH"] = ROOT + os.pathsep + out.get("PYTHONPATH", "")
  out.update(extra)
  return out


def read_until(proc, marker, lines, deadline) -> str:
  """The launcher's output lines (appended to ``lines``) up to the first
  that contains ``marker``; that line."""
  while True:
    assert time.monotonic() < deadline, "".join(lines)
    line = proc.stdout.readline()
    assert line, "launcher ended early:\n" + "".join(lines)
    lines.append(line)
    if marker in line:
      return line


def ready_pids(proc, nprocs, deadline, lines=None):
  """Reads the launcher's output until every process said "ready <process>
  <pid>"; returns ({process: pid}, the lines read)."""
  lines = [] if lines is None else lines
  pids = {}
  while len(pids) < nprocs:
    line = read_until(proc, "] ready ", lines, deadline)
    _, p, pid = line.split("] ")[1].split()
    pids[int(p)] = int(pid)
  return pids, lines


def alive(pid) -> bool:
  """Whether process ``pid`` runs (a zombie is dead: it only waits for
  its parent to read its status)."""
  try:
    os.kill(pid, 0)
  except ProcessLookupError:
    return False
  try:
    with open(f"/proc/{pid}/stat") as f:
      return f.read().rsplit(")", 1)[1].split()[0] != "Z"
  except FileNotFoundError:
    return False


@contextlib.contextmanager
def started(command, env):
  """``command`` started in a session of its own, its output (stdout and
  stderr) on ``proc.stdout`` as text; killed with its process group if
  it still runs when the block ends."""
  proc = subprocess.Popen(
    command,
    env=env,
    stdout=subprocess.PIPE,
    stderr=subprocess.STDOUT,
    text=True,
    cwd=ROOT,
    start_new_session=True,
  )
  try:
    yield proc
  finally:
    if proc.poll() is None:
      os.killpg(proc.pid, signal.SIGKILL)
      proc.wait()
