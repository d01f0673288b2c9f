"""Every built-in schedule's simulated bubble beside its closed form
(issue 63's evidence).

``jpipe.schedule.simulate`` on each schedule's own lists, p devices, m
microbatches, free transfers (``--comm`` to charge them). Every schedule
runs the same model: a device's work per microbatch is F = 1, B = 2
(I = W = 1 where the backward is split), so a schedule placing v stages
per device (``interleaved``, ``looped_bfs`` and ``interleaved_zb`` on the loop
placement, v = ``--chunks``; ``zbv`` and ``dualpipev`` in a V, v = 2) costs each
stage F = 1 / v, B = 2 / v. The bubble is ``1 - work / (p * makespan)``;
"step" is the makespan over a device's work (1.0: no bubble). Closed
forms, where the literature gives one (zero transfer time): GPipe, 1F1B
and Eager 1F1B ``(p - 1) / (m + p - 1)``; interleaved 1F1B with v chunks
``(p - 1) / (v m + p - 1)`` (Narayanan et al. 2021, m a multiple of p);
ZB-H1 ``(p - 1)(F + I - W) / (m (F + I + W) + (p - 1)(F + I - W))`` (Qi
et al. 2024, m >= p); ZB-H2 ``(p - 1) F / (m (F + I + W) + (p - 1) F)``
(a flushed step's least; at F = I = W any m, else m >= 2p - 1); seq
``1 - 1 / p``. "torch": the bubble of
torch.distributed.pipelining 2.13's Interleaved1F1B (2 stages per rank)
as issue 63 measured it. "held": each device's most microbatch-stages
between a forward and its weight gradient (B or W) -- the activations it
keeps. ``async`` and ``2bw`` stream across calls; their row is one call
of m microbatches with its flush (2BW: a step per p microbatches).

  python -m experiments.schedules.bubbles [--devices 2,4,8]
      [--multiples 1,2,4] [--chunks 2] [--comm 0] [--out_dir DIR]

Prints a table; writes ``experiments/schedules/results/bubbles.json``.
"""

import argparse
import json
import os

from jpipe import schedule as sc

RESULTS = os.path.join(os.path.dirname(__file__), "results")
# Issue 63: torch's ScheduleInterleaved1F1B, 2 stages per rank, F = 1,
# B = 2, no transfer time, (p, m) -> bubble.
TORCH_INTERLEAVED = {
  (2, 2): 0.200,
  (2, 4): 0.111,
  (2, 8): 0.059,
  (8, 8): 0.304,
  (8, 16): 0.179,
  (8, 32): 0.099,
}


def formula(name, p, m, v=1):
  """The closed-form bubble at F = I = W = 1 and free transfers, or None
  where the literature gives none (or not for this m)."""
  if name in ("gpipe", "1f1b", "eager1f1b"):
    return (p - 1) / (m + p - 1)
  if name == "interleaved" and m % p == 0:
    return (p - 1) / (v * m + p - 1)
  if (name == "zbh1" and m >= p) or name == "zbh2":
    return (p - 1) * 1 / (m * 3 + (p - 1) * 1)
  if name == "seq":
    return 1 - 1 / p
  return None


def _placed(name, p, m, chunks):
  """The schedule's lists on p devices and its stages per device, or
  None where it does not run (``dualpipev`` needs m >= 2p)."""
  kind = sc.lookup(name)
  if kind.placement is not None:
    if name == "dualpipev" and m < 2 * p:
      return None
    return sc.build(name, 2 * p, m), 2
  if kind.places_itself:
    return sc.build(
      name, chunks * p, m, stage_device=sc.loop_placement(chunks * p, p)
    ), chunks
  kwargs = {"minibatch": p} if kind.two_versions else {}
  return sc.build(name, p, m, **kwargs), 1


def held(schedule):
  """Per device, its most microbatch-stages between F and B (or W)."""
  out = []
  for acts in schedule.device_actions:
    live = peak = 0
    for a in acts:
      live += (a.kind == sc.FORWARD) - (a.kind in sc.WEIGHT_GRADIENT)
      peak = max(peak, live)
    out.append(peak)
  return out


def row(name, p, m, chunks=2, comm=0.0):
  """One schedule on p devices and m microbatches (None: it does not
  run there)."""
  placed = _placed(name, p, m, chunks)
  if placed is None:
    return None
  schedule, v = placed
  t = sc.simulate(schedule, 1.0 / v, 2.0 / v, comm_seconds=comm)
  work = 3.0 * m
  closed = None if comm else formula(name, p, m, v)
  torch = TORCH_INTERLEAVED.get((p, m)) if name == "interleaved" else None
  return {
    "schedule": name,
    "p": p,
    "m": m,
    "stages_per_device": v,
    "bubble": t.bubble,
    "formula": closed,
    "torch": torch if v == 2 and not comm else None,
    "step": t.makespan / work,
    "held": held(schedule),
  }


def _cell(x):
  return "" if x is None else f"{x:.3f}"


def main(argv=None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--devices", default="2,4,8")
  parser.add_argument("--multiples", default="1,2,4", help="m / p")
  parser.add_argument("--chunks", default="2", help="interleaved's v")
  parser.add_argument("--comm", type=float, default=0.0)
  parser.add_argument("--out_dir", default=RESULTS)
  args = parser.parse_args(argv)
  rows = []
  print(
    "| schedule | v | p | m | bubble | formula | torch | step | held |\n"
    "|---|---|---|---|---|---|---|---|---|"
  )
  for p in map(int, args.devices.split(",")):
    for k in map(int, args.multiples.split(",")):
      for name in sc.SCHEDULES:
        loops = sc.lookup(name).places_itself and not sc.lookup(name).placement
        for v in map(int, args.chunks.split(",")) if loops else (None,):
          r = row(name, p, k * p, chunks=v, comm=args.comm)
          if r is None:
            continue
          rows.append(r)
          print(
            f"| {name} | {r['stages_per_device']} | {p} | {k * p} | "
            f"{r['bubble']:.3f} | {_cell(r['formula'])} | "
            f"{_cell(r['torch'])} | {r['step']:.3f} | {r['held']} |"
          )
  os.makedirs(args.out_dir, exist_ok=True)
  path = os.path.join(args.out_dir, "bubbles.json")
  with open(path, "w") as f:
    json.dump({"comm": args.comm, "rows": rows}, f, indent=1)
  print(f"wrote {path}")


if __name__ == "__main__":
  main()
