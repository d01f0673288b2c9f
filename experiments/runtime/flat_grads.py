r"""Why big gradients keep their own buffers: the cost of packing them.

The driver keeps a stage's gradient accumulator as few buffers (every
array through a jitted call costs the host a few microseconds). Packing a
leaf into a flat buffer is a concatenation inside the backward: a copy of
it. This times a stage's backward (``blocks`` dense-ReLU layers of width x
width weights and a bias each, gradients of weights and biases returned
through ``FlatLayout``) with every leaf packed, with the platform's default
(``own_buffer_bytes``: big leaves apart, small ones packed) and with no
leaf packed, for several widths: from which leaf size the copy costs more
than the dispatch it saves.

Writes results/flat_grads_<platform>.{md,json}.

Usage: python -m experiments.runtime.flat_grads [--grad_rows 256]
"""

import math

import jax
import jax.numpy as jnp
import numpy as np
from absl import app, flags

from experiments.runtime.flat_params import _median_ms, write_results
from jpipe.runtime.build.flat import FlatLayout, own_buffer_bytes

# --repeats and --out_dir are flat_params' flags.
FLAGS = flags.FLAGS
flags.DEFINE_list(
  "grad_widths", ["128", "256", "512", "1024", "2048"], "Widths."
)
flags.DEFINE_integer("grad_layers", 4, "Dense-ReLU layers in the stage.")
flags.DEFINE_integer("grad_rows", 256, "Rows per microbatch.")


def _loss(leaves, x):
  """Sum of the layers' output; ``leaves`` = (kernel, bias) * layers."""
  for w, b in zip(leaves[::2], leaves[1::2], strict=True):
    x = jax.nn.relu(x @ w + b)
  return x.sum()


def main(argv):
  del argv
  platform = jax.devices()[0].platform
  thresholds = {
    "all packed": math.inf,
    "default": own_buffer_bytes(platform),
    "none packed": 0,
  }
  records, lines = [], []
  for n in (int(w) for w in FLAGS.grad_widths):
    keys = jax.random.split(jax.random.key(0), FLAGS.grad_layers)
    leaves = []
    for k in keys:
      leaves += [0.05 * jax.random.normal(k, (n, n)), jnp.zeros((n,))]
    leaves = tuple(leaves)
    x = jax.random.normal(jax.random.key(99), (FLAGS.grad_rows, n))
    ms, buffers, reference = {}, {}, None
    for name, threshold in thresholds.items():
      layout = FlatLayout(leaves, own_buffer_bytes=threshold)
      backward = jax.jit(
        lambda p, x, layout=layout: layout.pack(jax.grad(_loss)(p, x))
      )
      grads = layout.unpack(backward(leaves, x))
      if reference is None:
        reference = grads
      for a, b in zip(grads, reference, strict=True):  # Same values.
        np.testing.assert_allclose(a, b, rtol=1e-6)
      ms[name] = _median_ms(backward, leaves, x)
      buffers[name] = len(layout.pack(leaves))
    records.append(
      {"width": n, "kernel_bytes": 4 * n * n, "ms": ms, "buffers": buffers}
    )
    lines.append(
      f"| {n} | {4 * n * n / 1024:.0f} | "
      + " | ".join(f"{ms[k]:.2f} ({buffers[k]})" for k in thresholds)
      + f" | {ms['all packed'] / ms['none packed']:.2f} |"
    )
  device = jax.devices()[0]
  header = (
    f"{device.device_kind} ({platform}), jax {jax.__version__}: backward "
    f"of {FLAGS.grad_layers} dense-ReLU layers, {FLAGS.grad_rows} rows, gradients "
    f"returned through FlatLayout; median of {FLAGS.repeats} calls, ms "
    f"(buffers returned). Default: leaves from "
    f"{own_buffer_bytes(platform) / 1024:.0f} KiB keep their own buffer."
  )
  table = (
    "| width | kernel KiB | "
    + " | ".join(thresholds)
    + " | all / none |\n|---|---|---|---|---|---|\n"
    + "\n".join(lines)
  )
  text = f"{header}\n\n{table}\n"
  print(text)
  write_results(
    f"flat_grads_{platform}",
    text,
    {
      "device": device.device_kind,
      "jax": jax.__version__,
      "layers": FLAGS.grad_layers,
      "rows": FLAGS.grad_rows,
      "default_own_buffer_bytes": own_buffer_bytes(platform),
      "results": records,
    },
  )


if __name__ == "__main__":
  app.run(main)
