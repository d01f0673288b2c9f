"""Writes ``torch_orders.json``: the action order of each of
torch.distributed.pipelining's multi-stage schedules (Interleaved1F1B,
InterleavedZeroBubble, LoopedBFS, ZBVZeroBubble, DualPipeV) per rank,
for a grid of ranks p, stages per rank v and microbatches m, as torch
computes it (``pipeline_order``, the order its runtime executes) -- or
the error with which torch refuses that (p, v, m).

The tests compare jpipe's schedules with this file, so they need no
torch. Regenerate (after a torch upgrade) with

  pip install -e ".[reference]"   # torch (its CPU build)
  python -m tests.schedule.make_torch_orders

The stages are stand-ins holding only what the schedules' constructors
read (index, count, rank): building the order needs no process group.
Torch's single-stage schedules (GPipe, 1F1B) are left out: their
``pipeline_order`` is a drawing, not what their runtime runs (in 2.14 it
gives the last rank a forward of a microbatch past the last).
"""

import json
import os

import torch
from torch.distributed.pipelining import schedules
from torch.distributed.pipelining.stage import _PipelineStageBase

OUT = os.path.join(os.path.dirname(__file__), "torch_orders.json")

# jpipe's name -> (torch's class, its stages per rank, the placement).
SCHEDULES = {
  "interleaved": ("ScheduleInterleaved1F1B", (2, 3), "loop"),
  "interleaved_zb": ("ScheduleInterleavedZeroBubble", (2, 3), "loop"),
  "looped_bfs": ("ScheduleLoopedBFS", (2, 3), "loop"),
  "zbv": ("ScheduleZBVZeroBubble", (2,), "v"),
  "dualpipev": ("ScheduleDualPipeV", (2,), "v"),
}
RANKS = (1, 2, 3, 4, 8)
MICROBATCHES = (1, 2, 3, 4, 5, 6, 8, 9, 12, 16)

# torch's computation types -> jpipe's action letters.
_KINDS = {
  "FORWARD": "F",
  "FULL_BACKWARD": "B",
  "BACKWARD_INPUT": "I",
  "BACKWARD_WEIGHT": "W",
}


class _Stage(_PipelineStageBase):
  """A stage as the schedules' constructors see it, nothing more."""

  def __init__(self, stage_index, num_stages, ranks, rank):
    self.stage_index, self.num_stages = stage_index, num_stages
    self.group_size, self.group_rank = ranks, rank
    self.group = None
    self.stage_index_to_group_rank = {}
    self.submod = torch.nn.Identity()

  def _create_grad_recv_info(self, *args, **kwargs):
    raise AssertionError("not run")

  def _prepare_backward_infra(self, *args, **kwargs):
    raise AssertionError("not run")

  def _prepare_forward_infra(self, *args, **kwargs):
    raise AssertionError("not run")


def _stages_of(rank, p, v, placement):
  if placement == "loop":
    return [rank + i * p for i in range(v)]
  return [rank, 2 * p - 1 - rank]


def _action(a) -> str:
  """An action as jpipe writes it ("F3.1"); torch's overlapped pair
  (DualPipeV's F and B of two stages) as its two actions, "F3.1+B0.0"."""
  kind = a.computation_type.name
  if kind == "OVERLAP_F_B":
    return "+".join(_action(sub) for sub in a.sub_actions)
  return f"{_KINDS[kind]}{a.stage_index}.{a.microbatch_index}"


def order(cls, p, v, m, placement) -> dict:
  """{"devices": ["action action ..." per rank]}, or {"refused":
  message}."""
  devices = []
  for rank in range(p):
    stages = [
      _Stage(s, p * v, p, rank) for s in _stages_of(rank, p, v, placement)
    ]
    try:
      built = cls(stages, m, loss_fn=lambda out, target: out)
    except (ValueError, AssertionError) as e:
      return {"refused": f"{type(e).__name__}: {e}"}
    ops = built.pipeline_order[rank]
    kinds = {a.computation_type.name for a in ops if a is not None}
    assert kinds <= set(_KINDS) | {"OVERLAP_F_B", "REDUCE_GRAD"}, kinds
    devices.append(
      " ".join(
        _action(a)
        for a in ops
        if a is not None and a.computation_type.name != "REDUCE_GRAD"
      )
    )
  return {"devices": devices}


def main():
  cases = []
  for name, (cls_name, chunks, placement) in SCHEDULES.items():
    cls = getattr(schedules, cls_name)
    for p in RANKS:
      for v in chunks:
        for m in MICROBATCHES:
          case = {"schedule": name, "torch": cls_name, "p": p, "v": v, "m": m}
          cases.append(case | order(cls, p, v, m, placement))
  with open(OUT, "w") as f:
    f.write(f'{{"torch": "{torch.__version__}", "cases": [\n')
    f.write(",\n".join(json.dumps(case) for case in cases))
    f.write("\n]}\n")
  print("wrote", len(cases), "cases to", OUT)


if __name__ == "__main__":
  main()
