"""Restarts of a failed run (``--max_restarts``), on fewer processes when
some do not start again (``--min_nprocs``), as torchrun's
``--max-restarts`` and ``--nnodes MIN:MAX`` do on a cluster.

The policy (``Restarts.after``), applied when an attempt ends:

- Every process exited 0, or a SIGTERM / SIGINT to the launcher stopped
  the run: the launcher exits with the run's status (a stop the user
  asked for is never undone by a restart).
- A process failed (a non-zero status, a signal, or status 124 from the
  training loop's watchdog when the run hung): the others are stopped,
  and while restarts remain, every process starts again -- all of them:
  a restart first tries the full count -- with a fresh coordinator port
  (the old one may still be held, or in TIME_WAIT). The command resumes
  from its last checkpoint itself (``jpipe.train`` does, on a workdir
  with checkpoints): the launcher knows no workdir. Each restart is one
  line naming the failure, how long the attempt ran and the restart's
  number.
- Status 2 is not restarted: it is a usage error (Python's argparse,
  absl, ``jpipe.train``'s refusals of a config or a checkpoint), which
  the same command repeats.
- A host that does not come back: during a restart, a process that
  fails within ``startup_s`` seconds of its start (its devices gone, a
  node that cannot join) has its slot -- its devices -- dropped, and the
  restart goes on at once with the others, renumbered 0.., one line
  saying so; the command plans for the new count itself (``jpipe.train``
  checkpoints are process-count independent). One slot per failure:
  where a process's failure takes its peers down with it, the first to
  fail is the cause. Never below ``min_nprocs`` processes: a start-up
  failure there is an ordinary failure (the next restart, or none left).
  Dropping a slot uses no restart (there are at most N - K drops each).
- No restarts left: the launcher exits with the failing status, as
  without restarts (one line saying so where restarts were asked for).
"""

import dataclasses
import sys
import threading

from jpipe.launch._processes import Outcome, Requests, attempt, describe


@dataclasses.dataclass(frozen=True)
class Step:
  """What comes after a failed attempt: ``slots`` to run (None: exit),
  as restart ``restart`` (0: the first attempt), and the line saying so
  (empty: nothing to say)."""

  slots: list | None
  restart: int
  line: str


@dataclasses.dataclass(frozen=True)
class Restarts:
  """The restart policy (the module's docstring).

  Attributes:
    max_restarts: restarts allowed after failures (0: none).
    min_nprocs: the fewest processes a restart may go on with.
    startup_s: a process failing within this many seconds of a restart's
      start failed at start-up (its slot is dropped).
  """

  max_restarts: int = 0
  min_nprocs: int = 1
  startup_s: float = 30.0

  def after(self, outcome: Outcome, slots, restart: int, nprocs: int) -> Step:
    """The step after ``outcome``, a failed attempt on ``slots`` (restart
    ``restart``) of a run of ``nprocs`` processes."""
    if not self.max_restarts:
      return Step(None, restart, "")
    what = (
      f"process {outcome.failed} ended with {describe(outcome.status)} "
      f"after {outcome.seconds:.1f} s"
    )
    if outcome.status == 2:
      return Step(
        None,
        restart,
        f"{what}: a usage error, which a restart would repeat; not restarting",
      )
    if (
      restart
      and outcome.seconds < self.startup_s
      and len(slots) > self.min_nprocs
    ):
      left = [s for i, s in enumerate(slots) if i != outcome.failed]
      return Step(
        left,
        restart,
        f"{what}, at start-up: restart {restart} goes on with "
        f"{_processes(len(left))} instead of {len(slots)} (at least "
        f"{self.min_nprocs}: --min_nprocs); the command plans for them",
      )
    if restart < self.max_restarts:
      return Step(
        list(range(nprocs)),
        restart + 1,
        f"{what}; restart {restart + 1} of {self.max_restarts}, "
        f"{_processes(nprocs)}: the command resumes from its last "
        "checkpoint",
      )
    return Step(
      None,
      restart,
      f"{what}; no restarts left (--max_restarts {self.max_restarts}): "
      f"exiting with status {outcome.code}",
    )


def run_with_restarts(
  command, environments, nprocs: int, policy: Restarts, *, grace, out=None
) -> int:
  """Runs ``command`` in ``nprocs`` processes, restarting it by
  ``policy``; returns the exit status. ``environments(slots)``: the
  processes' environments for those slots (a fresh coordinator port at
  each call); ``grace``: seconds between a forwarded SIGTERM / SIGINT
  and SIGKILL."""
  out = out or sys.stdout
  lock = threading.Lock()
  slots, restart = list(range(nprocs)), 0
  with Requests(grace) as requests:
    while True:
      outcome = attempt(command, environments(slots), requests, out, lock)
      if outcome.status == 0 or outcome.requested:
        return outcome.code
      step = policy.after(outcome, slots, restart, nprocs)
      if step.line:
        with lock:
          out.write(f"[launch] {step.line}\n")
          out.flush()
      if step.slots is None or requests.received:
        return outcome.code
      slots, restart = step.slots, step.restart


def _processes(n: int) -> str:
  return f"{n} process" + ("es" if n != 1 else "")
