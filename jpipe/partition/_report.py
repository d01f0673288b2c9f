"""Printing and drawing a partition: the table and picture both CLIs show
(``python -m jpipe.partition`` for profiles, ``python -m jpipe.train.plan``
for a training config)."""

import numpy as np


def print_plan_table(title, result, stage_of_pos):
  print(title)
  print("stage  devices  nodes  compute ms    stage ms")
  for s, devices in enumerate(result["stage_devices"]):
    shown = devices
    if isinstance(devices, list):
      shown = devices[0] if len(devices) == 1 else f"{devices[0]}-{devices[-1]}"
    print(
      f"{s:5d}  {shown!s:>7}  {stage_of_pos.count(s):5d}  "
      f"{1e3 * result['stage_costs'][s]:10.4g}  "  # (Small models: µs.)
      f"{1e3 * result['stage_seconds'][s]:10.4g}"
    )
  bottleneck = result["bottleneck"]
  print(
    f"bottleneck {1e3 * bottleneck:.4g} ms, lower bound "
    f"{1e3 * result['lower_bound']:.4g} ms, speed-up "
    f"{result['sequential'] / bottleneck:.2f}x"
  )
  if "replicas" in result:
    print(
      f"replication {'-'.join(map(str, result['replicas']))}, data "
      f"parallel {1e3 * result['data_parallel_seconds']:.3f} ms, speed-up "
      f"vs data parallel {result['speedup_vs_data_parallel']:.2f}x"
    )


def plot_plan(costs, stage_time, path, memory=None):
  """Per-stage compute and stage time; beside it, per-stage memory (MB,
  stacked: ``memory`` maps a label to per-stage bytes) when given."""
  import matplotlib

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  panels = 2 if memory else 1
  width = max(4, 0.6 * len(costs) + 2)
  fig, axes = plt.subplots(1, panels, figsize=(width * panels, 3))
  axes = np.atleast_1d(axes)
  ax = axes[0]
  x = np.arange(len(costs))
  ax.bar(x - 0.2, 1e3 * np.asarray(costs), 0.4, label="compute")
  ax.bar(x + 0.2, 1e3 * np.asarray(stage_time), 0.4, label="stage time")
  ax.set_xticks(x)
  ax.set_xlabel("stage")
  ax.set_ylabel("ms per minibatch")
  ax.legend()
  if memory:
    bottom = np.zeros(len(costs))
    for label, per_stage in memory.items():
      values = np.asarray(per_stage, float) / 2**20  # (As the text: MiB.)
      axes[1].bar(x, values, 0.6, bottom=bottom, label=label)
      bottom += values
    axes[1].set_xticks(x)
    axes[1].set_xlabel("stage")
    axes[1].set_ylabel("MiB")
    axes[1].legend()
  fig.tight_layout()
  fig.savefig(path, dpi=100)
  plt.close(fig)
