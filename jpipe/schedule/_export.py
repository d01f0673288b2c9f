"""Timelines out: Chrome/Perfetto trace JSON and a PNG Gantt chart."""

import json
from collections.abc import Sequence

from jpipe.schedule._simulate import Timeline

# Forward blue, backward orange, its input-gradient half red and its
# weight-gradient half yellow, step green.
_COLOURS = {
  "F": "#4C78A8",
  "B": "#F58518",
  "I": "#E45756",
  "W": "#ECA82C",
  "S": "#54A24B",
}
_LABELS = {
  "F": "forward",
  "B": "backward",
  "I": "input gradient",
  "W": "weight gradient",
  "S": "step",
}


def _names(timeline: Timeline, device_names) -> list[str]:
  """A label per timeline device ("device d" unless named)."""
  n = len(timeline.busy)
  if device_names is None:
    return [f"device {d}" for d in range(n)]
  if len(device_names) != n:
    raise ValueError(
      f"{len(device_names)} device names for a timeline of {n} devices"
    )
  return list(device_names)


def chrome_trace(
  timeline: Timeline, device_names: Sequence[str] | None = None
) -> dict:
  """The timeline as Chrome trace events (open in ui.perfetto.dev).

  One track (tid) per device, labelled ``device_names[d]`` (e.g. a
  pipeline's ``device_names``: "devices 0-1" for a replica group); times
  in microseconds.
  """
  events = []
  for action, start in timeline.start.items():
    events.append(
      {
        "name": str(action),
        "cat": action.kind,
        "ph": "X",
        "ts": start * 1e6,
        "dur": (timeline.end[action] - start) * 1e6,
        "pid": 0,
        "tid": timeline.device_of[action],
        "args": {"stage": action.stage, "microbatch": action.microbatch},
      }
    )
  for d, name in enumerate(_names(timeline, device_names)):
    events.append(
      {
        "name": "thread_name",
        "ph": "M",
        "pid": 0,
        "tid": d,
        "args": {"name": name},
      }
    )
  return {"traceEvents": events, "displayTimeUnit": "ms"}


def write_chrome_trace(
  timeline: Timeline, path: str, device_names: Sequence[str] | None = None
) -> None:
  """Writes :func:`chrome_trace` as JSON to ``path``."""
  with open(path, "w") as f:
    json.dump(chrome_trace(timeline, device_names), f)


def plot_timeline(
  timeline: Timeline,
  path: str,
  *,
  title: str = "",
  device_names: Sequence[str] | None = None,
) -> None:
  """A Gantt chart PNG: one row per device (labelled as in
  :func:`chrome_trace`), forwards blue, backwards orange (input
  gradients red, weight gradients yellow), steps green,
  idle time blank, with a legend; ``title`` says what it shows (a
  makespan and bubble line follows it)."""
  import matplotlib

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  num_devices = len(timeline.busy)
  width = max(6.0, min(24.0, 0.25 * len(timeline.start) / num_devices + 4))
  fig, ax = plt.subplots(figsize=(width, 0.5 * num_devices + 1.2))
  for action, start in timeline.start.items():
    d = timeline.device_of[action]
    duration = timeline.end[action] - start
    ax.broken_barh(
      [(start, duration)],
      (d - 0.4, 0.8),
      facecolors=_COLOURS[action.kind],
      edgecolors="white",
      linewidth=0.5,
    )
    if action.kind != "S" and duration > timeline.makespan / 150:
      ax.text(
        start + duration / 2,
        d,
        str(action.microbatch),
        ha="center",
        va="center",
        fontsize=6,
        color="white",
      )
  ax.set_yticks(range(num_devices))
  ax.set_yticklabels(_names(timeline, device_names))
  ax.invert_yaxis()
  ax.set_xlabel("time (s)")
  summary = (
    f"makespan {timeline.makespan:.3g} s, bubble (idle) "
    f"{100 * timeline.bubble:.1f}%"
  )
  ax.set_title(f"{title}\n{summary}" if title else summary, fontsize=9)
  from matplotlib.patches import Patch

  kinds = {a.kind for a in timeline.start}
  legend = [
    Patch(facecolor=_COLOURS[k], label=label)
    for k, label in _LABELS.items()
    if k in kinds or k in "FS" or (k == "B" and not kinds & {"I", "W"})
  ]
  legend.append(Patch(facecolor="white", edgecolor="grey", label="idle"))
  ax.legend(
    handles=legend,
    loc="upper left",
    bbox_to_anchor=(1.0, 1.0),
    fontsize=7,
    frameon=False,
  )
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  plt.close(fig)
