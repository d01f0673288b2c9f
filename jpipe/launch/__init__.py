"""Starts a multi-process run on this machine.

  python -m jpipe.launch --nprocs N [--devices-per-process K] \\
      [--max_restarts R [--min_nprocs M]] -- \\
      python -m jpipe.train --config configs/default.py ...

starts N copies of the command with the environment
``jpipe.distributed.initialize`` reads (a free coordinator port on
127.0.0.1, the process count and each one's rank; K CPU devices each, or
K GPUs each where there are GPUs), prints their output line by line
prefixed with ``[pI]``, and, when one exits with an error, stops the
others (SIGTERM, then SIGKILL after ``FAILED_RUN_GRACE_S`` seconds) and
exits with that process's code -- or, with ``--max_restarts R``, starts
them all again up to R times (the command resumes from its last
checkpoint), on as few as M processes where some do not start again
(``_restarts``). SIGINT / SIGTERM to the launcher go to every process (a
training run checkpoints and exits; no restart follows); one still
running ``--grace`` seconds later gets SIGKILL. The processes die with
the launcher, however it dies (Linux's parent-death signal): killing the
launcher, even with SIGKILL, leaves no process behind.
For several hosts, start one process per host or GPU with your cluster's
launcher instead (BUILD.md: SLURM).

Modules: ``_processes`` (one attempt: start, watch, stop), ``_restarts``
(the restart policy), ``_cli`` (the command line).
"""

from jpipe.launch._cli import main
from jpipe.launch._processes import (
  FAILED_RUN_GRACE_S,
  Outcome,
  process_environments,
  run,
)
from jpipe.launch._restarts import Restarts, run_with_restarts

__all__ = [
  "FAILED_RUN_GRACE_S",
  "Outcome",
  "Restarts",
  "main",
  "process_environments",
  "run",
  "run_with_restarts",
]
