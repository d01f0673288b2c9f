"""What the cross-process operations of every step cost: the stop
agreement (a host exchange through the coordinator's key-value store,
made by every process after every step), a key-value barrier, a quiet
point with nothing in flight, and, for comparison, the device collective
the stop agreement used to be (``process_allgather`` of one int32, which
deadlocked against transfers in flight).

  python -m experiments.distributed.sync_cost [--nprocs 2] [--calls 300]
      [--out_dir DIR]

starts the processes itself (``jpipe.launch``, one CPU device each); each
times ``--calls`` calls of every operation after 20 warm-up calls.
Prints a table (microseconds per call, as process 0 saw them: median and
90th percentile) and writes ``experiments/distributed/results/
sync_cost.json`` (or under ``--out_dir``).
"""

import argparse
import datetime
import json
import os
import platform
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(__file__)))
RESULTS = os.path.join(os.path.dirname(__file__), "results")
WARMUP = 20


def _worker(calls: int) -> None:
  from jpipe import distributed

  distributed.initialize()
  import numpy as np
  from jax.experimental import multihost_utils

  operations = {
    "stop agreement (host exchange)": lambda: distributed.agree("bench", 0),
    "key-value barrier": lambda: distributed.barrier("bench"),
    "quiet point (nothing in flight)": lambda: distributed.quiet("bench"),
    "process_allgather of an int32 (device)": lambda: (
      multihost_utils.process_allgather(np.int32(0))
    ),
  }
  rows = []
  for name, call in operations.items():
    for _ in range(WARMUP):
      call()
    times = []
    for _ in range(calls):
      t0 = time.perf_counter()
      call()
      times.append(time.perf_counter() - t0)
    us = np.asarray(times) * 1e6
    rows.append(
      {
        "operation": name,
        "median_us": float(np.median(us)),
        "p90_us": float(np.percentile(us, 90)),
      }
    )
  import jax

  if jax.process_index() == 0:
    print("ROWS " + json.dumps(rows), flush=True)


def main(argv=None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--nprocs", type=int, default=2)
  parser.add_argument("--calls", type=int, default=300)
  parser.add_argument("--out_dir", default=RESULTS)
  parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
  args = parser.parse_args(argv)
  if args.worker:
    _worker(args.calls)
    return
  command = [sys.executable, "-m", "jpipe.launch", f"--nprocs={args.nprocs}"]
  command += ["--", sys.executable, "-m", "experiments.distributed.sync_cost"]
  command += ["--worker", f"--calls={args.calls}"]
  done = subprocess.run(
    command, capture_output=True, text=True, cwd=ROOT, timeout=600
  )
  found = [
    line.split("ROWS ", 1)[1]
    for line in done.stdout.splitlines()
    if "ROWS " in line
  ]
  if done.returncode or not found:
    sys.exit(f"the processes failed:\n{done.stdout[-4000:]}{done.stderr}")
  rows = json.loads(found[0])
  print(
    f"{args.nprocs} processes, {args.calls} calls each, one CPU device each"
  )
  print(f"{'operation':42s} {'median us':>10s} {'p90 us':>10s}")
  for r in rows:
    print(f"{r['operation']:42s} {r['median_us']:10.0f} {r['p90_us']:10.0f}")
  os.makedirs(args.out_dir, exist_ok=True)
  out = {
    "date": datetime.date.today().isoformat(),
    "machine": f"{platform.machine()}, {os.cpu_count()} cores (CPU)",
    "nprocs": args.nprocs,
    "calls": args.calls,
    "rows": rows,
  }
  path = os.path.join(args.out_dir, "sync_cost.json")
  with open(path, "w") as f:
    json.dump(out, f, separators=(",", ":"))
  print(f"wrote {path}")


if __name__ == "__main__":
  main()
