"""What the processes of one run must share, checked when they start.

Every process of a multi-process run is started with its own command
(``jpipe.launch`` gives all the same one; SLURM or a hand-made script
may not), runs its own installed jpipe and sees its own file system.
Unchecked, a process given another learning rate or seed trained beside
the others and the run finished with a silently worse model (process 0's
``config.json`` naming a learning rate one process never used); another
jpipe version hung for minutes and ended "hung while compiling"; a
workdir that was not one shared folder left one process's checkpoints
unfinished and the resume waiting forever. Here, before any data, trace
or compile, every process tells the others what it runs and sees, and
each raises the same ``UsageError`` naming the difference -- or all go
on:

- ``check_same_run(config)`` (before the workdir lock): the jpipe code
  (a hash of the package's source), the resolved config, the devices per
  process. One host exchange, with a time limit: a process that never
  reaches it (another jpipe, one without this check) is named.
- ``check_shared_workdir(workdir)`` (once the lock is held): process 0
  writes a token into the workdir, every process reads it back, and all
  list its checkpoints: the workdir must be one folder every host sees.
- ``check_same_batches(task)`` (once the task is built): every process
  reads its batches itself (``batch_at(step)``), so all must read the
  same first batch; one whose batch differs (an unseeded or per-host
  ``batch_at``) would train one process's inputs against another's
  labels, silently.

In one process both do nothing.
"""

import hashlib
import json
import os
import secrets
import time
from importlib import metadata

import jax

from jpipe import distributed
from jpipe.train import config_cli
from jpipe.train.errors import UsageError
from jpipe.train.task import batch_digest

__all__ = [
  "check_same_batches",
  "check_same_run",
  "check_shared_workdir",
  "code_fingerprint",
]

# How long the start-up exchange waits for every process (seconds): the
# processes left jax.distributed.initialize together moments before.
START_WAIT_S = 300.0
PROBE = ".jpipe.processes"  # Process 0's token, in the workdir.

_code_hash = None


def code_fingerprint() -> str:
  """The jpipe this process runs: its version and a hash of the source
  files of the package (16 hex digits), computed once."""
  global _code_hash
  if _code_hash is None:
    import jpipe

    root = os.path.dirname(jpipe.__file__)
    digest = hashlib.sha256()
    for folder, dirs, files in sorted(os.walk(root)):
      dirs.sort()
      for name in sorted(f for f in files if f.endswith(".py")):
        path = os.path.join(folder, name)
        digest.update(os.path.relpath(path, root).encode())
        with open(path, "rb") as f:
          digest.update(f.read())
    _code_hash = f"{jpipe.__version__}+{digest.hexdigest()[:16]}"
  return _code_hash


# Libraries whose versions must agree: another JAX or XLA may compile a
# stage's program differently (other numerics, other collectives); another
# flax may name params differently; optax or orbax, other optimizer states
# or checkpoint layouts.
LIBRARIES = ("jax", "jaxlib", "flax", "optax", "orbax-checkpoint")


def library_versions() -> dict[str, str]:
  """``{"jax": "0.10.2", ...}``: the installed versions of ``LIBRARIES``
  ("absent" where not installed)."""

  def version(name):
    try:
      return metadata.version(name)
    except metadata.PackageNotFoundError:
      return "absent"

  return {name: version(name) for name in LIBRARIES}


def check_same_run(config) -> None:
  """A UsageError in every process when the processes run other jpipe
  code or libraries, were given other configs or expose other device
  counts."""
  if jax.process_count() == 1:
    return
  mine = {
    "code": code_fingerprint(),
    "libraries": library_versions(),
    "devices": jax.local_device_count(),
    "config": {
      k: json.dumps(v, sort_keys=True, default=repr)
      for k, v in config_cli.flatten(config).items()
    },
  }
  try:
    got = distributed.exchange(
      "start-up check", json.dumps(mine).encode(), timeout_s=START_WAIT_S
    )
  except distributed.PeerTimeout as e:
    raise UsageError(
      f"process {e.process} did not reach jpipe's start-up check within "
      f"{START_WAIT_S:.0f} s: is it running the same jpipe ({mine['code']} "
      "here; an older one has no such check) and the same command?"
    ) from None
  runs = [json.loads(g) for g in got]
  problem = _difference(runs)
  if problem:
    raise UsageError(
      f"the {len(runs)} processes of this run differ: {problem}; start "
      "every process with the same command, the same jpipe and the same "
      "libraries (python -m jpipe.launch does all three on one host)"
    )


def _difference(runs: list[dict]) -> str:
  """The first way the processes' reports differ, as a phrase ("" when
  they agree)."""
  libraries = [
    (f"libraries.{name}", name)
    for name in sorted({n for r in runs for n in r.get("libraries", {})})
  ]
  for key, what in (
    ("code", "jpipe code"),
    *libraries,
    ("devices", "devices"),
  ):
    values = [_field(r, key) for r in runs]
    if len(set(map(str, values))) > 1:
      return f"{what} per process " + ", ".join(
        f"{q}: {v}" for q, v in enumerate(values)
      )
  fields = sorted({k for r in runs for k in r["config"]})
  differing = [k for k in fields if len({r["config"].get(k) for r in runs}) > 1]
  if not differing:
    return ""
  shown = "; ".join(
    f"config.{k} "
    + ", ".join(
      f"{r['config'].get(k, '(none)')} (process {q})"
      for q, r in enumerate(runs)
    )
    for k in differing[:3]
  )
  more = f" (and {len(differing) - 3} more)" if len(differing) > 3 else ""
  return shown + more


def _field(run: dict, key: str):
  """A report's value at a dotted ``key`` (None where absent)."""
  for part in key.split("."):
    run = run.get(part) if isinstance(run, dict) else None
  return run


def check_shared_workdir(workdir: str) -> None:
  """A UsageError in every process when the processes do not see one
  workdir: process 0's token unread elsewhere, or other checkpoints."""
  if jax.process_count() == 1:
    return
  path = os.path.join(workdir, PROBE)
  token = ""
  if jax.process_index() == 0:
    token = secrets.token_hex(8)
    with open(path, "w") as f:
      f.write(token)
      f.flush()
      os.fsync(f.fileno())  # (Seen by the other hosts: NFS.)
  # Process 0 wrote before sending: once every token has arrived, the
  # file is there for every process that shares the folder.
  token = distributed.exchange("workdir token", token.encode())[0].decode()
  seen = {"token": _read_token(path, token), "steps": _steps(workdir)}
  got = [
    json.loads(g)
    for g in distributed.exchange("workdir view", json.dumps(seen).encode())
  ]
  apart = [q for q, r in enumerate(got) if r["token"] != token]
  if apart:
    raise UsageError(
      f"--workdir {workdir} is not one folder for all processes: "
      f"process(es) {apart} do not see the file process 0 wrote there "
      "(a host-local path?); give every process a folder on a file "
      "system every host shares"
    )
  steps = [r["steps"] for r in got]
  if any(s != steps[0] for s in steps):
    raise UsageError(
      f"the processes see other checkpoints in {workdir}/checkpoints ("
      + ", ".join(f"process {q}: {s or 'none'}" for q, s in enumerate(steps))
      + "): checkpoints copied onto some hosts only? The workdir must be "
      "one folder every host shares, holding every process's files"
    )


def check_same_batches(task) -> None:
  """A UsageError in every process when the processes' first batches
  (their ``task.batch_at(0)``, read only where there are several)
  differ."""
  if jax.process_count() == 1:
    return
  mine = batch_digest(task.batch_at(0)).encode()
  got = [g.decode() for g in distributed.exchange("first batch", mine)]
  if len(set(got)) > 1:
    apart = [q for q, g in enumerate(got) if g != got[0]]
    raise UsageError(
      f"the processes' batch_at(0) differ (process(es) {apart} from process "
      "0's): each process reads its batches itself, so batch_at must be a "
      "pure function of the step, the same on every host (seed any "
      "randomness from the step, e.g. np.random.default_rng([seed, step]); "
      "read the same files)"
    )


def _read_token(path: str, want: str, wait_s: float = 5.0) -> str:
  """The token at ``path``, read until it is ``want`` or ``wait_s`` has
  passed (a network file system may show a new file late)."""
  deadline = time.monotonic() + wait_s
  while True:
    try:
      with open(path) as f:
        text = f.read()
    except OSError:
      text = ""
    if text == want or time.monotonic() > deadline:
      return text
    time.sleep(0.1)


def _steps(workdir: str) -> list[int]:
  """The finished checkpoint steps in ``workdir`` (orbax's numbered
  folders; one being written has a suffix)."""
  folder = os.path.join(workdir, "checkpoints")
  if not os.path.isdir(folder):
    return []
  return sorted(int(n) for n in os.listdir(folder) if n.isdigit())
