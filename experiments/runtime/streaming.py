r"""Bubble of synchronous and streaming schedules, from measured stage costs.

A 4-stage GPT-style pipeline is compiled, run, and one ``step`` profiled
(the same compiled programs as every other step) under ``seq``, so each
action is timed alone; each stage's median forward, backward and step
times are read off that measured timeline and fed to the event simulator (``jpipe.schedule.simulate``), which replays 50
``step`` calls of m microbatches each for every schedule: gpipe and 1f1b
flush at the end of every call, async and 2bw stream across calls and
flush once at the end. A stream's warm-up and drain are paid once, so its
bubble approaches (p - 1) / (50 m + p - 1) with equal stage costs (the
table's "equal stages" column runs every stage at the mean cost); with
the measured, unequal costs no schedule idles less than the imbalance
floor. A flushing schedule pays warm-up and drain every call. CPU devices
share two cores, so measured costs set the ratio of stage times, not a
GPU's speed.

Writes results/streaming.{md,json}.

Usage: python -m experiments.runtime.streaming [--calls 50]
"""

import json
import os

from jpipe.train.host_devices import default_cpu_device_count

default_cpu_device_count(8)

import jax  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from absl import app, flags  # noqa: E402

import jpipe  # noqa: E402
from experiments.runtime import stage_costs  # noqa: E402
from jpipe.models import gpt  # noqa: E402

OUT = os.path.join(os.path.dirname(__file__), "results")
FLAGS = flags.DEFINE_integer("calls", 50, "step calls per simulated run")
STAGES = 4
MICROBATCHES = (1, 4, 16)


def measured_stage_costs(num_stages=STAGES, num_microbatches=8):
  """Median forward, backward and step seconds per stage of a GPT
  pipeline, each action timed alone (``stage_costs.py``)."""
  model = gpt.Model(vocab_size=256, width=64, num_layers=6, num_heads=4)
  tokens = jax.random.randint(
    jax.random.key(0), (2 * num_microbatches, 33), 0, 256
  )
  params = model.init(jax.random.key(1), tokens[:1, :-1])

  def loss_fn(params, batch):
    logits = model.apply(params, batch[:, :-1])
    return optax.softmax_cross_entropy_with_integer_labels(
      logits, batch[:, 1:]
    ).mean()

  pipe = jpipe.Pipeline(
    loss_fn,
    params,
    tokens,
    num_stages=num_stages,
    devices=jax.devices()[:num_stages],
    schedule="seq",
    num_microbatches=num_microbatches,
    optimizer=optax.adamw(1e-3),
    recompute=True,
    fuse_last_stage=False,
  )
  state = pipe.init(params)
  return stage_costs.isolated_stage_costs(pipe, state, [tokens] * 6)


def equalised(costs):
  """Every stage at the mean stage cost: the schedule's own bubble,
  without the partition's imbalance."""
  return {k: [float(np.mean(v))] * len(v) for k, v in costs.items()}


def imbalance_floor(costs):
  """The bubble no schedule removes: idle time of stages faster than the
  slowest, ``1 - mean / max`` of per-microbatch stage time (forward +
  backward + a step per microbatch)."""
  per = np.add(np.add(costs["F"], costs["B"]), costs["S"])
  return float(1.0 - per.mean() / per.max())


def simulated(name, m, calls, costs):
  """The simulated timeline of ``calls`` calls of m microbatches (2bw:
  minibatches of ``STAGES`` microbatches, whatever the call size)."""
  step_every = STAGES if name == "2bw" else 1
  return stage_costs.simulate_calls(name, STAGES, m, calls, costs, step_every)


def main(argv):
  del argv
  calls = FLAGS.value
  costs = measured_stage_costs()
  print(
    "measured per-stage ms: forward "
    + ", ".join(f"{1e3 * x:.2f}" for x in costs["F"])
    + "; backward "
    + ", ".join(f"{1e3 * x:.2f}" for x in costs["B"])
    + "; step "
    + ", ".join(f"{1e3 * x:.2f}" for x in costs["S"])
  )
  rows, records = [], []
  floor = imbalance_floor(costs)
  for m in MICROBATCHES:
    ideal = (STAGES - 1) / (calls * m + STAGES - 1)
    for name in ("gpipe", "1f1b", "async", "2bw"):
      timeline = simulated(name, m, calls, costs)
      even = simulated(name, m, calls, equalised(costs))
      records.append(
        {
          "schedule": name,
          "microbatches_per_call": m,
          "calls": calls,
          "bubble": timeline.bubble,
          "makespan_seconds": timeline.makespan,
          "imbalance_floor": floor,
          "bubble_equal_stages": even.bubble,
          "stream_bound": ideal,
        }
      )
      rows.append(
        f"| {m} | {name} | {100 * timeline.bubble:.1f}% | "
        f"{1e3 * timeline.makespan:.1f} | {100 * even.bubble:.2f}% | "
        f"{100 * ideal:.2f}% |"
      )
  table = (
    f"{calls} calls of m microbatches on {STAGES} stages; per-stage costs "
    f"measured (ms) forward {[round(1e3 * x, 2) for x in costs['F']]}, "
    f"backward {[round(1e3 * x, 2) for x in costs['B']]}, step "
    f"{[round(1e3 * x, 2) for x in costs['S']]}; the stages' imbalance "
    f"alone idles {100 * floor:.1f}% (1 - mean/max stage time)\n\n"
    "| m | schedule | bubble (measured costs) | makespan ms | bubble "
    "(equal stages) | (p-1)/(calls m + p-1) |\n"
    "|---|---|---|---|---|---|\n" + "\n".join(rows)
  )
  print(table)
  os.makedirs(OUT, exist_ok=True)
  with open(os.path.join(OUT, "streaming.md"), "w") as f:
    f.write(table + "\n")
  with open(os.path.join(OUT, "streaming.json"), "w") as f:
    json.dump({"stage_costs": costs, "rows": records}, f, separators=(",", ":"))


if __name__ == "__main__":
  app.run(main)
