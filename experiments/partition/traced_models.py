r"""Partition quality on jpipe's own Flax models (cost model only).

Each model is traced (nodes = direct submodules), costed with analytic
FLOPs (seconds at 100 TFLOP/s, backward = 2x forward) and split onto n
devices by "contiguous" (exact straight split) and "mixed" (FTPipe's mixed
pipe), compute only and with 10 GB/s links. The table gives each plan's
bottleneck over the lower bound max(total / n, largest node), and the solve
time. Writes results/traced_models.{md,json} and a PNG of per-stage cost.

Usage: python -m experiments.partition.traced_models
"""

import json
import os
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
from absl import app, flags

from jpipe import partition
from jpipe.models import gpt, mlp, resnet, t5, vgg

FLAGS = flags.FLAGS
flags.DEFINE_string(
  "out_dir",
  os.path.join(os.path.dirname(__file__), "results"),
  "Output folder.",
)
flags.DEFINE_list("devices", ["2", "4", "8"], "Device counts n.")

FLOPS = 100e12  # Converts FLOPs to seconds; only ratios matter without links.


def _models():
  """name -> (model, example inputs, batch-building info)."""
  images = jnp.zeros((32, 32, 32, 3))
  tokens = jnp.ones((8, 128), jnp.int32)
  return {
    "mlp-8x1024": (mlp.Model(hidden=(1024,) * 8), (images.reshape(32, -1),)),
    "wrn-16-4": (resnet.Model(depth=16, width=4), (images,)),
    "vgg16": (vgg.Model(), (images,)),
    "gpt-12x256": (
      gpt.Model(num_layers=12, width=256, num_heads=8, max_length=128),
      (tokens,),
    ),
    "t5-6+6x256": (
      t5.Model(num_layers=6, width=256, num_heads=8),
      (tokens, tokens),
    ),
  }


def _trace(model, inputs):
  variables = jax.eval_shape(
    lambda: model.init(jax.random.key(0), *inputs, train=False)
  )
  params = variables["params"]
  state = {k: v for k, v in variables.items() if k != "params"}

  def loss_fn(params, batch):
    out = model.apply(
      {"params": params, **batch["state"]}, *batch["inputs"], train=False
    )
    return optax.softmax_cross_entropy_with_integer_labels(
      out, jnp.zeros(out.shape[:-1], jnp.int32)
    ).mean()

  batch = {"inputs": inputs, "state": state}
  return partition.trace(loss_fn, params, batch), params, batch


def main(argv):
  del argv
  rows, records = [], []
  balance = {}
  for name, (model, inputs) in _models().items():
    traced, params, batch = _trace(model, inputs)
    costs = partition.profile_nodes(
      traced, params, batch, method="analytic", flops_per_second=FLOPS
    )
    compute = costs.forward_seconds + costs.backward_seconds
    for n in [int(d) for d in FLAGS.devices]:
      if n > traced.num_nodes:
        continue
      bound = max(compute.sum() / n, compute.max())
      for bandwidth in (None, 10e9):
        for method in ("contiguous", "mixed"):
          start = time.perf_counter()
          plan = partition.plan_traced(
            traced, costs, n, method=method, bandwidth=bandwidth
          )
          seconds = time.perf_counter() - start
          record = {
            "model": name,
            "nodes": traced.num_nodes,
            "devices": n,
            "method": method,
            "bandwidth": bandwidth,
            "bottleneck_seconds": plan.bottleneck_seconds,
            "lower_bound_seconds": bound,
            "ratio": plan.bottleneck_seconds / bound,
            "stages": plan.num_stages,
            "solve_seconds": seconds,
            "predicted_speedup": plan.predicted_speedup,
          }
          records.append(record)
          link = "compute" if bandwidth is None else "10 GB/s"
          rows.append(
            f"| {name} | {traced.num_nodes} | {n} | {link} | {method} | "
            f"{plan.num_stages} | {1e3 * plan.bottleneck_seconds:.3f} | "
            f"{1e3 * bound:.3f} | {record['ratio']:.3f} | "
            f"{plan.predicted_speedup:.2f} | {1e3 * seconds:.1f} |"
          )
          if n == 4 and bandwidth is None:
            balance[(name, method)] = plan
  header = (
    "| model | nodes | n | links | method | stages | bottleneck ms | "
    "lower bound ms | ratio | speed-up | solve ms |\n"
    "|---|---|---|---|---|---|---|---|---|---|---|"
  )
  table = header + "\n" + "\n".join(rows)
  note = (
    f"Analytic FLOPs at {FLOPS / 1e12:.0f} TFLOP/s, backward = 2x "
    f"forward; {jax.devices()[0].platform}; lower bound = "
    "max(total / n, largest node)."
  )
  os.makedirs(FLAGS.out_dir, exist_ok=True)
  with open(os.path.join(FLAGS.out_dir, "traced_models.md"), "w") as f:
    f.write(note + "\n\n" + table + "\n")
  with open(os.path.join(FLAGS.out_dir, "traced_models.json"), "w") as f:
    json.dump(records, f, separators=(",", ":"))
  _plot(balance, os.path.join(FLAGS.out_dir, "traced_models_n4.png"))
  print(note + "\n\n" + table)


def _plot(balance, path):
  import matplotlib

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  names = sorted({k[0] for k in balance})
  fig, axes = plt.subplots(1, len(names), figsize=(3.4 * len(names), 3))
  for ax, name in zip(np.atleast_1d(axes), names, strict=True):
    for offset, method in ((-0.2, "contiguous"), (0.2, "mixed")):
      plan = balance.get((name, method))
      if plan is None:
        continue
      load = np.zeros(4)
      for s, devs in enumerate(plan.stage_devices):
        load[devs[0]] += (
          plan.stage_forward_seconds[s] + plan.stage_backward_seconds[s]
        )
      ax.bar(np.arange(4) + offset, 1e3 * load, width=0.4, label=method)
    ax.set_title(name, fontsize=9)
    ax.set_xlabel("device")
  np.atleast_1d(axes)[0].set_ylabel("compute per microbatch (ms)")
  np.atleast_1d(axes)[0].legend(fontsize=7)
  fig.tight_layout()
  fig.savefig(path, dpi=100)
  plt.close(fig)


if __name__ == "__main__":
  app.run(main)
