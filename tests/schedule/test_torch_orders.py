"""jpipe's multi-stage schedules against torch.distributed.pipelining's
own: ``torch_orders.json`` holds, for 400 (schedule, p, v, m), the order
torch computes for each rank (written by torch itself,
``make_torch_orders.py``); jpipe's builders give each device the same
actions in the same order, and refuse where torch does -- except the
microbatch counts jpipe also runs (interleaved schedules at any m, which
torch refuses unless m // p divides m), which pass the validator, and
ZB-V below 2p - 1 microbatches, where jpipe's order idles less than
torch's."""

import functools
import json
import os

import pytest

from jpipe import schedule as sc

ORDERS = os.path.join(os.path.dirname(__file__), "torch_orders.json")

BUILDERS = {
  "interleaved": lambda p, v, m: sc.interleaved(sc.loop_placement(v * p, p), m),
  "interleaved_zb": lambda p, v, m: sc.interleaved_zero_bubble(
    sc.loop_placement(v * p, p), m
  ),
  "looped_bfs": lambda p, v, m: sc.looped_bfs(sc.loop_placement(v * p, p), m),
  "zbv": lambda p, v, m: sc.zero_bubble_v(sc.v_placement(p), m),
  "dualpipev": lambda p, v, m: sc.dual_pipe_v(sc.v_placement(p), m),
}


@functools.cache
def _cases():
  with open(ORDERS) as f:
    return json.load(f)["cases"]


def _ours(schedule) -> list[str]:
  """Each device's actions as torch's file writes them: no steps (torch
  reduces gradients after its order)."""
  devices = []
  for acts in schedule.device_actions:
    devices.append(" ".join(str(a) for a in acts if a.kind != sc.UPDATE))
  return devices


def _flat(devices: list[str]) -> list[str]:
  """Torch's overlapped pairs (DualPipeV's F and B of two stages, "F+B")
  as the two actions jpipe runs back to back, in that order."""
  return [d.replace("+", " ") for d in devices]


@pytest.mark.parametrize("name", BUILDERS)
def test_orders_are_torchs(name):
  cases = [c for c in _cases() if c["schedule"] == name]
  assert len(cases) >= 50
  for case in cases:
    p, v, m = case["p"], case["v"], case["m"]
    if "refused" in case:
      if name in ("interleaved", "interleaved_zb"):
        sc.check_schedule(BUILDERS[name](p, v, m))  # jpipe runs them.
        assert "multiple of" in case["refused"], case
      else:
        with pytest.raises(ValueError):
          BUILDERS[name](p, v, m)
      continue
    built = BUILDERS[name](p, v, m)
    sc.check_schedule(built)
    if name == "zbv" and m < 2 * p - 1:
      theirs = _schedule(case["devices"], built.stage_device, m)
      ours_t, theirs_t = (sc.simulate(x, 0.5, 1.0) for x in (built, theirs))
      assert ours_t.makespan <= theirs_t.makespan, (p, v, m)
      continue
    assert _ours(built) == _flat(case["devices"]), (p, v, m)


def _schedule(devices: list[str], stage_device, m) -> sc.Schedule:
  """Torch's recorded order as a schedule, each stage's step at the end."""
  lists = []
  for d, line in enumerate(_flat(devices)):
    acts = [sc.Action(a[0], *map(int, a[1:].split("."))) for a in line.split()]
    steps = [s for s, dev in enumerate(stage_device) if dev == d]
    lists.append(acts + [sc.Action(sc.UPDATE, s, m - 1) for s in steps])
  return sc.make_schedule("torch", lists, stage_device, m)
