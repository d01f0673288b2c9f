"""Starts a multi-process run on this machine.

  python -m jpipe.launch --nprocs N [--devices-per-process K] -- \\
      python -m jpipe.train --config configs/default.py ...

starts N copies of the command with the environment
``jpipe.distributed.initialize`` reads (a free coordinator port on
127.0.0.1, the process count and each one's rank; K CPU devices each, or
K GPUs each where there are GPUs), prints their output line by line
prefixed with ``[pI]``, and, when one exits with an error, stops the
others (SIGTERM, then SIGKILL after ``FAILED_RUN_GRACE_S`` seconds) and
exits with that process's code. SIGINT / SIGTERM to the launcher go to
every process (a training run checkpoints and exits); one still running
``--grace`` seconds later gets SIGKILL. The processes die with the
launcher, however it dies (Linux's parent-death signal): killing the
launcher, even with SIGKILL, leaves no process behind.
For several hosts, start one process per host or GPU with your cluster's
launcher instead (BUILD.md: SLURM).
"""

import argparse
import ctypes
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


def _gpu_count() -> int:
  if not shutil.which("nvidia-smi"):
    return 0
  try:
    out = subprocess.run(
      ["nvidia-smi", "-L"], capture_output=True, text=True, timeout=30
    ).stdout
  except (OSError, subprocess.SubprocessError):
    return 0
  return sum(line.startswith("GPU ") for line in out.splitlines())


def process_environments(nprocs, devices_per_process, platform, base=None):
  """Each process's environment: the coordinator, its rank, its devices.

  Proxy variables are dropped: gRPC would route 127.0.0.1 through them.
  """
  base = dict(os.environ if base is None else base)
  for key in list(base):
    if key.lower() in ("http_proxy", "https_proxy", "all_proxy", "grpc_proxy"):
      del base[key]
  address = f"127.0.0.1:{_free_port()}"
  envs = []
  for i in range(nprocs):
    env = dict(base)
    env["JAX_COORDINATOR_ADDRESS"] = address
    env["JAX_NUM_PROCESSES"] = str(nprocs)
    env["JAX_PROCESS_ID"] = str(i)
    env["PYTHONUNBUFFERED"] = "1"
    if platform == "gpu":
      first = i * devices_per_process
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


def _pump(stream, prefix, out, lock):
  for line in iter(stream.readline, b""):
    with lock:
      out.write(prefix + line.decode(errors="replace"))
      out.flush()
  stream.close()


def run(command, envs, *, grace: float = 30.0, out=None) -> int:
  """Runs ``command`` once per environment; returns the run's exit code
  (0, or the first failing process's). ``grace``: seconds between a
  forwarded SIGTERM / SIGINT and SIGKILL."""
  out = out or sys.stdout
  lock = threading.Lock()
  procs, pumps = [], []
  for i, env in enumerate(envs):
    p = subprocess.Popen(
      command,
      env=env,
      stdout=subprocess.PIPE,
      stderr=subprocess.STDOUT,
      start_new_session=True,  # its own group: stopped with its children
      preexec_fn=_die_with(os.getpid()),
    )
    t = threading.Thread(target=_pump, args=(p.stdout, f"[p{i}] ", out, lock))
    t.start()
    procs.append(p)
    pumps.append(t)

  def stop(sig=signal.SIGTERM):
    for p in procs:
      if p.poll() is None:
        # A stopped process cannot act on SIGTERM: it gets SIGKILL.
        stopped = _state(p.pid) in ("T", "t")
        try:
          os.killpg(p.pid, signal.SIGKILL if stopped else sig)
        except ProcessLookupError:
          pass

  kill_at = []  # When a forwarded stop request turns into SIGKILL.

  def forward(signum, frame):
    if not kill_at:
      kill_at.append(time.monotonic() + grace)
      # (No lock: the main thread may hold it when the signal arrives.)
      out.write(
        f"[launch] {signal.Signals(signum).name}: passed on to every "
        f"process; SIGKILL to those still running in {grace:g} s\n"
      )
      out.flush()
    stop(signum)

  old = {s: signal.signal(s, forward) for s in (signal.SIGINT, signal.SIGTERM)}
  code = 0
  try:
    while True:
      if kill_at and time.monotonic() > kill_at[0]:
        stop(signal.SIGKILL)
      codes = [p.poll() for p in procs]
      failed = [(i, c) for i, c in enumerate(codes) if c not in (None, 0)]
      if kill_at:  # Stopping on request: each saves and exits by itself.
        if all(c is not None for c in codes):
          code = next((c for c in codes if c), 0)
          with lock:
            for i, c in failed:
              out.write(f"[launch] process {i} exited with {_describe(c)}\n")
          break
      elif failed:
        # Seen in one poll: a process killed by a signal is likelier the
        # cause than one that failed because its peer vanished.
        failed.sort(key=lambda f: f[1] >= 0)
        code = failed[0][1]
        with lock:
          for i, c in failed:
            out.write(f"[launch] process {i} exited with {_describe(c)}\n")
          for i, p in enumerate(procs):
            if p.poll() is None and _state(p.pid) in ("T", "t"):
              out.write(
                f"[launch] process {i} is stopped (SIGSTOP or a debugger): "
                "it hung the run\n"
              )
          out.write("[launch] stopping the others\n")
          out.flush()
        stop(signal.SIGTERM)
        deadline = time.monotonic() + FAILED_RUN_GRACE_S
        while time.monotonic() < deadline and any(
          p.poll() is None for p in procs
        ):
          time.sleep(0.05)
        stop(signal.SIGKILL)
        break
      if all(c == 0 for c in codes):
        break
      time.sleep(0.05)
    for p in procs:
      p.wait()
  finally:
    stop(signal.SIGKILL)
    for s, h in old.items():
      signal.signal(s, h)
    for t in pumps:
      t.join(timeout=5)
  # A signal's death as the shell reports it: 128 + signal number.
  return code if code >= 0 else 128 - code


def _state(pid) -> str:
  """A process's state letter (Linux /proc; "" where unknown)."""
  try:
    with open(f"/proc/{pid}/stat") as f:
      return f.read().rsplit(")", 1)[1].split()[0]
  except (OSError, IndexError):
    return ""


def _describe(code):
  if code < 0:
    return f"signal {signal.Signals(-code).name}"
  if code == 124:  # jpipe.train.watchdog.EXIT_HUNG (not imported: no jax)
    return "status 124 (its watchdog: the run hung)"
  return f"status {code}"


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(
    prog="python -m jpipe.launch",
    description="Start N processes of one multi-process jpipe run on this "
    "machine: python -m jpipe.launch --nprocs 2 -- python -m jpipe.train "
    "--config configs/default.py",
  )
  parser.add_argument("--nprocs", type=int, required=True)
  parser.add_argument(
    "--devices-per-process",
    type=int,
    default=1,
    help="CPU devices (or GPUs) per process (default 1)",
  )
  parser.add_argument(
    "--platform",
    choices=("auto", "cpu", "gpu"),
    default="auto",
    help="gpu: K GPUs per process (CUDA_VISIBLE_DEVICES); auto: gpu when "
    "nvidia-smi lists enough GPUs, else cpu",
  )
  parser.add_argument(
    "--grace",
    type=float,
    default=30.0,
    help="seconds the processes have to save and exit after a SIGTERM / "
    "SIGINT to the launcher, before SIGKILL (default 30)",
  )
  parser.add_argument("command", nargs=argparse.REMAINDER)
  args = parser.parse_args(argv)
  command = args.command[1:] if args.command[:1] == ["--"] else args.command
  if not command:
    parser.error("give the command after --, e.g. -- python -m jpipe.train")
  if shutil.which(command[0]) is None:
    parser.error(f"no command {command[0]!r} on PATH (or no such file)")
  if args.nprocs < 1 or args.devices_per_process < 1:
    parser.error("--nprocs and --devices-per-process must be >= 1")
  platform = args.platform
  gpus = _gpu_count() if platform != "cpu" else 0
  if platform == "auto":
    wanted = args.nprocs * args.devices_per_process
    platform = "gpu" if gpus >= wanted else "cpu"
  elif platform == "gpu" and gpus < args.nprocs * args.devices_per_process:
    parser.error(
      f"{args.nprocs} processes x {args.devices_per_process} GPUs need "
      f"{args.nprocs * args.devices_per_process} GPUs, nvidia-smi lists {gpus}"
    )
  envs = process_environments(args.nprocs, args.devices_per_process, platform)
  return run(command, envs, grace=args.grace)


if __name__ == "__main__":
  sys.exit(main())
