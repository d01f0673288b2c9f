"""The bubble measured through jpipe's runtime against the simulator's
(issue 63, item 4): 1F1B, interleaved, ZB-H1 and ZB-V at p = 4, m = 8
and 16.

Each schedule runs as a real ``jpipe.Pipeline`` (a small MLP, one layer
per stage) on p processes with one CPU device each, launched by
``jpipe.launch`` (``experiments.distributed.bubble``'s worker). One
process per device is what makes a host-side sleep model device time:
the driver dispatches a process's own actions from its one thread, so
sleeps of different devices run concurrently, as the devices would, and
p processes can share 2 cores because they sleep, not compute. Before an
action's program is dispatched, a driver hook waits for the action's
inputs (activations or cotangents arriving from other processes) and
then sleeps the action's cost -- outside the device programs, so a
device stays free to serve transfers. The costs are the simulator's
units: per device and microbatch F = 1, I = W = 1 (a whole backward B =
2) units of ``--unit_ms``; a schedule with v stages per device
(interleaved on the loop, stage s on device s mod p; ZB-V in its V)
sleeps 1 / v of that per stage, as in ``experiments.schedules.bubbles``.

Bubble, measured and simulated alike: ``1 - sum(busy) / (p * makespan)``
(``jpipe.schedule.Timeline.bubble``). An action is busy from the moment
its inputs were ready on its process to the process's return to its
next action (the sleep, the program's dispatch, its sends); the last
action of a device ends with its sleep. The makespan runs from the
first action's start to the last one's end over all processes (their
``time.perf_counter`` is one clock). "simulated" is
``jpipe.schedule.simulate`` on the schedule's own lists at the unit costs
and free transfers -- the cell of ``experiments.schedules.bubbles``'
table; "fitted" is the simulator on the same lists with each stage's
mean measured costs and the median measured transfer latency. Each row
is the median of ``--steps`` steps after two warm-up steps.

  python -m experiments.schedules.measured_bubbles [--devices 4]
      [--microbatches 8,16] [--schedules 1f1b,interleaved,zbh1,zbv]
      [--unit_ms 50] [--steps 3] [--out_dir DIR]

Prints a table; writes ``experiments/schedules/results/measured_bubbles.json``
(``--out_dir``, ``--name``).
"""

import argparse
import json
import os
import sys
import time

from experiments.distributed import bubble
from experiments.schedules import bubbles
from jpipe import schedule as sc

RESULTS = os.path.join(os.path.dirname(__file__), "results")
TOLERANCE = 0.05  # Issue 63: measured within 5 % (absolute) of simulated.


def measure(schedule, p, m, *, unit_ms, steps, tmp):
  """One schedule on p processes, m microbatches a step: its simulated
  and measured bubble (and the draft's fitted prediction)."""
  costs = argparse.Namespace(
    forward_ms=unit_ms, input_ms=unit_ms, weight_ms=unit_ms, steps=steps
  )
  fitted = bubble.run(costs, schedule, p, m, tmp)
  simulated = bubbles.row(schedule, p, m, chunks=2)
  return {
    "schedule": schedule,
    "p": p,
    "microbatches": m,
    "stages_per_device": simulated["stages_per_device"],
    "simulated_bubble": simulated["bubble"],
    "measured_bubble": fitted["measured_bubble"],
    "difference": fitted["measured_bubble"] - simulated["bubble"],
    "fitted_bubble": fitted["predicted_bubble"],
    "simulated_ms": unit_ms * 3 * m * simulated["step"],
    "measured_ms": fitted["measured_ms"],
    "measured_ms_runs": fitted["measured_ms_runs"],
    "transfer_ms": fitted["transfer_ms"],
    "cost_ms": fitted["cost_ms"],
  }


def table(rows) -> str:
  """The rows as a markdown table."""
  lines = [
    "| schedule | v | p | m | simulated bubble | measured bubble | "
    "difference | fitted bubble | step ms simulated | measured |",
    "|---|---|---|---|---|---|---|---|---|---|",
  ]
  for r in rows:
    lines.append(
      f"| {r['schedule']} | {r['stages_per_device']} | {r['p']} | "
      f"{r['microbatches']} | {r['simulated_bubble']:.3f} | "
      f"{r['measured_bubble']:.3f} | {r['difference']:+.3f} | "
      f"{r['fitted_bubble']:.3f} | {r['simulated_ms']:.0f} | "
      f"{r['measured_ms']:.0f} |"
    )
  return "\n".join(lines)


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--devices", default="4", help="p, comma-separated")
  parser.add_argument("--microbatches", default="8,16")
  parser.add_argument("--schedules", default="1f1b,interleaved,zbh1,zbv")
  parser.add_argument("--unit_ms", type=float, default=50.0)
  parser.add_argument("--steps", type=int, default=3)
  parser.add_argument("--name", default="measured_bubbles")
  parser.add_argument("--out_dir", default=RESULTS)
  args = parser.parse_args(argv)
  if args.unit_ms <= 0 or args.steps < 1:
    raise SystemExit("--unit_ms must be > 0 and --steps >= 1")
  schedules = args.schedules.split(",")
  for name in schedules:  # Checked before any launch.
    if name not in sc.SYNCHRONOUS:
      raise SystemExit(
        f"--schedules: {name!r} is not a flushed schedule; give some of "
        f"{', '.join(sc.SYNCHRONOUS)}"
      )
  os.makedirs(args.out_dir, exist_ok=True)
  tmp = os.path.join(args.out_dir, f"_{args.name}_run.json")
  rows = []
  for p in map(int, args.devices.split(",")):
    for m in map(int, args.microbatches.split(",")):
      for schedule in schedules:
        rows.append(
          measure(
            schedule, p, m, unit_ms=args.unit_ms, steps=args.steps, tmp=tmp
          )
        )
        print(table(rows[-1:]).splitlines()[-1], flush=True)
  print(table(rows))
  worst = max(abs(r["difference"]) for r in rows)
  print(f"largest |measured - simulated|: {worst:.3f} (target {TOLERANCE})")
  result = {
    "date": time.strftime("%Y-%m-%d"),
    "unit_ms": args.unit_ms,
    "steps": args.steps,
    "definition": "bubble = 1 - sum(busy) / (p * makespan)",
    "rows": rows,
  }
  path = os.path.join(args.out_dir, f"{args.name}.json")
  with open(path, "w") as f:
    json.dump(result, f, indent=1)
  print(f"wrote {path}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
