r"""The GPU campaign in one command.

  python -m experiments.gpu_campaign [--quick] [--out DIR] [--parts a,b]

runs each part (``PARTS``) in its own child process with its own time
budget, one after another: a part that fails or overruns is recorded and
the next one runs. Each part rewrites ``DIR/<part>.json`` after every row
(with date, device, JAX version and commit), and ``DIR/campaign.json``
says how each part ended. ``--quick`` runs every part at a tiny size (on
a CPU too; the test suite runs it so) and with no budget: every row, so
every code path; ``--budget_scale`` stretches or shrinks the budgets. Set ``JPIPE_COMMIT`` where the tree has no ``.git``.
"""

import argparse
import importlib
import json
import math
import os
import subprocess
import sys
import time

from experiments.gpu_campaign import _common

# Part -> seconds it may spend starting new rows (full size). A row that
# has started finishes; the child is stopped at 1.5x its budget + 60 s.
PARTS = {
  "overhead": 240,
  "mfu": 300,  # GPT-2 medium x 2 dtypes, GPT-2 XL
  "memory": 150,
  "stage_times": 90,
  "driver": 90,
  "multi_device": 240,  # 5 schedules
  "profile": 120,
}
# --quick runs every row of every part (a test of the code paths, not a
# measurement), each part stopped only after this many seconds.
QUICK_TIMEOUT = 600


def _arguments(argv):
  parser = argparse.ArgumentParser(
    prog="python -m experiments.gpu_campaign",
    description=__doc__.split("\n")[0],
  )
  parser.add_argument("--quick", action="store_true", help="tiny sizes")
  parser.add_argument(
    "--out",
    default=os.path.join(os.path.dirname(__file__), "results"),
    help="folder for the JSON files",
  )
  parser.add_argument(
    "--parts",
    default=",".join(PARTS),
    help="comma-separated, of " + ", ".join(PARTS),
  )
  parser.add_argument("--budget_scale", type=float, default=1.0)
  parser.add_argument(
    "--dtype",
    default="bfloat16",
    choices=sorted(_common.DTYPES),
    help="compute dtype of the overhead and multi-device GPT (params f32)",
  )
  parser.add_argument(
    "--overhead_rows",
    default=":",
    help="START:STOP slice of the overhead part's rows (to resume a run)",
  )
  parser.add_argument(
    "--profile_runs",
    default="",
    help="comma-separated labels of the profile part's runs (default all)",
  )
  parser.add_argument("--part", help=argparse.SUPPRESS)  # a child's part
  parser.add_argument("--budget", type=float, help=argparse.SUPPRESS)
  args = parser.parse_args(argv)
  unknown = set(args.parts.split(",")) - set(PARTS)
  if unknown:
    parser.error(
      f"unknown part(s) {sorted(unknown)}: choose from {list(PARTS)}"
    )
  return args


def _run_part(args, part: str) -> dict:
  budget = math.inf if args.quick else PARTS[part] * args.budget_scale
  timeout = QUICK_TIMEOUT if args.quick else 1.5 * budget + 60
  command = [
    sys.executable,
    "-m",
    "experiments.gpu_campaign",
    f"--part={part}",
    f"--budget={budget}",
    f"--out={args.out}",
    f"--dtype={args.dtype}",
    f"--overhead_rows={args.overhead_rows}",
    f"--profile_runs={args.profile_runs}",
  ] + (["--quick"] if args.quick else [])
  start = time.monotonic()
  print(f"== {part} (budget {budget:.0f} s)", flush=True)
  try:
    child = subprocess.run(
      command, timeout=timeout, stderr=subprocess.PIPE, text=True
    )
    status = "ok" if child.returncode == 0 else "failed"
    error = child.stderr[-3000:] if child.returncode else ""
    if error:
      print(error, file=sys.stderr, flush=True)
  except subprocess.TimeoutExpired as e:
    status = "timed out"
    error = (e.stderr or b"")[-3000:]
    error = error.decode() if isinstance(error, bytes) else error
  return {
    "part": part,
    "status": status,
    "seconds": round(time.monotonic() - start, 1),
    "budget_seconds": budget,
    "error": error,
  }


def main(argv=None) -> int:
  args = _arguments(argv)
  if args.part:  # A child: run one part in this process.
    importlib.import_module(f"experiments.gpu_campaign.{args.part}").main(args)
    return 0
  os.makedirs(args.out, exist_ok=True)
  summary = {**_common.metadata(), "quick": args.quick, "parts": []}
  path = os.path.join(args.out, "campaign.json")
  for part in args.parts.split(","):
    summary["parts"].append(_run_part(args, part))
    with open(path, "w") as f:
      json.dump(summary, f, separators=(",", ":"))
  for entry in summary["parts"]:
    print(f"{entry['part']:>14}: {entry['status']} in {entry['seconds']} s")
  return 0 if all(e["status"] == "ok" for e in summary["parts"]) else 1


if __name__ == "__main__":
  sys.exit(main())
