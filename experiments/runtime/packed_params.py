r"""A stage's params stored packed while the driver runs: what it saves
the host.

Every array a jitted program takes or returns costs the host
microseconds per call (~1.5 µs per input, ~4-6 per output on the 2-core
CPU of experiments/RESULTS.md). Every forward and backward takes a
stage's params, and an asynchronous stage's backward, which steps in the
same program (``fuse_step``), returns them: a GPT layer's 16 leaves. The
driver now holds them as ``jpipe.runtime``'s ``PackedTree``
(``_stored_params.py``: leaves below the pipeline's ``own_buffer_bytes``
in one flat buffer per dtype, converted from and to the state's leaf
tuples at a call's ends), so a tiny GPT layer's params are 1 array.

This measures, on a tiny GPT (compute ~ 0) with every stage on one
device, async with stashing, the host's time per action with every param
leaf its own buffer (before) and packed, paired (alternating rounds in
one process), split as ``experiments.runtime.host_cost`` splits it. The
math is the same per leaf, but where leaves share a buffer XLA may fuse
an update otherwise (floating-point contraction); the largest difference
of the params after the warm steps is written per row.

Writes results/packed_params_<platform>.{md,json}.

Usage: python -m experiments.runtime.packed_params [--stages 8]
  [--microbatches 32] [--rounds 2] [--optimizers adam,sgd]
"""

from absl import app

from experiments.runtime.fused_step import paired
from experiments.runtime.packed_state import params_difference


def main(argv):
  del argv
  settings = (("leaves", {"packed_params": False}), ("packed", {}))
  paired("packed_params", settings, params_difference, "param_arrays")


if __name__ == "__main__":
  app.run(main)
