r"""A stream's step in its backward's program: what it saves the host.

``Partitioning.fuse_step`` runs an asynchronous stage's optimizer step in
the program of the backward right before it (with ``step_every = 1``,
every microbatch's), so each microbatch of a stage costs two program
calls (the last stage's one) instead of three (two). This measures, on a
tiny GPT (compute ~ 0) with every stage on one device, the host's time
per action with the steps apart and inside, paired (alternating rounds
in one process), split as ``experiments.runtime.host_cost`` splits it:
jpipe's Python, JAX's dispatch, the programs' run. Both settings train to
the same bits on a CPU (checked here every round, and by
tests/runtime/test_fused_step.py).

The GPT ties its embedding: the stage owning it (the first) adds its
holder's gradient of it in its own fused program (in these orders the
holder's step, which hands it on, comes before the owner's backward),
so all p stages fuse.

Writes results/fused_step_<platform>.{md,json}.

Usage: python -m experiments.runtime.fused_step [--stages 8]
  [--microbatches 32] [--rounds 2]
"""

import json
import os

import jax
import numpy as np
import optax
from absl import app, flags

from experiments.gpu_campaign import _common
from experiments.gpu_campaign.overhead import one_device_pipeline, timed_runner
from experiments.runtime.host_cost import host_breakdown
from jpipe.runtime.build.stored_params import StoredParams

FLAGS = flags.FLAGS
flags.DEFINE_list("stages", ["8"], "Pipeline stages (all on one device).")
flags.DEFINE_integer("microbatches", 32, "Microbatches per step.")
flags.DEFINE_integer("layers", 8, "GPT layers.")
flags.DEFINE_integer("width", 8, "GPT width.")
flags.DEFINE_integer("rounds", 2, "Alternating rounds (off, on) per row.")
flags.DEFINE_integer("warm", 8, "Untimed steps before measuring.")
flags.DEFINE_integer("repeats", 10, "Timed steps per measurement.")
flags.DEFINE_list("optimizers", ["sgd", "adam"], "Optimizers to measure.")
flags.DEFINE_string(
  "out_dir",
  os.path.join(os.path.dirname(__file__), "results"),
  "Output folder.",
)

OPTIMIZERS = {"sgd": lambda: optax.sgd(1e-3), "adam": lambda: optax.adam(1e-3)}


def measure(
  model,
  p,
  m,
  optimizer,
  *,
  warm,
  repeats,
  fuse_step=True,
  packed_state=True,
  packed_params=True,
) -> dict:
  """One pipeline's host breakdown per action (µs), its step time and
  program calls per step, and its params after the steps (to compare).
  ``packed_state=False``: its optimizer states stored as optax's trees
  (as before they were packed; experiments/runtime/packed_state.py);
  ``packed_params=False``: the driver holds every param leaf in its own
  buffer (as before they were packed; experiments/runtime/
  packed_params.py)."""
  loss_fn, params, batch = model
  pipe = one_device_pipeline(
    loss_fn,
    params,
    batch,
    p=p,
    schedule="async",
    m=m,
    tx=OPTIMIZERS[optimizer](),
    recompute=False,
    fuse_step=fuse_step,
  )
  if not packed_state:  # (Read by ``init``'s first trace, below.)
    for opt in pipe.stage_optimizers:
      opt.state_own_bytes = None
  if not packed_params:
    avals = pipe.traced.closed_jaxpr.in_avals
    pipe.driver.param_storage = tuple(
      StoredParams([avals[i] for i in spec.param_leaves], 0)
      for spec in pipe.stages.specs
    )
  run = timed_runner(pipe, params, batch)
  for _ in range(warm):
    run()
  final = jax.device_get(run.state["s"].stage_params)
  actions = run.actions()
  start = len(run.host_seconds)
  for _ in range(repeats):
    run()
  step_seconds = float(np.median(run.host_seconds[start:]))
  return {
    "actions": actions,
    # Arrays the optimizer states are stored in, over all stages.
    "state_arrays": len(jax.tree.leaves(run.state["s"].opt_states)),
    # Arrays a version of the params is held in, over all stages.
    "param_arrays": sum(
      len(st.buffer_bytes) for st in pipe.driver.param_storage
    ),
    "host_step_ms": 1e3 * step_seconds,
    **host_breakdown(pipe, run, actions, repeats),
    "params": final,
  }


def paired(name, settings, compare, count):
  """Runs every (stages, optimizer) of the flags with the two
  ``settings`` (``((label, measure's keywords), (label, keywords))``) in
  alternating rounds, then ``compare(row, first_params, second_params)``
  per round (raises, or notes the difference in ``row``); writes
  results/<name>_<platform>.{md,json}, whose table shows ``count`` (a
  key of ``measure``'s: a per-step count) beside the host's times."""
  loss_fn, params, batch, _ = _common.language_model(
    layers=FLAGS.layers, width=FLAGS.width, heads=1, length=4, batch=64
  )
  model = (loss_fn, params, batch)
  m = FLAGS.microbatches
  rows = []
  for p in map(int, FLAGS.stages):
    for optimizer in FLAGS.optimizers:
      rounds = {label: [] for label, _ in settings}
      for _ in range(FLAGS.rounds):
        for label, kwargs in settings:
          rounds[label].append(
            measure(
              model,
              p,
              m,
              optimizer,
              warm=FLAGS.warm,
              repeats=FLAGS.repeats,
              **kwargs,
            )
          )
      row = {"stages": p, "microbatches": m, "optimizer": optimizer}
      (first, _), (second, _) = settings
      for a, b in zip(rounds[first], rounds[second], strict=True):
        compare(row, a.pop("params"), b.pop("params"))
      for label, runs in rounds.items():
        row[label] = {
          k: [r[k] for r in runs] for k in runs[0] if k != "actions"
        }
      row["actions"] = rounds[second][0]["actions"]
      rows.append(row)
      print(json.dumps(row), flush=True)
  platform = jax.devices()[0].platform
  record = {
    **_common.metadata(),
    "model": {"layers": FLAGS.layers, "width": FLAGS.width},
    "rows": rows,
  }
  table = _table(rows, first, second, count)
  _common.write_table(FLAGS.out_dir, f"{name}_{platform}", table, record)


def main(argv):
  del argv

  def same_bits(row, a, b):
    if not all(jax.tree.leaves(jax.tree.map(np.array_equal, a, b))):
      raise AssertionError(
        f"p={row['stages']} {row['optimizer']}: the fused steps trained to "
        "other bits"
      )

  settings = (("apart", {"fuse_step": False}), ("fused", {"fuse_step": True}))
  paired("fused_step", settings, same_bits, "program_calls_per_step")


def _table(rows, first, second, count) -> str:
  """Markdown: per row, each quantity first -> second, every round."""

  def both(row, key, fmt="{:.1f}"):
    a = ", ".join(fmt.format(x) for x in row[first][key])
    b = ", ".join(fmt.format(x) for x in row[second][key])
    return f"{a} -> **{b}**"

  title = count.replace("_per_step", " / step").replace("_", " ")
  lines = [
    f"| p | m | optimizer | actions | {title} | driver µs / "
    "action | dispatch µs / action | host µs / action | host ms / step |",
    "|---|---|---|---|---|---|---|---|---|",
  ]
  for r in rows:
    lines.append(
      f"| {r['stages']} | {r['microbatches']} | {r['optimizer']} | "
      f"{r['actions']} | {both(r, count, '{:.0f}')} | "
      f"{both(r, 'driver_us_per_action')} | "
      f"{both(r, 'dispatch_us_per_action')} | "
      f"{both(r, 'host_us_per_action')} | {both(r, 'host_step_ms', '{:.2f}')} |"
    )
  return "\n".join(lines) + "\n"


if __name__ == "__main__":
  app.run(main)
