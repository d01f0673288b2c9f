r"""jpipe's PipeDream solver against PipeDream's own optimizer: solve time.

The 33 cases: the 11 shipped profiles PipeDream's optimizer solves as
profiled (all but inception_v3, which needs branch compression first, and
the two NASNets, too large even compressed), each as a straight pipeline of
n in {2, 4, 8} machines with PipeDream's default flags otherwise (1e9 B/s,
transfers ignored):

- PipeDream: ``optimizer/optimizer_graph_hierarchical.py`` of a checkout of
  msr-fiddle/pipedream (``--pipedream_dir``), run as its command line
  (``-f graph.txt -n N --straight_pipeline``) in a fresh process; the time
  is that of its ``__main__`` from reading graph.txt to the printed
  partition (interpreter start and imports excluded), and that of the
  whole command (its process from start to exit, as a user runs it: the
  issue's figures compare this one). Its ``graph``
  package imports ``graphviz``: put it on ``PYTHONPATH`` if it is not
  installed.
- jpipe: ``load_pipedream_profile`` + ``solve_pipedream(straight=True)``
  in this process, the same span (profile file to partition).

Times are CPU seconds of the process (``time.process_time``: the machine
is shared, and wall time counts the other users' work), each side's best
over ``--repeats`` rounds, each of 4 jpipe runs then one PipeDream run
(both sides' runs spread over the same seconds: the shared machine's
speed drifts, and jpipe's few milliseconds of runs back to back could all
fall in one slow moment); ``--interleave``: one jpipe run per round, so
that each of jpipe's starts cold. The two must agree on the
bottleneck (PipeDream's "Time per stage in pipeline"); a mismatch stops
the run.

Usage: python -m experiments.partition.pipedream_speed \
  --pipedream_dir DIR [--out DIR] [--repeats 2] [--interleave]
"""

import argparse
import json
import os
import re
import resource
import subprocess
import sys
import time

import numpy as np

from jpipe.partition import (
  load_pipedream_profile,
  profile_path,
  solve_pipedream,
)

OUT = os.path.join(os.path.dirname(__file__), "results")
CASES = (
  "alexnet",
  "densenet121",
  "gnmt",
  "gnmt_large",
  "resnet101",
  "resnet18",
  "resnet50",
  "resnext101",
  "resnext50",
  "squeezenet1_0",
  "vgg16",
)
MACHINES = (2, 4, 8)

# Runs PipeDream's script as its __main__ and prints the seconds it took.
_RUNNER = """
import os, runpy, sys, time
script = sys.argv[1]
sys.argv = [script] + sys.argv[2:]
here = os.path.dirname(script)
sys.path[:0] = [here, os.path.dirname(here)]
import graph, utils  # imports outside the timed span
start = time.process_time()
runpy.run_path(script, run_name="__main__")
print("SECONDS", time.process_time() - start)
"""


def pipedream_seconds(pipedream_dir, name, n):
  """(solve seconds, whole command's seconds, pipeline time per minibatch
  in s) of PipeDream's optimizer."""
  optimizer = os.path.join(pipedream_dir, "optimizer")
  script = os.path.join(optimizer, "optimizer_graph_hierarchical.py")
  if not os.path.exists(script):
    raise SystemExit(f"no {script}: --pipedream_dir is a pipedream checkout")
  graph_txt = os.path.join(profile_path(name), "graph.txt")
  before = _children_cpu()
  run = subprocess.run(
    [sys.executable, "-c", _RUNNER, script, "-f", graph_txt, "-n", str(n)]
    + ["--straight_pipeline"],
    cwd=optimizer,
    capture_output=True,
    text=True,
    check=False,
  )
  command = _children_cpu() - before
  if run.returncode:
    raise SystemExit(f"PipeDream's optimizer failed on {name}:\n{run.stderr}")
  seconds = float(re.search(r"SECONDS (\S+)", run.stdout).group(1))
  per_stage = re.search(r"Time per stage in pipeline: (\S+)", run.stdout)
  return seconds, command, float(per_stage.group(1))


def _children_cpu():
  usage = resource.getrusage(resource.RUSAGE_CHILDREN)
  return usage.ru_utime + usage.ru_stime


JPIPE_RUNS = 4


def jpipe_seconds(name, n):
  """(seconds, bottleneck in s) of jpipe's load + solve_pipedream."""
  start = time.process_time()
  graph = load_pipedream_profile(name)
  sol = solve_pipedream(graph, n, straight=True, bandwidth=1e9)
  return time.process_time() - start, sol.bottleneck_seconds


def case(pipedream_dir, name, n, repeats, interleave=False):
  """One row: best-of-``repeats`` seconds of each side, checked to agree.

  In ``repeats`` rounds, each jpipe's runs (``JPIPE_RUNS``, back to back:
  the first after the last PipeDream process, the others warm) then one
  of PipeDream's: both sides' runs spread over the same seconds, so that
  the machine's slower and faster moments reach both alike. With
  ``interleave``, one jpipe run per round: every one of its runs starts
  right after a PipeDream process has filled the caches (a cold start, as
  a first call in a session).
  """
  ours, theirs = [], []
  for _ in range(repeats):
    for _ in range(1 if interleave else JPIPE_RUNS):
      ours.append(jpipe_seconds(name, n))
    theirs.append(pipedream_seconds(pipedream_dir, name, n))
  ms, pd_ms = 1e3 * ours[0][1], 1e3 * theirs[0][2]
  if not np.isclose(ms, pd_ms, rtol=1e-6):
    raise SystemExit(f"{name} n={n}: jpipe {ms} ms, PipeDream {pd_ms} ms")
  jp = min(t[0] for t in ours)
  pd = min(t[0] for t in theirs)
  command = min(t[1] for t in theirs)
  return {
    "model": name,
    "n": n,
    "bottleneck_ms": ms,
    "jpipe_seconds": jp,
    "pipedream_seconds": pd,
    "pipedream_command_seconds": command,
    "speedup": pd / jp,
    "speedup_vs_command": command / jp,
  }


def _row(r):
  return (
    f"| {r['model']} | {r['n']} | {r['bottleneck_ms']:.2f} | "
    f"{1e3 * r['jpipe_seconds']:.1f} | {1e3 * r['pipedream_seconds']:.0f} | "
    f"{r['speedup']:.0f}x | {1e3 * r['pipedream_command_seconds']:.0f} | "
    f"{r['speedup_vs_command']:.0f}x |"
  )


def _summary(records, key, what):
  worst = min(records, key=lambda r: r[key])
  return (
    f"{len(records)} cases, against {what}: speed-up median "
    f"{np.median([r[key] for r in records]):.0f}x, worst "
    f"{worst[key]:.0f}x ({worst['model']} n = {worst['n']})."
  )


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--pipedream_dir", required=True)
  parser.add_argument("--out", default=OUT)
  parser.add_argument("--repeats", type=int, default=2)
  parser.add_argument("--models", nargs="*", default=CASES)
  parser.add_argument("--interleave", action="store_true")
  args = parser.parse_args(argv)
  records = []
  for name in args.models:
    for n in MACHINES:
      records.append(
        case(args.pipedream_dir, name, n, args.repeats, args.interleave)
      )
      print(_row(records[-1]), flush=True)
  table = (
    "| profile | n | bottleneck ms | jpipe ms | PipeDream solve ms | "
    "speed-up | PipeDream command ms | speed-up |\n"
    "|---|---|---|---|---|---|---|---|\n"
    + "\n".join(_row(r) for r in records)
    + "\n\n"
    + _summary(records, "speedup", "its solve")
    + "\n"
    + _summary(records, "speedup_vs_command", "its whole command")
    + "\n"
  )
  os.makedirs(args.out, exist_ok=True)
  with open(os.path.join(args.out, "pipedream_speed.md"), "w") as f:
    f.write(table)
  with open(os.path.join(args.out, "pipedream_speed.json"), "w") as f:
    json.dump(records, f, separators=(",", ":"))
  print(table)


if __name__ == "__main__":
  main()
