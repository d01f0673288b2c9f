r"""Where a pipeline step's time goes, read off a ``jax.profiler`` trace.

``capture(run, steps, log_dir)`` traces ``steps`` calls of ``run`` (each
one step, waited for) as spans named ``STEP_SPAN``; ``breakdown(path)``
parses the trace (the Perfetto JSON that ``jax.profiler.trace`` writes)
into, per step:

- ``wall_us``: the step's span;
- the host's time per kind of driver op (the driver names each op's span
  ``jpipe.KIND ...``: F, B, S, I, W, MOVE_F, SEND_B, ...): count, mean
  microseconds, and how much of it is JAX dispatch (``PjitFunction``
  spans: argument handling, output allocation and the launch; a CPU
  client also runs small programs inline there) against the driver's own
  Python (the rest);
- the heaviest spans nested in dispatch by name (the runtime's phases:
  ``ParseArguments``, ``ExecutePrepare``, ``AllocateOutputBuffers...``,
  ``CreateOutputs``, the launch), in microseconds per step;
- per device (a GPU's ``/device:...`` rows; a CPU has none): the union
  of its kernels' intervals in microseconds per step (``busy_us``), and
  the programs (``XLA Modules`` row) with the most device time.

``host_busy_us`` is the union of the ops' spans: with ``busy_us`` it says
which side sets the pace (a host busy for the whole step, with the device
idle part of it, is the driver's cost, not the model's).
"""

import collections
import glob
import gzip
import json
import os

import jax

# No colon in a span's name: the profiler drops "a:b" (measured: such
# spans never reach the Perfetto trace).
STEP_SPAN = "jpipe.experiment_call"
OP_PREFIX = "jpipe."


def capture(run, steps: int, log_dir: str) -> str:
  """Traces ``steps`` calls of ``run`` (each waits for its step) into
  ``log_dir``; returns the Perfetto trace's path."""
  with jax.profiler.trace(log_dir, create_perfetto_trace=True):
    for _ in range(steps):
      with jax.profiler.TraceAnnotation(STEP_SPAN):
        run()
  paths = glob.glob(
    os.path.join(log_dir, "**", "perfetto_trace.json.gz"), recursive=True
  )
  if not paths:
    raise FileNotFoundError(f"no perfetto_trace.json.gz under {log_dir}")
  return max(paths, key=os.path.getmtime)


def _union_us(intervals) -> float:
  """Length of the union of ``(start, end)`` intervals."""
  total, end = 0.0, -float("inf")
  for a, b in sorted(intervals):
    if b <= end:
      continue
    total += b - max(a, end)
    end = b
  return total


def _outermost(events):
  """The events not inside an earlier one (same thread, sorted by ts)."""
  out, end = [], -float("inf")
  for e in sorted(events, key=lambda e: (e["ts"], -e["dur"])):
    if e["ts"] >= end:
      out.append(e)
      end = e["ts"] + e["dur"]
  return out


def _inside(events, span):
  a, b = span["ts"], span["ts"] + span["dur"]
  return [e for e in events if a <= e["ts"] and e["ts"] + e["dur"] <= b]


def breakdown(path: str, top: int = 12) -> dict:
  """Per-step figures of a trace from ``capture`` (see the module doc)."""
  with gzip.open(path, "rt") as f:
    events = json.load(f)["traceEvents"]
  process, thread = {}, {}
  for e in events:
    if e.get("ph") == "M" and e.get("name") == "process_name":
      process[e["pid"]] = e["args"]["name"]
    if e.get("ph") == "M" and e.get("name") == "thread_name":
      thread[(e["pid"], e["tid"])] = e["args"]["name"]
  spans = [e for e in events if e.get("ph") == "X" and "dur" in e]
  steps = sorted(
    (e for e in spans if e["name"] == STEP_SPAN), key=lambda e: e["ts"]
  )
  if not steps:
    raise ValueError(f"{path}: no {STEP_SPAN!r} spans (not from capture?)")
  n = len(steps)
  host_key = (steps[0]["pid"], steps[0]["tid"])
  start, end = steps[0]["ts"], steps[-1]["ts"] + steps[-1]["dur"]
  in_window = [e for e in spans if start <= e["ts"] <= end]
  host = [e for e in in_window if (e["pid"], e["tid"]) == host_key]
  ops = _outermost(
    e
    for e in host
    if e["name"].startswith(OP_PREFIX) and e["name"] != STEP_SPAN
  )
  dispatch = _outermost(e for e in host if e["name"].startswith("PjitFunction"))
  kinds = collections.defaultdict(lambda: [0, 0.0, 0.0])
  for op in ops:
    kind = op["name"][len(OP_PREFIX) :].split()[0]
    jitted = sum(e["dur"] for e in _inside(dispatch, op))
    kinds[kind][0] += 1
    kinds[kind][1] += op["dur"]
    kinds[kind][2] += jitted
  phases = collections.Counter()
  inner = [
    e
    for e in host
    if not e["name"].startswith((OP_PREFIX, "PjitFunction", "$"))
    and e["name"] != STEP_SPAN
  ]
  for d in dispatch:
    for e in _inside(inner, d):
      phases[e["name"]] += e["dur"]
  devices = {}
  for pid, name in sorted(process.items()):
    if not name.startswith("/device:"):
      continue
    rows = {t: tn for (p, t), tn in thread.items() if p == pid}
    mine = [e for e in in_window if e["pid"] == pid]
    streams = {t for t, tn in rows.items() if "stream" in tn.lower()}
    kernels = [e for e in mine if e["tid"] in streams] if streams else mine
    modules = collections.Counter()
    for e in mine:
      if "module" in rows.get(e["tid"], "").lower():
        modules[e["name"]] += e["dur"]
    devices[name] = {
      "busy_us": _union_us((e["ts"], e["ts"] + e["dur"]) for e in kernels) / n,
      "kernels_per_step": len(kernels) / n,
      "top_modules_us": {k: v / n for k, v in modules.most_common(top)},
    }
  return {
    "steps": n,
    "wall_us": sum(s["dur"] for s in steps) / n,
    "host_busy_us": _union_us((e["ts"], e["ts"] + e["dur"]) for e in ops) / n,
    "ops": {
      kind: {
        "per_step": count / n,
        "us_each": total / count,
        "dispatch_us_each": jitted / count,
        "python_us_each": (total - jitted) / count,
      }
      for kind, (count, total, jitted) in sorted(kinds.items())
    },
    "dispatch_phases_us": {k: v / n for k, v in phases.most_common(top)},
    "devices": devices,
  }


def table(rows: dict[str, dict]) -> str:
  """The breakdowns of several runs (``{label: breakdown}``), per op kind,
  as text."""
  lines = [
    f"{'run':>12} {'kind':>8} {'per step':>8} {'us each':>9} "
    f"{'dispatch':>9} {'python':>8}"
  ]
  for label, b in rows.items():
    busy = ", ".join(
      f"{d}: {v['busy_us'] / 1e3:.1f} ms" for d, v in b["devices"].items()
    )
    lines.append(
      f"{label:>12} step {b['wall_us'] / 1e3:.1f} ms, host busy "
      f"{b['host_busy_us'] / 1e3:.1f} ms" + (f", device {busy}" if busy else "")
    )
    for kind, o in b["ops"].items():
      lines.append(
        f"{'':>12} {kind:>8} {o['per_step']:>8.1f} {o['us_each']:>9.1f} "
        f"{o['dispatch_us_each']:>9.1f} {o['python_us_each']:>8.1f}"
      )
  return "\n".join(lines)
