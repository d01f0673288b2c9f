r"""Why a stage's big weights keep their own buffers: the cost of slicing
a flat buffer.

Every array passed to a jitted call costs the host a few microseconds, so
the driver holds a stage's params packed into one flat buffer per dtype
(``jpipe/runtime/build/stored_params.py``). But XLA materialises a weight
sliced out of a flat buffer as a copy before a matmul reads it, so every
forward and backward would also copy the stage's params: leaves from the
pipeline's ``own_buffer_bytes`` stay apart. This measures that copy:
``blocks`` residual blocks ``x + tanh(x @ w1) @ w2`` (width x width
weights), forward and backward (gradients packed, as the driver's
accumulator is), with the params as separate leaves or as one flat buffer,
for several microbatch sizes (rows).

Writes results/flat_params_<platform>.{md,json}.

Usage: python -m experiments.runtime.flat_params [--width 1024]
"""

import json
import math
import os
import time

import jax
import jax.numpy as jnp
import numpy as np
from absl import app, flags

from jpipe.runtime.build.flat import FlatLayout

FLAGS = flags.FLAGS
flags.DEFINE_integer("width", 1024, "Weight matrices are width x width.")
flags.DEFINE_integer("blocks", 4, "Residual blocks (two matmuls each).")
flags.DEFINE_list("rows", ["64", "256", "1024"], "Rows per microbatch.")
flags.DEFINE_integer("repeats", 15, "Timed calls per measurement (median).")
flags.DEFINE_string(
  "out_dir",
  os.path.join(os.path.dirname(__file__), "results"),
  "Output folder.",
)


def _loss(leaves, x):
  """Scalar output of the residual blocks; ``leaves`` = (w1, w2) * blocks."""
  for w1, w2 in zip(leaves[::2], leaves[1::2], strict=True):
    x = x + jnp.tanh(x @ w1) @ w2
  return x.sum()


def _programs(layout):
  """{name: jitted fn(params, x)}; params are leaves or ``layout``-packed."""

  def backward(leaves, x):
    return layout.pack(jax.grad(_loss)(leaves, x))

  return {
    "forward, leaves": jax.jit(_loss),
    "forward, flat": jax.jit(lambda f, x: _loss(layout.unpack(f), x)),
    "backward, leaves": jax.jit(backward),
    "backward, flat": jax.jit(lambda f, x: backward(layout.unpack(f), x)),
  }


def _check_same_values(programs, leaves, flat, x):
  """The flat and the leaf programs must compute the same values (else the
  comparison would be unfair)."""
  for kind in ("forward", "backward"):
    a = jax.tree.leaves(programs[f"{kind}, leaves"](leaves, x))
    b = jax.tree.leaves(programs[f"{kind}, flat"](flat, x))
    for u, v in zip(a, b, strict=True):
      if not np.allclose(u, v, rtol=1e-5, atol=1e-5):
        raise AssertionError(f"{kind}: flat and leaf programs differ")


def _median_ms(fn, *args):
  jax.block_until_ready(fn(*args))  # compile
  times = []
  for _ in range(FLAGS.repeats):
    start = time.perf_counter()
    jax.block_until_ready(fn(*args))
    times.append(time.perf_counter() - start)
  return 1e3 * float(np.median(times))


def main(argv):
  del argv
  n = FLAGS.width
  leaves = tuple(
    0.01 * jax.random.normal(jax.random.key(i), (n, n))
    for i in range(2 * FLAGS.blocks)
  )
  layout = FlatLayout(leaves, own_buffer_bytes=math.inf)  # All packed.
  flat = jax.jit(layout.pack)(leaves)
  programs = _programs(layout)
  records, lines = [], []
  for rows in (int(r) for r in FLAGS.rows):
    x = jax.random.normal(jax.random.key(99), (rows, n))
    _check_same_values(programs, leaves, flat, x)
    ms = {
      name: _median_ms(fn, flat if "flat" in name else leaves, x)
      for name, fn in programs.items()
    }
    fwd = ms["forward, flat"] / ms["forward, leaves"]
    bwd = ms["backward, flat"] / ms["backward, leaves"]
    records.append({"rows": rows, "milliseconds": ms, "ratios": [fwd, bwd]})
    lines.append(
      f"| {rows} | {ms['forward, leaves']:.2f} | {ms['forward, flat']:.2f} "
      f"| {fwd:.2f} | {ms['backward, leaves']:.2f} | "
      f"{ms['backward, flat']:.2f} | {bwd:.2f} |"
    )
  device = jax.devices()[0]
  header = (
    f"{device.device_kind} ({device.platform}), jax {jax.__version__}: "
    f"{FLAGS.blocks} blocks of two {n} x {n} matmuls, median of "
    f"{FLAGS.repeats} calls (ms)."
  )
  table = (
    "| rows | forward, leaves | forward, flat | ratio | backward, leaves "
    "| backward, flat | ratio |\n|---|---|---|---|---|---|---|\n"
    + "\n".join(lines)
  )
  text = f"{header}\n\n{table}\n"
  print(text)
  write_results(
    f"flat_params_{device.platform}",
    text,
    {
      "device": device.device_kind,
      "jax": jax.__version__,
      "width": n,
      "blocks": FLAGS.blocks,
      "results": records,
    },
  )


def write_results(name: str, text: str, record: dict) -> None:
  """``text`` to ``--out_dir``/NAME.md and ``record`` to NAME.json."""
  os.makedirs(FLAGS.out_dir, exist_ok=True)
  path = os.path.join(FLAGS.out_dir, name)
  with open(path + ".md", "w") as f:
    f.write(text)
  with open(path + ".json", "w") as f:
    json.dump(record, f, separators=(",", ":"))


if __name__ == "__main__":
  app.run(main)
