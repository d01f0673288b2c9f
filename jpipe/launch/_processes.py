"""One attempt at a run: its processes started, watched and stopped.

``attempt`` starts a copy of the command per environment, prints their
output line by line prefixed with ``[pI]`` and, when one exits with an
error, stops the others (SIGTERM, then SIGKILL after
``FAILED_RUN_GRACE_S`` seconds). A SIGTERM / SIGINT to the launcher
(``Requests``) goes to every process of the attempt under way; one
still running ``grace`` seconds later gets SIGKILL. The processes die
with the launcher, however it dies (Linux's parent-death signal).
"""

import ctypes
import dataclasses
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time

# After one process failed, the others get this long between SIGTERM and
# SIGKILL (they cannot save a checkpoint without it; most are gone first).
FAILED_RUN_GRACE_S = 5.0

_PR_SET_PDEATHSIG = 1
# Looked up before any fork: the child only calls it.
_prctl = (
  ctypes.CDLL(None, use_errno=True).prctl if sys.platform == "linux" else None
)


def _die_with(parent: int):
  """A ``preexec_fn``: the child gets SIGKILL when ``parent`` dies (it
  survives the exec); a parent already gone ends the child at once."""

  def preexec():
    if _prctl is not None:
      _prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != parent:
      os._exit(1)

  return preexec


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def gpu_count() -> int:
  """The GPUs ``nvidia-smi`` lists (0 without it)."""
  if not shutil.which("nvidia-smi"):
    return 0
  try:
    out = subprocess.run(
      ["nvidia-smi", "-L"], capture_output=True, text=True, timeout=30
    ).stdout
  except (OSError, subprocess.SubprocessError):
    return 0
  return sum(line.startswith("GPU ") for line in out.splitlines())


def process_environments(
  nprocs, devices_per_process, platform, base=None, slots=None
):
  """Each process's environment: the coordinator (a free port at each
  call), its rank, its devices. ``slots``: whose devices the processes
  get, in rank order (default ``range(nprocs)``; slot s has GPUs s*K ..
  s*K+K-1).

  Proxy variables are dropped: gRPC would route 127.0.0.1 through them.
  """
  slots = range(nprocs) if slots is None else slots
  base = dict(os.environ if base is None else base)
  for key in list(base):
    if key.lower() in ("http_proxy", "https_proxy", "all_proxy", "grpc_proxy"):
      del base[key]
  address = f"127.0.0.1:{_free_port()}"
  envs = []
  for i, slot in enumerate(slots):
    env = dict(base)
    env["JAX_COORDINATOR_ADDRESS"] = address
    env["JAX_NUM_PROCESSES"] = str(len(slots))
    env["JAX_PROCESS_ID"] = str(i)
    env["PYTHONUNBUFFERED"] = "1"
    if platform == "gpu":
      first = slot * devices_per_process
      env["CUDA_VISIBLE_DEVICES"] = ",".join(
        str(g) for g in range(first, first + devices_per_process)
      )
    else:
      env["JAX_PLATFORMS"] = "cpu"
      env["JPIPE_CPU_DEVICES"] = str(devices_per_process)
      # One device per process here: the fake-device flag would override.
      flags = env.get("XLA_FLAGS", "").split()
      env["XLA_FLAGS"] = " ".join(
        f for f in flags if "force_host_platform_device_count" not in f
      )
    envs.append(env)
  return envs


@dataclasses.dataclass(frozen=True)
class Outcome:
  """How an attempt ended.

  Attributes:
    status: 0, or the first failing process's (``Popen.returncode``:
      minus the signal's number for a signal).
    failed: the rank of the process that failed first (None: none did,
      or the launcher was asked to stop).
    requested: a SIGTERM / SIGINT to the launcher stopped it.
    seconds: from its start to the first failure (or to its end).
  """

  status: int
  failed: int | None
  requested: bool
  seconds: float

  @property
  def code(self) -> int:
    """The exit status as a shell reports it (128 + a signal's number)."""
    return self.status if self.status >= 0 else 128 - self.status


class Requests:
  """SIGTERM / SIGINT to the launcher while inside (a context manager):
  recorded for the attempt under way to pass on (``attempt`` does, from
  the main thread: a process started while the signal arrives gets it
  too), and a SIGKILL due ``grace`` seconds after the first."""

  def __init__(self, grace: float):
    self.grace = grace
    self.received = []  # Signal numbers, in order.
    self.kill_at = None
    self._old = {}

  def __enter__(self):
    for sig in (signal.SIGINT, signal.SIGTERM):
      self._old[sig] = signal.signal(sig, self._handle)
    return self

  def _handle(self, signum, frame):
    del frame
    if self.kill_at is None:
      self.kill_at = time.monotonic() + self.grace
    self.received.append(signum)

  def __exit__(self, *exc):
    for sig, old in self._old.items():
      signal.signal(sig, old)


def attempt(command, envs, requests: Requests, out, lock) -> Outcome:
  """Runs ``command`` once per environment until every process exited 0,
  one failed (the others stopped) or ``requests`` stopped them all."""
  start = time.monotonic()
  procs, pumps = [], []
  try:
    for i, env in enumerate(envs):
      p = subprocess.Popen(
        command,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        start_new_session=True,  # its own group: stopped with its children
        preexec_fn=_die_with(os.getpid()),
      )
      procs.append(p)
      t = threading.Thread(target=_pump, args=(p.stdout, f"[p{i}] ", out, lock))
      t.start()
      pumps.append(t)
    outcome = _Watch(procs, requests, out, lock, start).run()
    for p in procs:
      p.wait()
  finally:
    _stop(procs, signal.SIGKILL)
    for t in pumps:
      t.join(timeout=5)
  return outcome


def run(command, envs, *, grace: float = 30.0, out=None) -> int:
  """Runs ``command`` once per environment; returns the run's exit code
  (0, or the first failing process's). ``grace``: seconds between a
  forwarded SIGTERM / SIGINT and SIGKILL."""
  with Requests(grace) as requests:
    lock = threading.Lock()
    outcome = attempt(command, envs, requests, out or sys.stdout, lock)
  return outcome.code


def _pump(stream, prefix, out, lock):
  for line in iter(stream.readline, b""):
    with lock:
      out.write(prefix + line.decode(errors="replace"))
      out.flush()
  stream.close()


def _stop(procs, sig):
  for p in procs:
    if p.poll() is None:
      # A stopped process cannot act on SIGTERM: it gets SIGKILL.
      stopped = _state(p.pid) in ("T", "t")
      try:
        os.killpg(p.pid, signal.SIGKILL if stopped else sig)
      except ProcessLookupError:
        pass


class _Watch:
  """The launcher's watch over one attempt's processes (every 50 ms)."""

  def __init__(self, procs, requests, out, lock, start):
    self.procs, self.requests = procs, requests
    self.out, self.lock, self.start = out, lock, start
    self.forwarded = 0  # How many of ``requests.received`` went out.

  def run(self) -> Outcome:
    while True:
      self._forward()
      codes = [p.poll() for p in self.procs]
      failed = [(i, c) for i, c in enumerate(codes) if c not in (None, 0)]
      if self.requests.received:  # Each saves and exits by itself.
        if all(c is not None for c in codes):
          self._say(
            *(f"process {i} exited with {describe(c)}" for i, c in failed)
          )
          status = next((c for c in codes if c), 0)
          return Outcome(status, None, True, self._seconds())
      elif failed:
        return self._stop_after(failed)
      elif all(c == 0 for c in codes):
        return Outcome(0, None, False, self._seconds())
      time.sleep(0.05)

  def _stop_after(self, failed) -> Outcome:
    """Stops the others after ``failed`` [(rank, status)] failed."""
    seconds = self._seconds()
    # Seen in one poll: a process killed by a signal is likelier the
    # cause than one that failed because its peer vanished.
    failed.sort(key=lambda f: f[1] >= 0)
    lines = [f"process {i} exited with {describe(c)}" for i, c in failed]
    for i, p in enumerate(self.procs):
      if p.poll() is None and _state(p.pid) in ("T", "t"):
        lines.append(
          f"process {i} is stopped (SIGSTOP or a debugger): it hung the run"
        )
    self._say(*lines, "stopping the others")
    _stop(self.procs, signal.SIGTERM)
    deadline = time.monotonic() + FAILED_RUN_GRACE_S
    while time.monotonic() < deadline and any(
      p.poll() is None for p in self.procs
    ):
      self._forward()
      time.sleep(0.05)
    _stop(self.procs, signal.SIGKILL)
    (rank, status), requested = failed[0], bool(self.requests.received)
    return Outcome(status, rank, requested, seconds)

  def _forward(self):
    """Passes on the SIGTERM / SIGINT received since the last look; a
    SIGKILL once their grace is over."""
    requests = self.requests
    while self.forwarded < len(requests.received):
      signum = requests.received[self.forwarded]
      if self.forwarded == 0:
        self._say(
          f"{signal.Signals(signum).name}: passed on to every process; "
          f"SIGKILL to those still running in {requests.grace:g} s"
        )
      _stop(self.procs, signum)
      self.forwarded += 1
    if requests.kill_at is not None and time.monotonic() > requests.kill_at:
      _stop(self.procs, signal.SIGKILL)

  def _seconds(self) -> float:
    return time.monotonic() - self.start

  def _say(self, *lines):
    with self.lock:
      for line in lines:
        self.out.write(f"[launch] {line}\n")
      self.out.flush()


def _state(pid) -> str:
  """A process's state letter (Linux /proc; "" where unknown)."""
  try:
    with open(f"/proc/{pid}/stat") as f:
      return f.read().rsplit(")", 1)[1].split()[0]
  except (OSError, IndexError):
    return ""


def describe(code) -> str:
  """A process's ``Popen.returncode`` in words."""
  if code < 0:
    return f"signal {signal.Signals(-code).name}"
  if code == 124:  # jpipe.train.watchdog.EXIT_HUNG (not imported: no jax)
    return "status 124 (its watchdog: the run hung)"
  return f"status {code}"
