r"""Staleness study: does each mitigation recover what delay costs?

Trains a 9-unit residual MLP on the embedded digits data as an asynchronous
pipeline of d + 1 stages (maximum delay d; see pipeline_sim.py) for every
mitigation (FTPipe's none, ws, wp, ga, wp+ga, ws+ga, nr, wp+nr; PipeMare's
pm; the delay-aware Nesterov method's nag, nag99; see pipeline_sim.py) and
optimizer in {SGD with momentum, Adam, AdamW}, over several seeds, and writes

  <out_dir>/staleness.json   every run's curves and final numbers
  <out_dir>/staleness.md     the tables (test accuracy, final train loss)
  <out_dir>/staleness.png    train-loss curves per optimizer and delay

Usage:
  python -m experiments.staleness.run            # the full grid
  python -m experiments.staleness.run --quick    # 1 seed, d in {0, 4}
"""

import json
import os
import time

import jax
import jax.numpy as jnp
import numpy as np
import tqdm
from absl import app, flags

from experiments.staleness import pipeline_sim
from jpipe import data

FLAGS = flags.FLAGS
flags.DEFINE_bool("quick", False, "1 seed, delays 0 and 4: a few minutes.")
flags.DEFINE_list("delays", ["0", "2", "4", "8"], "Maximum delays d.")
flags.DEFINE_list("methods", list(pipeline_sim.METHODS), "Mitigations.")
flags.DEFINE_list("optimizers", ["sgd", "adam", "adamw"], "Optimizers.")
flags.DEFINE_integer("seeds", 3, "Seeds per configuration.")
flags.DEFINE_integer("steps", 400, "Optimizer steps (one per microbatch).")
flags.DEFINE_integer("microbatch", 32, "Examples per microbatch.")
flags.DEFINE_integer("width", 128, "Hidden width of the MLP.")
flags.DEFINE_integer("eval_every", 50, "Steps between test evaluations.")
flags.DEFINE_string(
  "out_dir",
  os.path.join(os.path.dirname(__file__), "results"),
  "Output folder.",
)
flags.DEFINE_string("data_dir", None, "TFDS data dir (default: jpipe cache).")

NUM_UNITS = 9  # Supports up to 9 stages, i.e. d = 8.

# Tuned for d = 0 (the synchronous baseline), not for the delayed runs.
OPTIMIZERS = {
  "sgd": pipeline_sim.OptimizerSpec(
    "sgd", learning_rate=0.03, momentum=0.9, weight_decay=5e-4
  ),
  "adam": pipeline_sim.OptimizerSpec("adam", learning_rate=1e-3),
  "adamw": pipeline_sim.OptimizerSpec(
    "adamw", learning_rate=1e-3, weight_decay=1e-2
  ),
}


def _batches(seed: int, num_examples: int, steps: int, size: int):
  """Microbatch indices [steps, size]: shuffled epochs, drop remainders."""
  rng = np.random.default_rng(seed)
  per_epoch = num_examples // size
  epochs = -(-steps // per_epoch)
  order = [
    rng.permutation(num_examples)[: per_epoch * size] for _ in range(epochs)
  ]
  return np.concatenate(order).reshape(-1, size)[:steps]


def run_config(opt_name, delay, method, seeds, dataset, args):
  """All seeds of one configuration, vmapped in one compiled program."""
  units = pipeline_sim.split_units(NUM_UNITS, delay + 1)
  train = pipeline_sim.make_train(
    units,
    NUM_UNITS,
    OPTIMIZERS[opt_name],
    method,
    args["steps"],
    args["eval_every"],
  )

  def one_seed(key, order):
    params = pipeline_sim.init_units(key, NUM_UNITS, 64, args["width"], 10)
    stage_params = [[params[u] for u in group] for group in units]
    return train(stage_params, dict(dataset, order=order))

  keys = jax.vmap(jax.random.key)(jnp.arange(seeds))
  orders = jnp.stack(
    [
      _batches(
        s, dataset["train_x"].shape[0], args["steps"], args["microbatch"]
      )
      for s in range(seeds)
    ]
  )
  out = jax.jit(jax.vmap(one_seed))(keys, orders)
  return jax.tree.map(np.asarray, out)


def summarise(out):
  """Final test accuracy, and the mean train loss over the run (a measure
  of convergence speed: the area under the loss curve). Seeds whose loss
  became non-finite count as diverged and are left out of the loss."""
  acc = out["test_accuracy"][:, -1]
  loss = out["train_loss"].mean(axis=1)
  finite = loss[np.isfinite(loss)]
  return {
    "test_accuracy_mean": float(np.mean(acc)),
    "test_accuracy_std": float(np.std(acc)),
    "train_loss_mean": float(np.mean(finite)) if finite.size else np.nan,
    "train_loss_std": float(np.std(finite)) if finite.size else np.nan,
    "diverged_seeds": int(loss.size - finite.size),
    "test_accuracy_per_seed": acc.tolist(),
  }


def table(results, opt_names, delays, methods, key, fmt):
  head = "| optimizer | method | " + " | ".join(f"d={d}" for d in delays)
  lines = [head + " |", "|---|---|" + "---|" * len(delays)]
  for opt in opt_names:
    for method in methods:
      if not pipeline_sim.applies(opt, method):
        continue
      cells = []
      for d in delays:
        r = results[(opt, d, "none" if d == 0 else method)]
        cell = fmt(r[f"{key}_mean"], r[f"{key}_std"])
        if r["diverged_seeds"]:
          cell += f" ({r['diverged_seeds']} diverged)"
        cells.append(cell)
      lines.append(f"| {opt} | {method} | " + " | ".join(cells) + " |")
  return "\n".join(lines)


def plot(curves, opt_names, delays, methods, path, steps):
  import matplotlib

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  stale_delays = [d for d in delays if d > 0] or delays
  fig, axes = plt.subplots(
    len(opt_names),
    len(stale_delays),
    squeeze=False,
    figsize=(4.2 * len(stale_delays), 3.2 * len(opt_names)),
    sharex=True,
  )
  window = max(1, steps // 40)
  kernel = np.ones(window) / window

  def smooth(y):
    return np.convolve(y, kernel, mode="valid")

  for i, opt in enumerate(opt_names):
    for j, d in enumerate(stale_delays):
      ax = axes[i][j]
      if 0 in delays:
        ax.plot(
          smooth(curves[(opt, 0, "none")]), "k--", lw=1.2, label="d=0 (sync)"
        )
      for method in methods if d else []:
        if (opt, d, method) not in curves:
          continue
        # One colour per method in every panel (SGD has no nag99).
        color = f"C{methods.index(method) % 10}"
        ax.plot(
          smooth(curves[(opt, d, method)]), lw=1.0, label=method, color=color
        )
      ax.set_yscale("log")
      ax.set_ylim(top=10.0)  # Diverged runs leave the plot upwards.
      ax.set_title(f"{opt}, max delay d={d}")
      if j == 0:
        ax.set_ylabel("train loss (mean of seeds)")
      if i == len(opt_names) - 1:
        ax.set_xlabel("step")
  # The legend of the panel with the most methods (some skip a few).
  max(axes.ravel(), key=lambda a: len(a.lines)).legend(fontsize=7)
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  plt.close(fig)


def main(argv):
  del argv
  delays = [int(d) for d in FLAGS.delays]
  seeds = FLAGS.seeds
  methods = FLAGS.methods
  if FLAGS.quick:
    delays, seeds, methods = [0, 4], 1, ["none", "ws", "wp", "ga"]
  for m in methods:
    if m not in pipeline_sim.METHODS:
      raise app.UsageError(f"unknown method {m!r}: {pipeline_sim.METHODS}")
  for d in delays:
    if not 0 <= d < NUM_UNITS:
      raise app.UsageError(f"delay {d} out of range 0..{NUM_UNITS - 1}")
  for o in FLAGS.optimizers:
    if o not in OPTIMIZERS:
      raise app.UsageError(f"unknown optimizer {o!r}: {list(OPTIMIZERS)}")
  if FLAGS.steps % FLAGS.eval_every:
    raise app.UsageError("--steps must be a multiple of --eval_every")
  args = {
    "steps": FLAGS.steps,
    "eval_every": FLAGS.eval_every,
    "microbatch": FLAGS.microbatch,
    "width": FLAGS.width,
  }

  train_x, train_y = data.load_digits("train", FLAGS.data_dir)
  test_x, test_y = data.load_digits("test", FLAGS.data_dir)
  dataset = {
    "train_x": jnp.asarray(train_x.reshape(len(train_x), -1)),
    "train_y": jnp.asarray(train_y),
    "test_x": jnp.asarray(test_x.reshape(len(test_x), -1)),
    "test_y": jnp.asarray(test_y),
  }

  configs = [
    (o, d, "none" if d == 0 else m)
    for o in FLAGS.optimizers
    for d in delays
    for m in (["none"] if d == 0 else methods)
    if pipeline_sim.applies(o, m)
  ]
  results, curves, records = {}, {}, []
  start = time.time()
  for opt, d, method in tqdm.tqdm(configs, desc="staleness runs"):
    out = run_config(opt, d, method, seeds, dataset, args)
    results[(opt, d, method)] = summarise(out)
    # Curves average the seeds; a diverged seed makes the curve leave the
    # plot, which is what a reader should see.
    curves[(opt, d, method)] = np.mean(out["train_loss"], axis=0)
    records.append(
      {
        "optimizer": opt,
        "delay": d,
        "method": method,
        **results[(opt, d, method)],
        "optimizer_spec": vars(OPTIMIZERS[opt]),
        "train_loss_curve": curves[(opt, d, method)].tolist(),
        "test_accuracy_curve": out["test_accuracy"].mean(axis=0).tolist(),
      }
    )
  elapsed = time.time() - start

  os.makedirs(FLAGS.out_dir, exist_ok=True)
  acc = table(
    results,
    FLAGS.optimizers,
    delays,
    methods,
    "test_accuracy",
    lambda m, s: f"{100 * m:.1f} ± {100 * s:.1f}",
  )
  loss = table(
    results,
    FLAGS.optimizers,
    delays,
    methods,
    "train_loss",
    lambda m, s: f"{m:.3f} ± {s:.3f}",
  )
  header = (
    f"{seeds} seed(s), {args['steps']} steps of {args['microbatch']} "
    f"examples, pipeline of d+1 stages; {jax.devices()[0].platform}, "
    f"{elapsed:.0f} s. d=0 is the synchronous baseline (one stage), "
    "repeated in every row."
  )
  markdown = (
    f"{header}\n\nTest accuracy (%) at the end, mean ± std over "
    f"seeds:\n\n{acc}\n\nMean train loss over the run (lower = "
    f"faster convergence), mean ± std over seeds:\n\n{loss}\n"
  )
  with open(os.path.join(FLAGS.out_dir, "staleness.md"), "w") as f:
    f.write(markdown)
  with open(os.path.join(FLAGS.out_dir, "staleness.json"), "w") as f:
    json.dump(
      {
        "config": {
          **args,
          "seeds": seeds,
          "delays": delays,
          "methods": methods,
          "seconds": elapsed,
        },
        "runs": records,
      },
      f,
      separators=(",", ":"),
    )
  png = os.path.join(FLAGS.out_dir, "staleness.png")
  plot(curves, FLAGS.optimizers, delays, methods, png, args["steps"])
  print(markdown)
  print(f"Wrote {FLAGS.out_dir}/staleness.{{md,json,png}}")


if __name__ == "__main__":
  app.run(main)
