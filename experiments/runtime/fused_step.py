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
  model, p, m, optimizer, fuse_step, warm, repeats, packed_state=True
) -> dict:
  """One pipeline's host breakdown per action (µs), its step time and
  program calls per step, and its params after the steps (to compare).
  ``packed_state=False``: its optimizer states stored as optax's trees
  (as before they were packed; experiments/runtime/packed_state.py)."""
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
    "host_step_ms": 1e3 * step_seconds,
    **host_breakdown(pipe, run, actions, repeats),
    "params": final,
  }


def main(argv):
  del argv
  loss_fn, params, batch, _ = _common.language_model(
    layers=FLAGS.layers, width=FLAGS.width, heads=1, length=4, batch=64
  )
  model = (loss_fn, params, batch)
  m = FLAGS.microbatches
  rows = []
  for p in map(int, FLAGS.stages):
    for optimizer in FLAGS.optimizers:
      rounds = {False: [], True: []}
      for _ in range(FLAGS.rounds):
        for fuse in (False, True):
          rounds[fuse].append(
            measure(model, p, m, optimizer, fuse, FLAGS.warm, FLAGS.repeats)
          )
      for a, b in zip(rounds[False], rounds[True], strict=True):
        same = jax.tree.map(np.array_equal, a.pop("params"), b.pop("params"))
        if not all(jax.tree.leaves(same)):
          raise AssertionError(
            f"p={p} {optimizer}: the fused steps trained to other bits"
          )
      row = {"stages": p, "microbatches": m, "optimizer": optimizer}
      for fuse, name in ((False, "apart"), (True, "fused")):
        row[name] = {
          k: [r[k] for r in rounds[fuse]]
          for k in rounds[fuse][0]
          if k != "actions"
        }
      row["actions"] = rounds[True][0]["actions"]
      rows.append(row)
      print(json.dumps(row), flush=True)
  platform = jax.devices()[0].platform
  record = {
    **_common.metadata(),
    "model": {"layers": FLAGS.layers, "width": FLAGS.width},
    "rows": rows,
  }
  _common.write_table(
    FLAGS.out_dir, f"fused_step_{platform}", _table(rows), record
  )


def _table(rows) -> str:
  """Markdown: per row, each quantity apart -> fused, every round."""

  def both(row, key, fmt="{:.1f}"):
    a = ", ".join(fmt.format(x) for x in row["apart"][key])
    b = ", ".join(fmt.format(x) for x in row["fused"][key])
    return f"{a} -> **{b}**"

  lines = [
    "| p | m | optimizer | actions | program calls / step | driver µs / "
    "action | dispatch µs / action | host µs / action | host ms / step |",
    "|---|---|---|---|---|---|---|---|---|",
  ]
  for r in rows:
    lines.append(
      f"| {r['stages']} | {r['microbatches']} | {r['optimizer']} | "
      f"{r['actions']} | {both(r, 'program_calls_per_step', '{:.0f}')} | "
      f"{both(r, 'driver_us_per_action')} | "
      f"{both(r, 'dispatch_us_per_action')} | "
      f"{both(r, 'host_us_per_action')} | {both(r, 'host_step_ms', '{:.2f}')} |"
    )
  return "\n".join(lines) + "\n"


if __name__ == "__main__":
  app.run(main)
