"""Re-partitioning while training (DynPipe) in the training CLI.

``build`` makes the ``jpipe.dynamic.DynamicPipeline`` that
``config.dynamic`` describes; the loop calls ``report`` after each step
(a re-partition prints a line starting with ``re-partition`` and goes to
``metrics.jsonl`` under "repartition"; each measured window logs the
stage slots' slowdowns) and ``draw`` at the end (step time per window,
the re-partitions marked).
"""

import os

import jax

from jpipe import dynamic
from jpipe.train.errors import UsageError


def build(config, task, example_batch, tx, options):
  """The DynamicPipeline of ``config.dynamic`` (``options``: the other
  ``jpipe.Pipeline`` keyword arguments)."""
  dyn = config.dynamic
  interference = dynamic.Interference(
    dynamic.parse_inject(dyn.inject), simulated_seconds=dyn.simulated_ms / 1e3
  )
  try:
    predictor = (
      dynamic.SlowdownPredictor.load(dyn.predictor) if dyn.predictor else None
    )
    return dynamic.DynamicPipeline(
      task.loss_fn,
      task.params,
      example_batch,
      policy=dyn.policy,
      window=dyn.window,
      high=dyn.high,
      low=dyn.low,
      warmup_windows=dyn.warmup_windows,
      top_k=dyn.top_k,
      horizon_steps=dyn.horizon_steps or None,
      interference=interference,
      predictor=predictor,
      devices=jax.devices(),
      optimizer=tx,
      **options,
    )
  except ValueError as e:
    raise UsageError(f"config.dynamic: {e}") from e


def report(metrics, step, log, write) -> None:
  """Logs a measured window and prints and logs a re-partition."""
  window = metrics.get("window")
  if window is not None:
    log.write(
      step,
      **{"dynamic/step_seconds": window.step_seconds},
      **{f"dynamic/slowdown/{s}": x for s, x in enumerate(window.sigma)},
    )
  record = metrics.get("repartition")
  if record is not None:
    log.write_event(step, "repartition", record)
    write(line(step, record))


def line(step, record) -> str:
  """The printed line of a re-partition."""
  sigma = ", ".join(f"{x:.2f}" for x in record["sigma"])
  return (
    f"re-partition at step {step}: {dynamic.describe(record['old'])} -> "
    f"{dynamic.describe(record['new'])} (slowdowns {sigma}; predicted "
    f"{record['predicted_old_seconds']:.4f} -> "
    f"{record['predicted_new_seconds']:.4f} s per step, measured "
    f"{record['measured_seconds']:.4f}; switch {record['switch_seconds']:.3f} "
    f"s{', new pipeline' if record['compiled'] else ''})"
  )


def draw(pipe, workdir) -> str:
  """``WORKDIR/dynamic.png``: each window's step seconds and slowdowns,
  re-partitions marked. Returns its path."""
  import matplotlib

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  steps = [w.step for w in pipe.windows]
  fig, (top, bottom) = plt.subplots(2, 1, figsize=(8, 6), sharex=True)
  top.plot(steps, [w.step_seconds for w in pipe.windows], marker="o")
  top.set_ylabel("measured step seconds")
  for s in range(pipe.plan.num_stages):
    bottom.plot(steps, [w.sigma[s] for w in pipe.windows], label=f"slot {s}")
  bottom.set_ylabel("slowdown (vs reference)")
  bottom.set_xlabel("step")
  bottom.legend()
  for record in pipe.history:
    for ax in (top, bottom):
      ax.axvline(record["step"], color="red", ls="--", lw=0.8)
    top.annotate(
      dynamic.describe(record["new"]),
      (record["step"], top.get_ylim()[1]),
      fontsize=7,
      rotation=90,
      va="top",
    )
  fig.suptitle(f"re-partitioning ({pipe.policy.name}), red: switches")
  fig.tight_layout()
  path = os.path.join(workdir, "dynamic.png")
  fig.savefig(path, dpi=100)
  plt.close(fig)
  return path
