"""Model state per replica of a round-robin group (PipeDream's 1F1B-RR
with e.g. BatchNorm statistics).

In PipeDream each replica of a replicated stage is its own model copy
(torch DDP without SyncBatchNorm): it keeps its own running statistics,
updated only by the microbatches it runs. So a model-state leaf that a
round-robin stage of k replicas reads or writes is held k times: replica
0's copy is the pipeline's ``model_state`` leaf (what leaves the
pipeline: gathered, saved, evaluated -- PipeDream saves and evaluates
from each stage's first rank), replicas 1..k-1's copies are kept beside
it (``PipelineState.replica_model_state``). Microbatch b's forward reads
and writes replica ``b mod k``'s copy. A state without those copies (a
fresh or loaded one) has every replica at the ``model_state`` value.
"""

import math
from collections.abc import Sequence


def round_robin_leaves(
  specs, placement, num_batch_leaves, num_state_leaves=None
) -> dict[int, int]:
  """``{model-state leaf: replicas}`` of the leaves that round-robin
  stages read or write (``specs``: the stages' ``StageSpec``s; results
  past the ``num_state_leaves`` model-state leaves are the loss's aux
  outputs; None: none are). Raises ValueError where another stage also
  reads or writes such a leaf."""
  touched = {}  # leaf -> stages that read or write it
  last = math.inf if num_state_leaves is None else num_state_leaves
  for s, spec in enumerate(specs):
    leaves = {i - num_batch_leaves for i in spec.batch_leaves}
    leaves |= {r - 1 for r in spec.results if 0 < r <= last}
    for i in leaves:
      if i >= 0:
        touched.setdefault(i, set()).add(s)
  out = {}
  for i, stages in sorted(touched.items()):
    rr = [s for s in sorted(stages) if placement[s].round_robin]
    if rr and len(stages) > 1:
      raise ValueError(
        f"model-state leaf {i} is read or written by stages "
        f"{sorted(stages)}, and stage {rr[0]} is a round-robin replica "
        "group (its replicas keep their own copies): keep each model "
        "state on one stage, or use replica_routing='split'"
      )
    if rr:
      out[i] = len(placement[rr[0]].devices)
  return out


def unpack(saved: Sequence, model_state: Sequence, leaves: dict) -> dict:
  """``{(leaf, j): replica j's copy}`` for j >= 1 of each of ``leaves``
  (``round_robin_leaves``), from a state's ``replica_model_state``
  (``saved``; empty: every copy is the ``model_state`` leaf's value)."""
  if not saved:
    return {
      (i, j): model_state[i] for i, k in leaves.items() for j in range(1, k)
    }
  return {
    (i, j): saved[i][j - 1] for i, k in leaves.items() for j in range(1, k)
  }


def pack(copies: dict, num_leaves: int, leaves: dict) -> tuple:
  """``PipelineState.replica_model_state`` from ``unpack``'s dict: per
  model-state leaf, replicas 1..k-1's copies (empty for a leaf of no
  round-robin stage); empty without such leaves."""
  if not leaves:
    return ()
  return tuple(
    tuple(copies[(i, j)] for j in range(1, leaves[i])) if i in leaves else ()
    for i in range(num_leaves)
  )
