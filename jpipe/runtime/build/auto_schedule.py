"""``schedule="auto"``: the synchronous schedule a solved plan runs fastest
within the memory limit (``jpipe.schedule.rank_schedules`` does the
choosing; this module gives it the plan's numbers).

Auto plans as for ``1f1b`` (its depth, its in-flight counts in the
partitioner's memory model, one stage per device unless the partition is
mixed or a given Plan; more contiguous stages than devices: as for
``interleaved``, in a loop), then ranks every synchronous built-in schedule
that runs on the plan's placement, each at:

- the plan's stage times (the cost model's, or measured ones where the
  plan was costed so): F and B per stage, B split into I = B / 2 and W =
  B / 2 (a weight gradient ``x^T dy`` costs what the input gradient
  ``dy W^T`` does), and with recomputation the recomputed forward in I
  (I = F + (B - F) / 2);
- transfer times: the bytes crossing each cut over the partitioner's
  bandwidth (none without one);
- the partitioner's memory model (``partition.MemoryBudget``: params,
  gradients and optimizer state fixed, each stage's kept activations per
  microbatch in flight, one program's working bytes; between a split
  backward's I and W, the stage's activations) under the limit.

The built pipeline is then checked with its own, finer prediction
(``Pipeline.memory``), as any schedule's is; where that puts auto's
choice over the limit, the pipeline moves down the table to the next
row that fits by both (``ScheduleChoice.over_when_built`` names the
rows passed over).
"""

import dataclasses

import numpy as np

from jpipe import schedule as schedule_lib
from jpipe.runtime.build.memory import partitioner_memory_model
from jpipe.runtime.build.placement import device_name


def provisional_kind(
  num_stages: int, num_devices: int, partition
) -> schedule_lib.ScheduleKind:
  """The schedule auto plans as: 1f1b; with more contiguous stages than
  devices, interleaved (its loop: stage s on device s mod p, where every
  schedule is then ranked)."""
  if partition == "contiguous" and num_stages > num_devices:
    return schedule_lib.REGISTRY["interleaved"]
  return schedule_lib.REGISTRY["1f1b"]


def auto_plan(plan_for, budget_for):
  """The plan auto ranks the schedules on: ``plan_for(budget)`` solved
  under 1f1b's memory (``budget_for(kind)``: the partitioner's
  ``MemoryBudget`` for a schedule, None without a limit), else under
  seq's (one microbatch in flight), else with no memory model, where
  the ranking then names the smallest need."""
  for name in ("1f1b", "seq"):
    try:
      return plan_for(budget_for(schedule_lib.REGISTRY[name]))
    except ValueError as e:
      # The solvers' "no split fits memory_limit=..." (contiguous,
      # mixed) or "no partition fits memory_bytes=..." (pipedream).
      if " fits memory_" not in str(e):
        raise
  return plan_for(None)


def choose_schedule(partitioned, cut, params, request):
  """The request with its schedule chosen (``schedule_kind``,
  ``schedule_name``, ``schedule_choice``); unchanged unless it asked for
  ``auto``. Raises ``jpipe.schedule.NoScheduleFits`` where nothing fits
  the memory limit."""
  if not request.auto_schedule:
    return request
  staleness, partitioning = request.staleness, request.partitioning
  choice = rank_for_plan(
    partitioned.plan,
    cut.traced,
    params,
    request.optimizer,
    request.num_microbatches,
    recompute=staleness.recompute,
    bandwidth=partitioning.bandwidth,
    limit=request.memory_limit,
    fused_last=partitioning.fuse_last_stage,
    allowed=lambda kind: _allowed(kind, staleness),
    grad_accum_dtype=request.grad_accum_dtype,
  )
  kind = schedule_lib.REGISTRY[choice.chosen]
  return dataclasses.replace(
    request,
    schedule_kind=kind,
    schedule_name=kind.name,
    schedule_choice=choice,
  )


def rank_for_plan(
  plan,
  traced,
  params,
  optimizer,
  num_microbatches: int,
  *,
  recompute: bool,
  bandwidth: float | None,
  limit: float | None,
  fused_last: bool,
  allowed=lambda kind: True,
  grad_accum_dtype=None,
) -> schedule_lib.ScheduleChoice:
  """Every synchronous built-in schedule (``allowed(kind)``) ranked on a
  solved plan of ``traced`` (the module docstring says at which costs).

  Args:
    plan: the solved ``jpipe.partition.Plan``.
    traced: the traced model it splits.
    params: the params (or their shapes).
    optimizer: the optax optimizer (its state's bytes per param byte).
    num_microbatches: microbatches per step.
    recompute: backwards recompute their forward.
    bandwidth: bytes/s between devices (None: free transfers).
    limit: bytes per device (None: no limit).
    fused_last: the last stage fuses its backward into its forward.
    allowed: which candidates the run's options allow.
    grad_accum_dtype: the dtype gradients are summed in (None: the
      params'; ``Pipeline``'s).
  """
  firsts = sorted({ds[0] for ds in plan.stage_devices})
  stage_device = [firsts.index(ds[0]) for ds in plan.stage_devices]
  groups = {ds[0]: ds for ds in plan.stage_devices}
  return schedule_lib.rank_schedules(
    [k for k in schedule_lib.candidates() if allowed(k)],
    stage_device,
    num_microbatches,
    plan_costs(plan, traced, bandwidth, recompute),
    memory_terms(
      plan,
      traced,
      params,
      optimizer,
      num_microbatches,
      recompute,
      grad_accum_dtype,
    ),
    limit,
    fused_last=fused_last,
    device_names=[device_name(groups[f]) for f in firsts],
  )


def plan_costs(
  plan, traced, bandwidth, recompute: bool
) -> schedule_lib.StageCosts:
  """The plan's F, B and I per stage and each cut's transfer seconds
  (``bandwidth`` bytes/s; None: free)."""
  fwd = np.asarray(plan.stage_forward_seconds, np.float64)
  bwd = np.asarray(plan.stage_backward_seconds, np.float64)
  recomputed = np.minimum(fwd, bwd) if recompute else np.zeros_like(fwd)
  inp = recomputed + (bwd - recomputed) / 2
  n = plan.num_stages
  comm = ()
  if bandwidth:
    of = np.asarray(plan.stage_of_node)
    crossing = np.zeros(max(n - 1, 0))
    for (u, v), nbytes in traced.edges().items():
      lo, hi = sorted((int(of[u]), int(of[v])))
      crossing[lo:hi] += nbytes  # Every cut between its two stages.
    comm = tuple(float(b) / bandwidth for b in crossing)
  return schedule_lib.StageCosts(
    tuple(fwd.tolist()), tuple(bwd.tolist()), tuple(inp.tolist()), comm
  )


def memory_terms(
  plan,
  traced,
  params,
  optimizer,
  num_microbatches,
  recompute,
  grad_accum_dtype=None,
) -> schedule_lib.StageMemoryTerms:
  """Each stage's fixed, kept-per-microbatch, working and (split
  backwards) weight-kept bytes under the partitioner's memory model
  (``optimizer``'s state, recomputation; one param version:
  synchronous). What a W reads from its I is counted as the stage's
  activations, what it keeps without recomputation: each layer's input
  and output gradient are of their size."""
  n = plan.num_stages
  budget = partitioner_memory_model(
    None,
    optimizer,
    params,
    schedule_lib.REGISTRY["1f1b"],  # (Terms per microbatch: any kind.)
    num_microbatches,
    n,
    recompute=recompute,
    stashes=False,
    fused_last=False,
    grad_accum_dtype=grad_accum_dtype,
  ).per_stage_counts_for(n)

  def per_microbatch(budget):
    model = budget.model(
      traced.node_param_bytes(), traced.node_intermediate_bytes()
    )
    edges = traced.edges()
    none = model.bytes_of(plan.stage_of_node, edges, np.zeros(n))
    one = model.bytes_of(plan.stage_of_node, edges, np.ones(n))
    return none, one.persistent - none.persistent

  none, kept = per_microbatch(budget)
  _, activations = per_microbatch(dataclasses.replace(budget, recompute=False))
  return schedule_lib.StageMemoryTerms(
    tuple(none.persistent.tolist()),
    tuple(kept.tolist()),
    tuple(none.working.tolist()),
    tuple(activations.tolist()),
  )


def _allowed(kind, staleness) -> bool:
  """Whether the staleness options run with ``kind``."""
  try:
    staleness.check(kind)
  except ValueError:
    return False
  return True
