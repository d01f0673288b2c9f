r"""Which leaves travel packed: the one-device overhead by own-buffer size.

A stage program's small gradient leaves and residuals travel packed, one
flat buffer per dtype (every array through a call costs the host a few
microseconds); from ``Partitioning.own_buffer_bytes`` on a leaf is its
own array (packing copies it). This runs ``experiments.runtime.overhead``'s
one-device comparison -- a GPT split into p stages on one device, gpipe
over m microbatches, last stage fused, no recomputation, against one
jitted step -- for several sizes, in alternating rounds in one process
(each round: every size's pipeline paired with the reference), and
prints per size the ratio per round and the fixed cost per microbatch
(µs, median over the rounds). The platform's default is marked.

Writes results/pack_threshold_<platform>.{md,json}.

Usage: python -m experiments.runtime.pack_threshold [--stages 2,4]
  [--kib 1024,64,16,4,0] [--rounds 3] [--pairs 8] [--size small]
"""

import json
import math

import jax
import numpy as np
import optax
from absl import app, flags

from experiments.gpu_campaign import _common
from experiments.runtime.overhead import SIZES, _lm, _pipeline
from jpipe.runtime.build.flat import own_buffer_bytes

FLAGS = flags.FLAGS
flags.DEFINE_list("stages", ["2", "4"], "Pipeline stages (one device).")
flags.DEFINE_list(
  "kib",
  ["1024", "64", "16", "4", "0"],
  "Own-buffer sizes to compare, KiB (1024: the CPU's before 2026-11-28; "
  "inf: every leaf packed).",
)
flags.DEFINE_integer("rounds", 3, "Alternating rounds over the sizes.")
flags.DEFINE_integer("pairs", 8, "Paired steps per size and round.")
# --out_dir and --size (the GPT; default "small") are
# experiments.runtime.overhead's flags.


def main(argv):
  del argv
  layers, width, heads, length, batch_size, m = SIZES[FLAGS.size]
  loss_fn, params, batch = _lm(layers, width, heads, length, batch_size)
  tx = optax.adamw(1e-4)
  reference = _common.reference_step(loss_fn, params, batch, m, tx, False)
  platform = jax.devices()[0].platform
  default = own_buffer_bytes(platform)
  rows = []
  for p in (int(s) for s in FLAGS.stages):
    runs = {}
    for kib in FLAGS.kib:
      size = float(kib) * 1024  # ("inf": every leaf packed)
      size = int(size) if math.isfinite(size) else size
      runs[size], _ = _pipeline(
        loss_fn, params, batch, m, p, tx, False, own_buffer_bytes=size
      )
    ratios = {size: [] for size in runs}
    fixed = {size: [] for size in runs}
    for _ in range(FLAGS.rounds):
      for size, run in runs.items():
        pipe_t, ref_t = _common.paired_times(run, reference, FLAGS.pairs)
        ratios[size].append(float(np.median(pipe_t / ref_t)))
        fixed[size].append(float(np.median(pipe_t - ref_t)) * 1e6 / m)
    for size in runs:
      row = {
        "stages": p,
        "microbatches": m,
        "own_buffer_bytes": size,
        "default": size == default,
        "ratio_per_round": ratios[size],
        "fixed_us_per_microbatch": float(np.median(fixed[size])),
      }
      rows.append(row)
      print(json.dumps(row), flush=True)
  record = {
    **_common.metadata(),
    "model": dict(
      layers=layers, width=width, heads=heads, length=length, batch=batch_size
    ),
    "rows": rows,
  }
  _common.write_table(
    FLAGS.out_dir, f"pack_threshold_{platform}", _table(rows), record
  )


def _table(rows) -> str:
  """Markdown: per (stages, size), the ratio per round and the fixed cost."""
  lines = [
    "| stages | microbatches | own buffer from | pipeline / jitted step, "
    "per round | median | fixed µs / microbatch |",
    "|---|---|---|---|---|---|",
  ]
  for row in rows:
    size = row["own_buffer_bytes"]
    name = "every leaf" if size == 0 else f"{size / 1024:g} KiB"
    if math.isinf(size):
      name = "none (all packed)"
    if row["default"]:
      name = f"**{name} (default)**"
    per_round = ", ".join(f"{r:.3f}" for r in row["ratio_per_round"])
    lines.append(
      f"| {row['stages']} | {row['microbatches']} | {name} | {per_round} | "
      f"{np.median(row['ratio_per_round']):.3f} | "
      f"{row['fixed_us_per_microbatch']:.0f} |"
    )
  return "\n".join(lines) + "\n"


if __name__ == "__main__":
  app.run(main)
