r"""A stage's optimizer state stored packed: what it saves the host.

Every array a jitted program takes or returns costs the host
microseconds per call (more for an output than an input: ~1.5 µs per
input, ~4-6 per output on the 2-core CPU of experiments/RESULTS.md). An
asynchronous stage steps after every microbatch, in its backward's
program (``fuse_step``), which so takes and returns the whole optimizer
state: for Adam twice the stage's leaves and a count. Stored packed
(``jpipe.runtime``'s ``PackedTree``: leaves below the pipeline's
``own_buffer_bytes`` in one flat buffer per dtype) a tiny GPT layer's
Adam state is 1 array instead of 33 (its f32 moments and int32 count
share a 32-bit buffer).

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

import jax
import numpy as np
from absl import app

from experiments.runtime.fused_step import paired


def params_difference(row, a, b):
  """Notes in ``row`` the largest difference between params ``a`` and
  ``b`` (over its rounds)."""
  apart = max(
    float(np.max(np.abs(x - y), initial=0.0))
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True)
  )
  row["params_max_abs_difference"] = max(
    apart, row.get("params_max_abs_difference", 0.0)
  )


def main(argv):
  del argv
  settings = (("tree", {"packed_state": False}), ("packed", {}))
  paired("packed_state", settings, params_difference, "state_arrays")


if __name__ == "__main__":
  app.run(main)
