"""Where each process's device time goes in a multi-process pipeline step:
computing, waiting for a value another process sends, or otherwise idle
(waiting for the host to dispatch, or for a value of its own process).

Input: the actions of profiled steps (``Pipeline.step(profile=True)``),
one list per process, each action's start, end and (where another
process sends its inputs) when those had arrived, all on one clock:
``Timeline.clock_origin`` plus the timeline's seconds (``records``).
Processes of one host share that clock (``time.perf_counter``, i.e.
CLOCK_MONOTONIC on Linux).

A device's idle gap before an action counts as a transfer wait when the
action's remote inputs arrived last of everything it waited for (its
start is their arrival). Then the receiver was idle when the value came,
so the arrival stamp is exact, and arrival minus the producing action's
end at the sender is the transfer's latency (producer: the previous
stage's forward for a forward's activation; the next stage's backward --
or, fused, its forward -- for an input cotangent). A value that arrives
while the receiver is still busy costs nothing and is not timed.

Profiling perturbs what it measures here: before a program donates an
accumulator the previous action made, the host waits until the profiler
has stamped that action, so a receiver asks for its next value only once
its device is done -- a value's latency then includes the host's wait.
``transfer_latencies`` times the transfers of unprofiled steps instead,
from ``jpipe.runtime.TransferTimes`` stamps that no thread waits for.
"""

from collections.abc import Sequence

import numpy as np


def records(timeline) -> list[dict]:
  """A measured ``Timeline``'s actions on the shared clock, as JSON-able
  dicts (kind, stage, microbatch, device, start, end, arrived or None),
  in seconds."""
  o = timeline.clock_origin
  out = []
  for a, start in timeline.start.items():
    arrived = timeline.arrived.get(a)
    out.append(
      {
        "kind": a.kind,
        "stage": a.stage,
        "microbatch": a.microbatch,
        "device": timeline.device_of[a],
        "start": o + start,
        "end": o + timeline.end[a],
        "arrived": None if arrived is None else o + arrived,
      }
    )
  return out


def _producer_end(runs, r):
  """When the action that made ``r``'s remote input ended (None: not
  among the records). Synchronous schedules number each call's
  microbatches from 0: of the runs of that action, the last one to start
  before ``r``'s input arrived made it."""
  s, b = r["stage"], r["microbatch"]
  if r["kind"] == "F":
    keys = [("F", s - 1, b)]
  else:  # An input cotangent: the next stage's backward, or (fused) its
    keys = [("B", s + 1, b), ("F", s + 1, b)]  # forward.
  for key in keys:
    made = [x for x in runs.get(key, ()) if x["start"] <= r["arrived"]]
    if made:
      return max(made, key=_start)["end"]
  return None


def device_waits(per_process: Sequence[Sequence[dict]], steps: int) -> list:
  """Per process, milliseconds per step: ``busy`` (actions running),
  ``transfer_wait`` (idle until a value from another process arrived),
  ``other_idle`` (idle otherwise), over the window from the first start
  to the last end of any process; ``waits`` (the number of transfer
  waits per step) and ``latency_ms`` (median latency of the transfers
  waited for; None if none).

  Args:
    per_process: ``records`` of each process's profiled steps.
    steps: how many steps they cover.
  """
  everything = [r for rs in per_process for r in rs]
  begin = min(r["start"] for r in everything)
  finish = max(r["end"] for r in everything)
  runs = {}  # (kind, stage, microbatch) -> its runs (one per call)
  for r in everything:
    runs.setdefault((r["kind"], r["stage"], r["microbatch"]), []).append(r)
  out = []
  for rs in per_process:
    busy = wait = other = 0.0
    waits, latencies = 0, []
    devices = sorted({r["device"] for r in rs})
    for device in devices:
      mine = sorted((r for r in rs if r["device"] == device), key=_start)
      previous_end = begin
      for r in mine:
        busy += r["end"] - r["start"]
        gap = max(0.0, r["start"] - previous_end)
        previous_end = max(previous_end, r["end"])
        if r["arrived"] is not None and r["arrived"] >= r["start"]:
          wait += gap
          waits += 1
          made = _producer_end(runs, r)
          if made is not None:
            latencies.append(r["arrived"] - made)
        else:
          other += gap
      other += finish - previous_end
    scale = 1e3 / steps / len(devices)
    out.append(
      {
        "busy": busy * scale,
        "transfer_wait": wait * scale,
        "other_idle": other * scale,
        "waits": waits / steps,
        "latency_ms": float(np.median(latencies)) * 1e3 if latencies else None,
      }
    )
  return out


def transfer_latencies(sender_events, receiver_events) -> list[dict]:
  """Per transfer from the sender to the receiver (``jpipe.runtime.TransferTimes``
  events of each): "early", how long before the value existed the
  receiver asked for it (negative: asked after), and "transfer", from
  when both had happened (the value existed and was asked for) to its
  arrival, in seconds; in the order the values were ready."""
  sent, got = {}, {}
  for what, uuid, t in sender_events:
    sent.setdefault(uuid, {})[what] = t
  for what, uuid, t in receiver_events:
    got.setdefault(uuid, {})[what] = t
  out = []
  for uuid, s in sent.items():
    g = got.get(uuid, {})
    if "ready" not in s or "pull" not in g or "arrived" not in g:
      continue
    out.append(
      {
        "ready": s["ready"],
        "early": s["ready"] - g["pull"],
        "transfer": g["arrived"] - max(s["ready"], g["pull"]),
      }
    )
  return sorted(out, key=lambda x: x["ready"])


def _start(r):
  return r["start"]


def table(waits: Sequence[dict]) -> str:
  """``device_waits``' result as a table, a process a row."""
  lines = [
    f"{'':10} {'busy ms':>8} {'transfer wait':>13} {'other idle':>10} "
    f"{'waits':>5} {'latency ms':>10}"
  ]
  for p, w in enumerate(waits):
    latency = "-" if w["latency_ms"] is None else f"{w['latency_ms']:.2f}"
    lines.append(
      f"{'process ' + str(p):10} {w['busy']:>8.1f} "
      f"{w['transfer_wait']:>13.1f} {w['other_idle']:>10.1f} "
      f"{w['waits']:>5.1f} {latency:>10}"
    )
  return "\n".join(lines)
