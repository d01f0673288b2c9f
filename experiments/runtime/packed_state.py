r"""A stage's optimizer state stored packed: what it saves the host.

Every array a jitted program takes or returns costs the host
microseconds per call (more for an output than an input: ~1.5 µs per
input, ~4-6 per output on the 2-core CPU of experiments/RESULTS.md). An
asynchronous stage steps after every microbatch, in its backward's
program (``fuse_step``), which so takes and returns the whole optimizer
state: for Adam twice the stage's leaves and a count. Stored packed
(``jpipe.runtime``'s ``PackedTree``: leaves below the pipeline's
``own_buffer_bytes`` in one flat buffer per dtype) a tiny GPT layer's
Adam state is 2 arrays instead of 33.

This measures, on a tiny GPT (compute ~ 0) with every stage on one
device, async with stashing, the host's time per action with the states
stored as optax's trees (before) and packed, paired (alternating rounds
in one process), split as ``experiments.runtime.host_cost`` splits it.
The two run the same per-leaf math, but not to the bit: where leaves
share a buffer XLA fuses the update differently (floating-point
contraction), a step's moments differ by a few ulp
(tests/runtime/test_stage_optimizer.py bounds it), and Adam amplifies
that where a gradient is near zero (its update ~ lr x sign): after one
async step of 32 microbatches the tiny GPT's params differ by up to
~2.6 x lr in f32 and ~2e-11 in f64 (ad hoc). The largest difference of
the params after the warm steps is written per row. With
``own_buffer_bytes=0`` nothing shares a buffer and the bits are the tree's.

Writes results/packed_state_<platform>.{md,json}.

Usage: python -m experiments.runtime.packed_state [--stages 8]
  [--microbatches 32] [--rounds 2] [--optimizers adam,sgd]
"""

import json

import jax
import numpy as np
from absl import app

from experiments.gpu_campaign import _common
from experiments.runtime.fused_step import FLAGS, measure


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
        for packed in (False, True):
          rounds[packed].append(
            measure(
              model,
              p,
              m,
              optimizer,
              True,
              FLAGS.warm,
              FLAGS.repeats,
              packed_state=packed,
            )
          )
      apart = 0.0
      for a, b in zip(rounds[False], rounds[True], strict=True):
        a, b = a.pop("params"), b.pop("params")
        for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
          apart = max(apart, float(np.max(np.abs(x - y), initial=0.0)))
      row = {"stages": p, "microbatches": m, "optimizer": optimizer}
      row["params_max_abs_difference"] = apart
      for packed, name in ((False, "tree"), (True, "packed")):
        row[name] = {
          k: [r[k] for r in rounds[packed]]
          for k in rounds[packed][0]
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
    FLAGS.out_dir, f"packed_state_{platform}", _table(rows), record
  )


def _table(rows) -> str:
  """Markdown: per row, each quantity tree -> packed, every round."""

  def both(row, key, fmt="{:.1f}"):
    a = ", ".join(fmt.format(x) for x in row["tree"][key])
    b = ", ".join(fmt.format(x) for x in row["packed"][key])
    return f"{a} -> **{b}**"

  lines = [
    "| p | m | optimizer | actions | state arrays | driver µs / action | "
    "dispatch µs / action | host µs / action | host ms / step |",
    "|---|---|---|---|---|---|---|---|---|",
  ]
  for r in rows:
    lines.append(
      f"| {r['stages']} | {r['microbatches']} | {r['optimizer']} | "
      f"{r['actions']} | {both(r, 'state_arrays', '{:.0f}')} | "
      f"{both(r, 'driver_us_per_action')} | "
      f"{both(r, 'dispatch_us_per_action')} | "
      f"{both(r, 'host_us_per_action')} | {both(r, 'host_step_ms', '{:.2f}')} |"
    )
  return "\n".join(lines) + "\n"


if __name__ == "__main__":
  app.run(main)
