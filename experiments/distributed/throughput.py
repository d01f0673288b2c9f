"""Real parallel speed across processes: 2 processes with one core each
running a 2-stage pipeline, against 1 process on one core.

Each process is pinned to its own core (``sched_setaffinity``, every
thread, once JAX has started: ``_pin``) and XLA's
CPU backend runs single-threaded, so the two stages really run in
parallel and a one-process run really has one core: the limit is 2x,
less what two busy cores cost each other (shared caches and memory
bandwidth), measured as the whole model's step in 2 processes side by
side against one alone (``--whole_side_by_side``, the slower of the
two: 0.95-0.97x on the development machine, so ~1.9x at most).
Two one-core references:

- the whole model: the plain single-device training step (``jax.jit`` of
  ``value_and_grad`` and the optax update) on the whole mini-batch;
- the same schedule: the same 2-stage pipeline in one process whose two
  CPU devices share the core -- this separates the processes' parallel
  speed-up from what microbatching itself costs on a CPU.

Stages keep residuals (no recomputation), so their work is the whole
model's forward and backward. The split is the partitioner's with node
costs timed on this machine (``cost_model="measured"``; the FLOP count
gives the same 4 | 4 + head here); every run uses the baseline's plan.
Each run times ``--steps`` steps after 3 warm-up steps, blocking only at
the end, as a loop that does not read every loss. This VM's speed drifts
(~15 % run to run), so every 2-process run is paired with a one-core run
of the whole model right before it: a row's speed-up is the median of
``--repeats`` such ratios (its rate, the median rate). The whole model's
step donates its params and optimizer state, as a user would write it.
The stage imbalance is each stage's forward + backward time measured
alone (``seq`` schedule, one core). A row's fixed cost per microbatch,
in microseconds, is what a step takes beyond the 2x limit, per
microbatch: (step time - the paired whole model's step time / 2) / m,
median over the pairs -- transfers, dispatch, stage imbalance and (for
gpipe / 1f1b) the bubble; unlike the ratio, it compares across machines
of different speed. Each row also keeps, per process, a ``jax.profiler``
breakdown of 2 more steps of its last run (host time per kind of driver
op -- forwards, backwards, steps, sends, receives -- dispatch against
Python; ``experiments.runtime.trace_breakdown``), and of 2 more
profiled steps (``Pipeline.step(profile=True)``) where each process's
device time goes: busy, waiting for a value from the other process (and
those transfers' latency), otherwise idle
(``experiments.distributed.device_waits``), printed after the table.

  python -m experiments.distributed.throughput [--steps 20] [--layers 8]
      [--width 1024] [--batch 1024] [--schedules async] [--microbatches 4]
      [--out_dir DIR]

Prints a table; writes ``experiments/distributed/results/throughput.json``.
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

import numpy as np

from experiments.distributed import device_waits

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(__file__)))
RESULTS = os.path.join(os.path.dirname(__file__), "results")
SCHEDULES = ("gpipe", "1f1b", "async")
MICROBATCHES = (4, 16)
# Microbatches of 1024 / 4 = 256 rows run as fast per example on one core
# as the whole batch; 64-row ones (16 microbatches) ~1.6x slower per
# example (XLA's CPU matmuls; measured): the "same schedule" column.
BATCH, WIDTH, LAYERS = 1024, 1024, 8  # Defaults of --batch, --width, --layers.
# async: a stage's optimizer step after every STEP_EVERY backwards
# (--step_every; 1: after each, PipeDream's).
STEP_EVERY = 1
# async: each step in the program of the backward before it
# (``Partitioning.fuse_step``; --fuse_step 0: apart, as before it).
FUSE_STEP = True
# Steps profiled per action (Pipeline.step(profile=True)) after the timed
# ones, for where each device's time goes (device_waits).
PROFILED_STEPS = 2
ONE_THREAD = "--xla_cpu_multi_thread_eigen=false intra_op_parallelism_threads=1"


def _pin(core):
  """Every thread of this process on one core, once JAX has started.

  Pinning before JAX starts sizes the CPU client's worker pool to one
  thread: a transfer server's work then queues behind the computation
  running on it, so a value already computed reaches the other process
  only when the sender's next action ends (measured: 1.44 s per step
  instead of 1.03 for a 16-layer stage pair). Pinned afterwards, the
  pool keeps its threads and they share the one core, as host threads
  share a GPU's host core in a real deployment.
  """
  import jax

  jax.devices()  # The client and its thread pools exist from here on.
  cores = sorted(os.sched_getaffinity(0))
  for tid in os.listdir("/proc/self/task"):
    os.sched_setaffinity(int(tid), {cores[core % len(cores)]})


def _model():
  import flax.linen as nn
  import jax
  import optax

  class Mlp(nn.Module):
    @nn.compact
    def __call__(self, x):
      for i in range(LAYERS):
        x = nn.relu(nn.Dense(WIDTH, name=f"dense_{i}")(x))
      return nn.Dense(10, name="head")(x)

  model = Mlp()
  k1, k2, k3 = jax.random.split(jax.random.key(0), 3)
  batch = {
    "x": jax.random.normal(k1, (BATCH, WIDTH)),
    "y": jax.random.randint(k2, (BATCH,), 0, 10),
  }
  params = model.init(k3, batch["x"][:1])

  def loss_fn(params, batch):
    logits = model.apply(params, batch["x"])
    return optax.softmax_cross_entropy_with_integer_labels(
      logits, batch["y"]
    ).mean()

  return loss_fn, params, batch


def _pipeline(loss_fn, params, batch, schedule, m, plan=None, **kwargs):
  import optax

  import jpipe

  options = {"weight_stashing": True} if schedule == "async" else {}
  if schedule == "async" and STEP_EVERY > 1:
    options["step_every"] = STEP_EVERY
  options["fuse_step"] = FUSE_STEP
  if plan is not None:
    options["partition"] = jpipe.partition.Plan.from_json(plan)
  return jpipe.Pipeline(
    loss_fn,
    params,
    batch,
    num_stages=2,
    schedule=schedule,
    num_microbatches=m,
    optimizer=optax.sgd(1e-3),
    recompute=False,
    cost_model="measured",
    **options,
    **kwargs,
  )


def _time_pipeline(pipe, params, batch, steps, barrier=None, trace_dir=None):
  """Seconds for ``steps`` steps after 3 warm-up steps; with ``trace_dir``,
  ``(seconds, breakdown, actions, transfers)``: 2 more steps traced with
  ``jax.profiler`` and parsed (``experiments.runtime.trace_breakdown``:
  this process's host time per kind of op, its sends and receives
  included), then ``PROFILED_STEPS`` more profiled
  (``Pipeline.step(profile=True)``): this process's actions on the
  host's clock (``device_waits.records``); and the timed steps'
  ``TransferTimes`` events (pull transport; else empty)."""
  import jax

  state = pipe.init(params)
  for _ in range(3):
    state, metrics = pipe.step(state, batch)
  jax.block_until_ready((state.stage_params, metrics["loss"]))
  times = pipe.transport.time_transfers() if trace_dir else None
  if barrier:
    barrier("start")
  t0 = time.perf_counter()
  for _ in range(steps):
    state, metrics = pipe.step(state, batch)
  jax.block_until_ready((state.stage_params, metrics["loss"]))
  seconds = time.perf_counter() - t0
  if barrier:
    barrier("end")
  if trace_dir is None:
    return seconds
  transfers = times.close() if times else []  # (The timed steps' only.)
  from experiments.runtime import trace_breakdown

  def run():
    nonlocal state
    state, metrics = pipe.step(state, batch)
    jax.block_until_ready((state.stage_params, metrics["loss"]))

  path = trace_breakdown.capture(run, 2, trace_dir)
  if barrier:
    barrier("traced")
  actions = []
  for _ in range(PROFILED_STEPS):
    state, metrics = pipe.step(state, batch, profile=True)
    actions += device_waits.records(metrics["timeline"])
  jax.block_until_ready((state.stage_params, metrics["loss"]))
  if barrier:
    barrier("profiled")
  return seconds, trace_breakdown.breakdown(path), actions, transfers


def worker(schedule, m, steps, out, plan):
  """One process of a 2-process pipeline run (under jpipe.launch)."""
  from jpipe import distributed

  distributed.initialize()
  _pin(int(os.environ["JAX_PROCESS_ID"]))
  import jax

  loss_fn, params, batch = _model()
  pipe = _pipeline(loss_fn, params, batch, schedule, m, plan)
  with tempfile.TemporaryDirectory() as trace_dir:
    seconds, breakdown, actions, transfers = _time_pipeline(
      pipe,
      params,
      batch,
      steps,
      distributed.barrier,
      trace_dir=trace_dir,
    )
  # Each process's breakdown beside the result, process 0's result last
  # (the parent reads it once every process has written its own).
  with open(f"{out}.process{jax.process_index()}", "w") as f:
    json.dump(
      {"host": breakdown, "actions": actions, "transfers": transfers}, f
    )
  distributed.barrier("breakdowns written")
  if jax.process_index() == 0:
    with open(out, "w") as f:
      json.dump({"seconds": seconds, "steps": steps}, f)


def _time_whole(loss_fn, params, batch, steps, barrier=None):
  """Seconds for ``steps`` steps of the whole model's jitted training step
  (after 3 warm-up steps), params and optimizer state donated as a user
  would write it; ``barrier``: called before and after the timed steps."""
  import functools

  import jax
  import optax

  tx = optax.sgd(1e-3)

  @functools.partial(jax.jit, donate_argnums=(0, 1))
  def train_step(params, opt_state, batch):
    loss, grads = jax.value_and_grad(loss_fn)(params, batch)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss

  trained = jax.tree.map(jax.numpy.copy, params)
  opt_state = tx.init(trained)
  for _ in range(3):
    trained, opt_state, loss = train_step(trained, opt_state, batch)
  jax.block_until_ready(trained)
  if barrier:
    barrier("start")
  t0 = time.perf_counter()
  for _ in range(steps):
    trained, opt_state, loss = train_step(trained, opt_state, batch)
  jax.block_until_ready((trained, loss))
  seconds = time.perf_counter() - t0
  if barrier:
    barrier("end")
  return seconds


def whole_side_by_side(steps, out):
  """One of 2 processes (under jpipe.launch), each on its own core,
  timing the whole model's step at the same time: what running on both
  cores at once costs each (shared caches and memory bandwidth), the
  2-process pipeline's true limit being 2 / that."""
  from jpipe import distributed

  distributed.initialize()
  _pin(int(os.environ["JAX_PROCESS_ID"]))
  import jax

  loss_fn, params, batch = _model()
  seconds = _time_whole(loss_fn, params, batch, steps, distributed.barrier)
  with open(f"{out}.process{jax.process_index()}", "w") as f:
    json.dump(seconds, f)
  distributed.barrier("written")
  if jax.process_index() == 0:
    both = []
    for p in range(2):
      with open(f"{out}.process{p}") as f:
        both.append(json.load(f))
      os.remove(f"{out}.process{p}")
    with open(out, "w") as f:
      json.dump({"seconds": max(both), "steps": steps}, f)


def whole(steps, out):
  """One process on one core: only the whole model's step (the reference
  timed next to every 2-process run: this VM's speed drifts)."""
  from jpipe import distributed

  distributed.initialize()
  _pin(0)
  loss_fn, params, batch = _model()
  seconds = _time_whole(loss_fn, params, batch, steps)
  with open(out, "w") as f:
    json.dump({"seconds": seconds, "steps": steps}, f)


def baseline(steps, out):
  """One process on one core: the whole model's training step, the same
  pipelines, and each stage's cost alone (for the imbalance)."""
  from jpipe import distributed

  distributed.initialize()  # one process: its JPIPE_CPU_DEVICES devices
  _pin(0)
  from experiments.runtime.stage_costs import isolated_stage_costs

  loss_fn, params, batch = _model()
  seconds = _time_whole(loss_fn, params, batch, steps)
  pipe = _pipeline(loss_fn, params, batch, "seq", 4, fuse_last_stage=False)
  plan = pipe.plan.to_json()  # every run uses this one split
  costs = isolated_stage_costs(pipe, pipe.init(params), [batch] * 5)
  stage = [f + b for f, b in zip(costs["F"], costs["B"], strict=True)]
  same = {
    f"{schedule}/{m}": _time_pipeline(
      _pipeline(loss_fn, params, batch, schedule, m, plan),
      params,
      batch,
      steps,
    )
    for schedule in SCHEDULES
    for m in MICROBATCHES
  }
  with open(out, "w") as f:
    json.dump(
      {
        "seconds": seconds,
        "steps": steps,
        "stage_seconds": stage,
        "same_schedule_seconds": same,
        "plan": plan,
      },
      f,
    )


def one_core_env(devices):
  """The environment of a worker process: JAX on ``devices`` CPU devices
  run by one XLA thread, no proxies, this repository importable."""
  env = {
    k: v
    for k, v in os.environ.items()
    if k.lower() not in ("http_proxy", "https_proxy", "all_proxy")
  }
  env["XLA_FLAGS"] = ONE_THREAD
  env["JAX_PLATFORMS"] = "cpu"
  env["JPIPE_CPU_DEVICES"] = str(devices)
  env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
  return env


def _run(command, env):
  done = subprocess.run(command, env=env, capture_output=True, text=True)
  if done.returncode:
    raise SystemExit(done.stdout[-3000:] + done.stderr[-3000:])


def _examples_per_second(command, out):
  """Runs ``command`` (a ``--whole`` or ``--worker`` run writing ``out``)
  with one device per process: its examples per second."""
  _run(command, one_core_env(1))
  with open(out) as f:
    got = json.load(f)
  return BATCH * got["steps"] / got["seconds"]


def _stage_nodes(plan_json):
  plan = json.loads(plan_json)
  nodes = [[] for _ in plan["stage_devices"]]
  for name, s in zip(plan["node_names"], plan["stage_of_node"], strict=True):
    nodes[s].append(name)
  return nodes


def _table(result):
  lines = [
    f"{result['model']}; whole model, 1 process, 1 core: "
    f"{result['one_core_examples_per_second']:.0f} examples/s",
    "stage F+B alone: "
    + ", ".join(f"{s * 1e3:.1f} ms" for s in result["stage_seconds_alone"])
    + f" (imbalance max/mean {result['stage_imbalance_max_over_mean']:.2f});"
    + " stages: "
    + " | ".join(" ".join(ns) for ns in result["stage_nodes"]),
    f"both cores busy at once (the whole model in each of 2 processes): "
    f"each runs at {result['side_by_side_over_alone']:.3f}x its speed "
    f"alone, so 2 processes reach at most "
    f"{2 * result['side_by_side_over_alone']:.2f}x",
    f"{'schedule':9} {'micro':>5} {'2 procs ex/s':>12} {'vs whole':>9} "
    f"{'fixed us/mb':>11} {'same sched 1 core':>17} {'vs it':>6}",
  ]
  for r in result["rows"]:
    lines.append(
      f"{r['schedule']:9} {r['microbatches']:>5} "
      f"{r['examples_per_second']:>12.0f} {r['speedup']:>8.2f}x "
      f"{r['fixed_us_per_microbatch']:>11.0f} "
      f"{r['same_schedule_examples_per_second']:>17.0f} "
      f"{r['speedup_over_same_schedule']:>5.2f}x  (paired: "
      + ", ".join(f"{x:.2f}" for x in r["speedup_runs"])
      + ")"
    )
  return "\n".join(lines)


def _transfer_summary(events) -> dict:
  """Per direction between the two processes, the timed steps' transfers
  (``device_waits.transfer_latencies`` of each process's
  ``TransferTimes`` events): count, median "asked early" and "transfer",
  and the transfer's 90th percentile, in milliseconds."""
  out = {}
  for src, dst in ((0, 1), (1, 0)):
    rows = device_waits.transfer_latencies(events[src], events[dst])
    if not rows:
      continue
    transfer = [1e3 * r["transfer"] for r in rows]
    out[f"{src}->{dst}"] = {
      "count": len(rows),
      "asked_early": float(np.median([1e3 * r["early"] for r in rows])),
      "transfer": float(np.median(transfer)),
      "transfer_p90": float(np.percentile(transfer, 90)),
    }
  return out


def _set_size(args):
  """The model and the rows from the flags (every process parses them)."""
  global LAYERS, WIDTH, BATCH, SCHEDULES, MICROBATCHES, STEP_EVERY
  global FUSE_STEP
  LAYERS, WIDTH, BATCH = args.layers, args.width, args.batch
  STEP_EVERY, FUSE_STEP = args.step_every, bool(args.fuse_step)
  SCHEDULES = tuple(args.schedules.split(","))
  MICROBATCHES = tuple(int(m) for m in args.microbatches.split(","))


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--steps", type=int, default=20)
  parser.add_argument(
    "--repeats",
    type=int,
    default=3,
    help="2-process runs per row; the median is reported (this VM's "
    "timings vary by ~15%% run to run)",
  )
  parser.add_argument(
    "--worker", nargs=4, metavar=("SCHEDULE", "M", "OUT", "PLAN_JSON")
  )
  parser.add_argument("--baseline", metavar="OUT")
  parser.add_argument("--whole", metavar="OUT")
  parser.add_argument("--whole_side_by_side", metavar="OUT")
  parser.add_argument(
    "--name", default="throughput", help="OUT_DIR/NAME.json is written"
  )
  parser.add_argument(
    "--out_dir", default=RESULTS, help="the folder results are written to"
  )
  parser.add_argument("--layers", type=int, default=LAYERS)
  parser.add_argument("--step_every", type=int, default=STEP_EVERY)
  parser.add_argument(
    "--fuse_step",
    type=int,
    choices=(0, 1),
    default=int(FUSE_STEP),
    help="async: 1 runs each step in its backward's program, 0 apart",
  )
  parser.add_argument("--width", type=int, default=WIDTH)
  parser.add_argument("--batch", type=int, default=BATCH)
  parser.add_argument(
    "--schedules", default=",".join(SCHEDULES), help="comma-separated"
  )
  parser.add_argument(
    "--microbatches",
    default=",".join(map(str, MICROBATCHES)),
    help="comma-separated",
  )
  args = parser.parse_args()
  _set_size(args)
  if args.worker:
    schedule, m, out, plan = args.worker
    with open(plan) as f:
      return worker(schedule, int(m), args.steps, out, f.read())
  if args.baseline:
    return baseline(args.steps, args.baseline)
  if args.whole:
    return whole(args.steps, args.whole)
  if args.whole_side_by_side:
    return whole_side_by_side(args.steps, args.whole_side_by_side)
  os.makedirs(args.out_dir, exist_ok=True)
  me = [sys.executable, "-m", "experiments.distributed.throughput"]
  me += [f"--layers={LAYERS}", f"--width={WIDTH}", f"--batch={BATCH}"]
  me += [f"--step_every={STEP_EVERY}", f"--fuse_step={int(FUSE_STEP)}"]
  me += [f"--schedules={args.schedules}", f"--microbatches={args.microbatches}"]
  steps = ["--steps", str(args.steps)]
  tmp = os.path.join(args.out_dir, "_run.json")
  _run([*me, *steps, "--baseline", tmp], one_core_env(2))
  with open(tmp) as f:
    base = json.load(f)
  plan_path = os.path.join(args.out_dir, f"{args.name}_plan.json")
  with open(plan_path, "w") as f:
    f.write(base["plan"])
  one = BATCH * base["steps"] / base["seconds"]
  stage = base["stage_seconds"]
  # Both cores busy at once: each whole-model process's rate against one
  # alone right before (paired, like every row).
  launch = [sys.executable, "-m", "jpipe.launch", "--nprocs", "2", "--"]
  alone = _examples_per_second([*me, *steps, "--whole", tmp], tmp)
  beside = _examples_per_second(
    [*launch, *me, *steps, "--whole_side_by_side", tmp], tmp
  )
  rows = []
  for schedule in SCHEDULES:
    for m in MICROBATCHES:
      rates, wholes = [], []
      for _ in range(args.repeats):
        # The reference right before the run it is compared with.
        wholes.append(_examples_per_second([*me, *steps, "--whole", tmp], tmp))
        worker_args = ["--worker", schedule, str(m), tmp, plan_path]
        rates.append(
          _examples_per_second([*launch, *me, *steps, *worker_args], tmp)
        )
        # The last run's, per process.
        breakdowns, actions, transfers = [], [], []
        for p in range(2):
          with open(f"{tmp}.process{p}") as f:
            got = json.load(f)
          breakdowns.append(got["host"])
          actions.append(got["actions"])
          transfers.append(got["transfers"])
          os.remove(f"{tmp}.process{p}")
      rate = float(np.median(rates))
      ratios = [r / w for r, w in zip(rates, wholes, strict=True)]
      fixed = [
        1e6 * (BATCH / r - BATCH / (2 * w)) / m
        for r, w in zip(rates, wholes, strict=True)
      ]
      same = (
        BATCH * base["steps"] / base["same_schedule_seconds"][f"{schedule}/{m}"]
      )
      rows.append(
        {
          "schedule": schedule,
          "microbatches": m,
          "examples_per_second": rate,
          "examples_per_second_runs": rates,
          "whole_model_examples_per_second_runs": wholes,
          "speedup_runs": ratios,
          "speedup": float(np.median(ratios)),
          "fixed_us_per_microbatch": float(np.median(fixed)),
          "same_schedule_examples_per_second": same,
          "speedup_over_same_schedule": rate / same,
          "breakdown_per_process": breakdowns,
          "device_waits_per_process": device_waits.device_waits(
            actions, PROFILED_STEPS
          ),
          "transfers_ms": _transfer_summary(transfers),
        }
      )
  os.remove(tmp)
  # Every timing of the whole model: the baseline's and the paired ones.
  everyone = [one] + [
    w for r in rows for w in r["whole_model_examples_per_second_runs"]
  ]
  one = float(np.median(everyone))
  result = {
    "model": f"MLP {LAYERS} x {WIDTH}, batch {BATCH}"
    + (f", async step_every {STEP_EVERY}" if STEP_EVERY > 1 else ""),
    "fuse_step": FUSE_STEP,
    "one_core_examples_per_second": one,
    "stage_seconds_alone": stage,
    "stage_imbalance_max_over_mean": max(stage) / (sum(stage) / len(stage)),
    "stage_nodes": _stage_nodes(base["plan"]),
    "side_by_side_over_alone": beside / alone,
    "rows": rows,
  }
  print(_table(result))
  from experiments.runtime import trace_breakdown

  for r in rows:
    print(f"\nhost time per op, {r['schedule']} / {r['microbatches']}:")
    print(
      trace_breakdown.table(
        {f"process {p}": b for p, b in enumerate(r["breakdown_per_process"])}
      )
    )
    print(
      f"device time per step, {r['schedule']} / {r['microbatches']} "
      f"({PROFILED_STEPS} profiled steps):"
    )
    print(device_waits.table(r["device_waits_per_process"]))
    print(
      "transfers of the timed steps (ms, median; asked early: how long "
      "before the value existed the receiver asked for it):"
    )
    for direction, t in r["transfers_ms"].items():
      print(
        f"  {direction}: {t['count']} transfers, asked early "
        f"{t['asked_early']:.1f}, transfer {t['transfer']:.2f} "
        f"(90th percentile {t['transfer_p90']:.2f})"
      )
  with open(os.path.join(args.out_dir, f"{args.name}.json"), "w") as f:
    json.dump(result, f, separators=(",", ":"))


if __name__ == "__main__":
  main()
