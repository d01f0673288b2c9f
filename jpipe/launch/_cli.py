"""The launcher's command line (``python -m jpipe.launch``)."""

import argparse
import functools
import shutil

from jpipe.launch._processes import gpu_count, process_environments
from jpipe.launch._restarts import Restarts, run_with_restarts


def _parser() -> argparse.ArgumentParser:
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
  parser.add_argument(
    "--max_restarts",
    "--max-restarts",
    type=int,
    default=0,
    help="when a process fails (or its watchdog stops a hung run), start "
    "every process again, up to this many times; the command resumes "
    "from its last checkpoint (default 0)",
  )
  parser.add_argument(
    "--min_nprocs",
    "--min-nprocs",
    type=int,
    default=None,
    help="a restart goes on with as few as this many processes when some "
    "fail again at start-up (default --nprocs: never fewer)",
  )
  parser.add_argument(
    "--startup_window",
    "--startup-window",
    type=float,
    default=None,
    help="with --min_nprocs: a process that fails within this many seconds "
    "of a restart's start failed at start-up (default 30)",
  )
  parser.add_argument("command", nargs=argparse.REMAINDER)
  return parser


def _restarts(parser, args) -> Restarts:
  """The restart policy the flags ask for; a one-line error otherwise."""
  if args.max_restarts < 0:
    parser.error("--max_restarts must be >= 0 (0: no restarts)")
  min_nprocs = args.nprocs if args.min_nprocs is None else args.min_nprocs
  if not 1 <= min_nprocs <= args.nprocs:
    parser.error(
      f"--min_nprocs {min_nprocs} is not in 1 .. --nprocs ({args.nprocs})"
    )
  if min_nprocs < args.nprocs and not args.max_restarts:
    parser.error("--min_nprocs applies to restarts: give --max_restarts too")
  if args.startup_window is not None:
    if min_nprocs == args.nprocs:
      parser.error(
        "--startup_window applies to --min_nprocs below --nprocs: give it"
      )
    if args.startup_window <= 0:
      parser.error("--startup_window must be > 0 seconds")
  startup = 30.0 if args.startup_window is None else args.startup_window
  return Restarts(args.max_restarts, min_nprocs, startup)


def main(argv=None) -> int:
  parser = _parser()
  args = parser.parse_args(argv)
  command = args.command[1:] if args.command[:1] == ["--"] else args.command
  if not command:
    parser.error("give the command after --, e.g. -- python -m jpipe.train")
  if shutil.which(command[0]) is None:
    parser.error(f"no command {command[0]!r} on PATH (or no such file)")
  if args.nprocs < 1 or args.devices_per_process < 1:
    parser.error("--nprocs and --devices-per-process must be >= 1")
  policy = _restarts(parser, args)
  platform = args.platform
  wanted = args.nprocs * args.devices_per_process
  gpus = gpu_count() if platform != "cpu" else 0
  if platform == "auto":
    platform = "gpu" if gpus >= wanted else "cpu"
  elif platform == "gpu" and gpus < wanted:
    parser.error(
      f"{args.nprocs} processes x {args.devices_per_process} GPUs need "
      f"{wanted} GPUs, nvidia-smi lists {gpus}"
    )
  environments = functools.partial(
    _environments, args.devices_per_process, platform
  )
  return run_with_restarts(
    command, environments, args.nprocs, policy, grace=args.grace
  )


def _environments(devices_per_process, platform, slots):
  return process_environments(
    len(slots), devices_per_process, platform, slots=slots
  )
