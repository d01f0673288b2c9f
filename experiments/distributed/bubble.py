"""Measured pipeline bubble on several processes against the simulator's
prediction: 1F1B, ZB-H1 and ZB-V (issue 33's evidence), and interleaved
1F1B on the loop placement (issue 63, item 4:
``experiments.schedules.measured_bubbles``).

One device per process (``jax.distributed`` over 127.0.0.1, the pull
transport). Each stage's compute is simulated on the host: before an
action's program is dispatched, a driver hook (``SimulatedCompute``)
waits for the action's inputs -- activations or cotangents arriving from
the other processes -- and then sleeps the action's cost (``--forward_ms``,
``--input_ms``, ``--weight_ms`` per stage; a whole backward B sleeps I + W;
a schedule placing 2p stages on p devices -- ZB-V's V, interleaved's
loop ``s mod p`` -- costs half as much per stage, so every device has the
same work). The real programs (a small MLP) are tiny beside the sleeps,
so a process is busy exactly while it sleeps or runs one, and the
device is free to serve transfers -- a CPU device serves none while it
runs a program, which is why compute cannot be simulated inside the
programs (RESULTS.md, "Zero-bubble ..."). The machine's cores only carry
the dispatch, so p processes may share 2 cores.

Each process stamps (``time.perf_counter``: CLOCK_MONOTONIC, the same
clock in every process of the host) when each of its actions started and
ended, from the hook's return to the program's outputs being ready. A
step's makespan is the last end less the first start over all processes;
its bubble ``1 - sum(busy) / (p * makespan)``. The prediction is
``jpipe.schedule.simulate`` on the same lists with the mean measured F,
I, W (B) cost of each stage and the mean measured transfer latency
(consumer's start less its producer's end, where the consumer waited).
Every row is the median over ``--steps`` steps after two warm-up steps.

  python -m experiments.distributed.bubble [--procs 2,4]
      [--schedules 1f1b,zbh1,zbv] [--microbatches 8,16] [--forward_ms 20]
      [--input_ms 20] [--weight_ms 20] [--steps 3]

Prints a table; writes ``experiments/distributed/results/bubble.json``
(``--out_dir``, ``--name``).
"""

import argparse
import json
import os
import subprocess
import sys
import time

import numpy as np

from experiments.distributed.throughput import one_core_env

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(__file__)))
RESULTS = os.path.join(os.path.dirname(__file__), "results")
WIDTH, ROWS = 32, 4  # The MLP's width; rows per microbatch.


def _hooks_class():
  """``SimulatedCompute``, defined once JAX may be imported."""
  import jax

  from jpipe.runtime import DriverHooks

  class SimulatedCompute(DriverHooks):
    """Waits for an action's inputs, then sleeps its cost; stamps when
    the sleep began (the action's start)."""

    def __init__(self, seconds):
      self.seconds = seconds  # kind -> seconds (per chunk)
      self.entered = {}  # action -> perf_counter when its hook began
      self.started = {}  # action -> when its inputs were all ready
      self.slept = {}  # action -> when its sleep ended

    def before_compute(self, action, inputs=()):
      self.entered[action] = time.perf_counter()
      jax.block_until_ready(inputs)
      self.started[action] = time.perf_counter()
      time.sleep(self.seconds[action.kind])
      self.slept[action] = time.perf_counter()

    def clear(self):
      self.entered, self.started, self.slept = {}, {}, {}

    def spans(self):
      """action -> (start, end): from its inputs' arrival to the host's
      return to the next action (the sleep, the program's dispatch, the
      sends after it); the last action ends with its sleep (its program,
      under a millisecond, uncounted)."""
      order = sorted(self.started, key=self.started.get)
      return {
        a: (
          self.started[a],
          self.slept[a] if nxt is None else self.entered[nxt],
        )
        for a, nxt in zip(order, [*order[1:], None], strict=True)
      }

  return SimulatedCompute


def stage_devices(schedule, p):
  """Each stage's device (process) for ``schedule`` on p devices: 2p
  stages where the schedule places several per device (a V, or the loop
  ``s mod p`` of interleaved, looped_bfs and interleaved_zb), else p."""
  from jpipe import schedule as sc

  kind = sc.lookup(schedule)
  if not kind.places_itself:
    return tuple(range(p))
  return kind.stage_devices(2 * p) or sc.loop_placement(2 * p, p)


def _costs(args, chunks):
  """Seconds per action kind of one stage (``chunks`` stages per device
  share a device's work)."""
  share = 1.0 / chunks
  f, i, w = (
    share * x / 1e3 for x in (args.forward_ms, args.input_ms, args.weight_ms)
  )
  return {"F": f, "I": i, "W": w, "B": i + w}


def worker(args, out):
  """One process of a p-process run (under ``jpipe.launch``)."""
  from jpipe import distributed

  distributed.initialize()
  import jax
  import optax

  import jpipe

  schedule, p, m = args.schedule, jax.process_count(), int(args.microbatches)
  placed = stage_devices(schedule, p)
  stages = len(placed)
  loss_fn, params, batch = _mlp(stages, m)
  hooks = _hooks_class()(_costs(args, stages // p))
  pipe = jpipe.Pipeline(
    loss_fn,
    params,
    batch,
    num_stages=stages,
    schedule=schedule,
    num_microbatches=m,
    optimizer=optax.sgd(1e-3),
    recompute=False,
    fuse_last_stage=False,  # Every action sleeps its own cost.
    hooks=hooks,  # Several stages per device: the schedule places them.
  )
  if sorted(pipe.plan.stage_of_node) != list(range(stages)):
    raise SystemExit(f"expected {stages} one-layer stages: {pipe.plan}")
  if pipe.plan.stage_devices != tuple((d,) for d in placed):
    raise SystemExit(f"expected stages on devices {placed}: {pipe.plan}")
  state = pipe.init(params)
  steps = []
  for step in range(2 + args.steps):
    hooks.clear()
    distributed.barrier(f"step {step}")
    state, metrics = pipe.step(state, batch)
    jax.block_until_ready((state.stage_params, metrics["loss"]))
    if step >= 2:  # After compiling.
      steps.append({str(a): span for a, span in hooks.spans().items()})
  lists = pipe.call_actions(state, m)
  with open(f"{out}.{jax.process_index()}", "w") as f:
    json.dump(
      {
        "steps": steps,
        "lists": lists.format(),
        "stage_device": list(lists.stage_device),
      },
      f,
    )


def _mlp(layers, m):
  """A small MLP of ``layers`` dense layers (one per stage): its loss,
  params and a batch of ``ROWS`` rows per microbatch, m microbatches."""
  import flax.linen as nn
  import jax

  class Mlp(nn.Module):
    @nn.compact
    def __call__(self, x):
      for i in range(layers):
        x = nn.tanh(nn.Dense(WIDTH, name=f"dense_{i}")(x))
      return x

  model = Mlp()
  x = jax.random.normal(jax.random.key(0), (ROWS * m, WIDTH))
  batch = {"x": x, "y": jax.numpy.tanh(x[:, ::-1])}
  params = model.init(jax.random.key(1), x[:1])

  def loss_fn(params, batch):
    return ((model.apply(params, batch["x"]) - batch["y"]) ** 2).mean()

  return loss_fn, params, batch


def _producer(action, num_stages):
  """The action whose output ``action`` reads from another stage, or
  None: F(s) reads F(s - 1), B / I(s) the input gradient of s + 1."""
  kind, s, b = action
  if kind == "F" and s > 0:
    return ("F", s - 1, b)
  if kind in ("B", "I") and s < num_stages - 1:
    return ("I" if kind == "I" else "B", s + 1, b)  # A V's halves match.
  return None


def _parse(name):
  """ "F0.3" -> ("F", 0, 3)."""
  stage, b = name[1:].split(".")
  return (name[0], int(stage), int(b))


def analyse(schedule, p, m, steps, stage_device):
  """Measured and predicted makespan and bubble of one run's steps."""
  from jpipe import schedule as sc

  n = len(stage_device)
  lists = sc.build(schedule, n, m, stage_device=list(stage_device))
  measured, costs, waits = [], {}, []
  for spans in steps:
    spans = {_parse(k): v for k, v in spans.items()}
    t0 = min(s for s, _ in spans.values())
    makespan = max(e for _, e in spans.values()) - t0
    busy = sum(e - s for s, e in spans.values())
    measured.append((makespan, 1 - busy / (p * makespan)))
    for a, (s, e) in spans.items():
      costs.setdefault(a[:2], []).append(e - s)
    # Transfer latency: a consumer that waited for its input from another
    # device starts this long after its producer ended.
    prev_end = {}
    for d in range(p):
      mine = sorted(
        (a for a in spans if stage_device[a[1]] == d), key=lambda a: spans[a][0]
      )
      for a, nxt in zip(mine, mine[1:], strict=False):
        prev_end[nxt] = spans[a][1]
    for a, (s, _) in spans.items():
      src = _producer(a, n)
      if src is None or src not in spans:
        continue
      if stage_device[src[1]] == stage_device[a[1]]:
        continue
      if prev_end.get(a, t0) <= spans[src][1]:  # It waited for the input.
        waits.append(s - spans[src][1])
  mean = {k: float(np.mean(v)) for k, v in costs.items()}

  def per_stage(kind):
    return [mean.get((kind, s), 0.0) for s in range(n)]

  f, i, w, b = (per_stage(k) for k in "FIWB")
  i = [x or y / 2 for x, y in zip(i, b, strict=True)]  # No I: half a B.
  w = [x or y / 2 for x, y in zip(w, b, strict=True)]
  b = [x or y + z for x, y, z in zip(b, i, w, strict=True)]
  comm = float(np.median(waits)) if waits else 0.0
  predicted = sc.simulate(
    lists, f, b, input_seconds=i, weight_seconds=w, comm_seconds=comm
  )
  makespan, bubble = np.median(np.asarray(measured), axis=0)
  return {
    "schedule": schedule,
    "p": p,
    "microbatches": m,
    "measured_ms": 1e3 * float(makespan),
    "predicted_ms": 1e3 * predicted.makespan,
    "measured_bubble": float(bubble),
    "predicted_bubble": predicted.bubble,
    "measured_ms_runs": [1e3 * x for x, _ in measured],
    "transfer_ms": 1e3 * comm,
    "cost_ms": {
      k: 1e3
      * float(np.mean([mean[(k, s)] for s in range(n) if (k, s) in mean]))
      for k in "FIWB"
      if any((k, s) in mean for s in range(n))
    },
  }


def run(args, schedule, p, m, out):
  """Launches p workers running m microbatches a step; their analysed
  steps."""
  me = [sys.executable, "-m", "experiments.distributed.bubble"]
  flags = [
    f"--microbatches={m}",
    f"--forward_ms={args.forward_ms}",
    f"--input_ms={args.input_ms}",
    f"--weight_ms={args.weight_ms}",
    f"--steps={args.steps}",
  ]
  launch = [sys.executable, "-m", "jpipe.launch", "--nprocs", str(p), "--"]
  command = [*launch, *me, *flags, "--worker", schedule, out]
  done = subprocess.run(
    command,
    env=one_core_env(1),
    capture_output=True,
    text=True,
    timeout=900,
    cwd=ROOT,
  )
  if done.returncode:
    raise SystemExit(done.stdout[-3000:] + done.stderr[-3000:])
  parts = []
  for r in range(p):
    with open(f"{out}.{r}") as f:
      parts.append(json.load(f))
    os.remove(f"{out}.{r}")
  steps = [
    {k: v for part in parts for k, v in part["steps"][i].items()}
    for i in range(args.steps)
  ]
  return analyse(schedule, p, m, steps, parts[0]["stage_device"])


def _table(rows):
  lines = [
    f"{'schedule':9} {'p':>2} {'m':>3} {'measured ms':>11} {'predicted':>9} "
    f"{'bubble':>7} {'predicted':>9} {'|diff|':>6} {'transfer ms':>11}"
  ]
  for r in rows:
    lines.append(
      f"{r['schedule']:9} {r['p']:>2} {r['microbatches']:>3} "
      f"{r['measured_ms']:>11.1f} {r['predicted_ms']:>9.1f} "
      f"{r['measured_bubble']:>7.3f} {r['predicted_bubble']:>9.3f} "
      f"{abs(r['measured_bubble'] - r['predicted_bubble']):>6.3f} "
      f"{r['transfer_ms']:>11.2f}"
    )
  return "\n".join(lines)


def gains(rows):
  """Per p: ZB-H1's (and ZB-V's) step-time gain over 1F1B, measured and
  predicted, and their ratio."""
  out = []
  by = {(r["schedule"], r["p"], r["microbatches"]): r for r in rows}
  for (schedule, p, m), r in sorted(by.items()):
    base = by.get(("1f1b", p, m))
    if schedule == "1f1b" or base is None:
      continue
    measured = base["measured_ms"] - r["measured_ms"]
    predicted = base["predicted_ms"] - r["predicted_ms"]
    out.append(
      {
        "schedule": schedule,
        "p": p,
        "microbatches": m,
        "measured_gain_ms": measured,
        "predicted_gain_ms": predicted,
        "gain_ratio": measured / predicted if predicted else None,
      }
    )
  return out


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--procs", default="2,4", help="comma-separated")
  parser.add_argument("--schedules", default="1f1b,zbh1,zbv")
  parser.add_argument("--microbatches", default="8", help="comma-separated")
  parser.add_argument("--forward_ms", type=float, default=20.0)
  parser.add_argument("--input_ms", type=float, default=20.0)
  parser.add_argument("--weight_ms", type=float, default=20.0)
  parser.add_argument("--steps", type=int, default=3)
  parser.add_argument("--name", default="bubble")
  parser.add_argument("--out_dir", default=RESULTS)
  parser.add_argument("--worker", nargs=2, metavar=("SCHEDULE", "OUT"))
  args = parser.parse_args(argv)
  if args.worker:
    args.schedule, out = args.worker
    return worker(args, out)
  os.makedirs(args.out_dir, exist_ok=True)
  tmp = os.path.join(args.out_dir, "_bubble_run.json")
  rows = []
  sizes = [int(x) for x in args.microbatches.split(",")]
  for p in (int(x) for x in args.procs.split(",")):
    for m in sizes:
      for schedule in args.schedules.split(","):
        rows.append(run(args, schedule, p, m, tmp))
        print(_table(rows[-1:]).splitlines()[-1], flush=True)
  result = {
    "date": time.strftime("%Y-%m-%d"),
    "costs_ms": {"F": args.forward_ms, "I": args.input_ms, "W": args.weight_ms},
    "rows": rows,
    "gains": gains(rows),
  }
  print(_table(rows))
  for g in result["gains"]:
    print(
      f"{g['schedule']} p={g['p']} m={g['microbatches']}: gain over 1f1b {g['measured_gain_ms']:.1f} "
      f"ms measured, {g['predicted_gain_ms']:.1f} predicted "
      f"({g['gain_ratio']:.2f} of it)"
    )
  with open(os.path.join(args.out_dir, f"{args.name}.json"), "w") as f:
    json.dump(result, f, indent=1)
  return 0


if __name__ == "__main__":
  sys.exit(main())
