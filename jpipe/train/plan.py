"""The plan ``python -m jpipe.train`` would use for a config, without training.

  python -m jpipe.train.plan --config configs/X.py[:VARIANT]
      [--stages K] [--devices N]
      [--method contiguous|mixed|pipedream|pipedream_hybrid]
      [--bandwidth B] [--memory SIZE] [--schedule NAME|auto]
      [--cost-model analytic|xla|measured] [--json] [--png FILE]
      [--config.KEY=VALUE ...]

Traces the config's model on one microbatch of its data and costs its nodes
as training does (``--method``, ``--cost-model`` and ``--bandwidth``
default to the config's ``pipeline.partition``, ``pipeline.cost_model``
and ``pipeline.bandwidth``; ``--memory``, bytes or a size such as 16GiB
per device, to the config's ``pipeline.memory_limit``: the partitioner's
1F1B memory model; training checks the built pipeline for its schedule
too), then prints the plan for ``--stages`` stages
(default the config's ``pipeline.num_stages``) on a machine with
``--devices`` devices (default: as many as stages); training, like this,
plans on min(stages, devices) devices (a config whose schedule is ``zbv``
or ``dualpipev``: stages / 2 devices, two stages each, placed in a V).
``pipedream`` is straight and ``pipedream_hybrid`` may replicate stages;
``mixed`` cuts the config's ``pipeline.mixed_blocks`` (FTPipe's L) when
it gives them. It prints the cost model, the speed-up over one device
without recomputation and the stages' work over the bottleneck (FTPipe's
two figures), and the config's ``pipeline.paper_plan`` beside them.
``--schedule auto`` (or a config whose ``schedule.name`` is ``auto``)
also prints the table training's ``auto`` chooses its schedule from.
``--json`` adds ``plan`` (the full ``jpipe.partition.Plan``); ``--png``
draws per-stage cost and memory.
``--config.KEY=VALUE`` overrides a config field as it does for training.
(For a PipeDream profile: ``python -m jpipe.partition``.)
"""

import argparse
import dataclasses
import json
import os
import sys
import time

import numpy as np

from jpipe import partition, runtime
from jpipe import schedule as schedule_lib
from jpipe.train import config_cli, config_options, config_plan, tasks


def _parser():
  parser = argparse.ArgumentParser(
    prog="python -m jpipe.train.plan",
    description=__doc__.splitlines()[0],
    epilog="--config.KEY=VALUE overrides a config field, as for training.",
  )
  parser.add_argument(
    "--config", required=True, help="a training config, configs/X.py[:VARIANT]"
  )
  parser.add_argument(
    "--stages", type=int, default=None, help="stages (default: the config's)"
  )
  parser.add_argument(
    "--devices", type=int, default=None, help="devices (default: --stages)"
  )
  parser.add_argument(
    "--method", default=None, help="default: the config's pipeline.partition"
  )
  parser.add_argument(
    "--cost-model",
    default=None,
    help="analytic, xla or measured (default: the config's)",
  )
  parser.add_argument(
    "--bandwidth",
    type=float,
    default=None,
    help="link bytes/s (default: the config's; 0 = compute only)",
  )
  parser.add_argument(
    "--memory",
    default=None,
    help="bytes per device, e.g. 2e9 or 16GiB (default: the config's "
    "pipeline.memory_limit)",
  )
  parser.add_argument(
    "--schedule",
    default=None,
    help="default: the config's schedule.name; 'auto' also ranks every "
    "synchronous schedule on the plan (step time, bubble, peak memory) "
    "and names the one training would run",
  )
  parser.add_argument(
    "--json", action="store_true", help="print one JSON object"
  )
  parser.add_argument("--png", default=None, help="write a stage-cost PNG")
  return parser


def main(argv=None) -> int:
  args, args.overrides = _parser().parse_known_args(argv)
  folder = os.path.dirname(os.path.abspath(args.png)) if args.png else ""
  if folder and not os.path.isdir(folder):  # Before the plan, not after.
    print(f"error: --png {args.png}: no folder {folder}", file=sys.stderr)
    return 2
  try:
    solved = _solve(args)
  except partition.TooFewNodes as error:  # The line training prints.
    config = config_cli.load_with_overrides(args.config, args.overrides)
    print(f"error: {tasks.too_few_nodes(config, error)}", file=sys.stderr)
    return 2
  except ValueError as error:
    print(f"error: {error}", file=sys.stderr)
    return 2
  result = _result(solved)
  if args.json:
    print(json.dumps(result))
  else:
    _print(args, solved, result)
  if args.png:
    # The bytes the text prints per stage, in its two parts.
    memory = {
      "held (params, optimizer, in flight)": solved.stage_bytes.persistent,
      "working (one microbatch)": solved.stage_bytes.working,
    }
    partition.plot_plan(
      result["stage_costs"], result["stage_seconds"], args.png, memory
    )
  return 0


@dataclasses.dataclass(frozen=True)
class _Solved:
  """A solved plan, what it was solved for and how long it took."""

  plan: partition.Plan
  costs: partition.NodeCosts
  method: str
  devices: int
  seconds: float
  stage_bytes: partition.StageBytes  # Predicted memory per stage.
  memory_limit: float | None
  # The nodes' costs on the last stage (no recomputation), or None.
  last_stage_costs: partition.NodeCosts | None = None
  # schedule "auto": the ranked table and the choice, else None.
  choice: schedule_lib.ScheduleChoice | None = None
  cost_model: str = "analytic"  # How the nodes were costed.
  paper_plan: str = ""  # The config's pipeline.paper_plan.


def _stage_slots(args, config, method):
  """``(stages, devices, slots)`` the command line plans: ``slots`` the
  device of each stage where a V schedule places two per device or a
  loop schedule several (the contiguous method only), else None."""
  stages = config.pipeline.num_stages if args.stages is None else args.stages
  loop = max(1, config.pipeline.stages_per_device)
  devices = -(-stages // loop) if args.devices is None else args.devices
  for name, value in (("--stages", stages), ("--devices", devices)):
    if value < 1:
      raise ValueError(f"{name} must be >= 1, got {value}")
  devices = min(stages, devices)  # What training plans on.
  # auto plans as interleaved does where that loops (more stages than
  # devices), else with one stage per device.
  kind = schedule_lib.REGISTRY.get(
    config.schedule.name, schedule_lib.REGISTRY["interleaved"]
  )
  slots = kind.stage_devices(
    stages, devices if method == "contiguous" else None
  )
  if slots is not None and method == "contiguous":
    return stages, stages, slots
  return stages, devices, None


def _memory_limit(args, config) -> float | None:
  """Bytes per device from ``--memory`` or the config (None: no limit)."""
  memory = config_options.memory_limit(
    config.pipeline.memory_limit if args.memory is None else args.memory
  )
  if memory == "device":
    raise ValueError(
      "--memory device: a plan has no devices to ask; pass bytes (16GiB)"
    )
  return memory


def _method(args, config) -> tuple[str, partition.Split | None]:
  """(The method planned with, the config's Split where it gives one and
  ``--method`` does not replace it: method "split")."""
  given = config_options.partition(config)  # A method, or a Split.
  split = given if args.method is None and not isinstance(given, str) else None
  method = args.method or ("split" if split else config.pipeline.partition)
  if split is None and method not in partition.METHODS:
    raise ValueError(f"unknown method {method!r}: one of {partition.METHODS}")
  if split is not None and (args.stages or args.devices):
    raise ValueError(
      f"--stages / --devices with the config's split {split.describe()}, "
      "which gives both: drop them (or pass --method to solve instead)"
    )
  return method, split


def _planned_config(args):
  """``(config, method, split, devices, slots)``: the config with the
  command line's schedule and stage count, as training gets them."""
  config = config_cli.load_with_overrides(args.config, args.overrides)
  if args.schedule is not None:
    with config.unlocked():
      config.schedule.name = args.schedule
  method, split = _method(args, config)
  if split is not None:
    stages, devices, slots = split.num_stages, split.num_devices, None
  else:
    stages, devices, slots = _stage_slots(args, config, method)
  with config.unlocked():
    config.pipeline.num_stages = stages
  return config, method, split, devices, slots


def _solve(args) -> _Solved:
  """The plan the command line asks for (ValueError: a bad argument)."""
  config, method, split, devices, slots = _planned_config(args)
  cost_model = args.cost_model or config.pipeline.cost_model
  # On shapes (nothing of the model's size allocated, the dataset not
  # read) unless the costs are measured by running the nodes.
  traced, costs, params, last_stage_costs = config_plan.trace_config(
    config,
    cost_model,
    devices,
    "contiguous" if split else method,
    abstract=cost_model != "measured",
    with_last_stage_costs=True,
  )
  bandwidth = config.pipeline.bandwidth
  if args.bandwidth is not None:
    bandwidth = args.bandwidth
  memory = _memory_limit(args, config)

  def plan_for(budget):
    if split is not None:
      return split.plan(traced, costs)
    return partition.plan_traced(
      traced,
      costs,
      devices,
      method=method,
      bandwidth=bandwidth or None,
      memory=budget,
      devices=slots,
      last_stage_costs=last_stage_costs,
      # (The config's block counts are the mixed pipe's: --method other
      # than mixed plans without them.)
      mixed_blocks=config_options.mixed_blocks(config)
      if method == "mixed"
      else None,
    )

  def budget_for(kind=None):
    if memory is None:
      return None
    if slots is not None:  # (A V's per-device memory: checked when built.)
      return partition.MemoryBudget(limit=memory)
    return config_plan.memory_budget(config, params, devices, memory, kind)

  start = time.perf_counter()
  choice = None
  if config.schedule.name == schedule_lib.AUTO:
    plan = runtime.auto_plan(plan_for, budget_for)
    choice = _rank(config, plan, traced, params, bandwidth, memory)
  else:
    plan = plan_for(budget_for())
  seconds = time.perf_counter() - start
  # Each stage's bytes under the whole model (the config's optimizer,
  # schedule -- auto's choice -- recomputation and replica routing),
  # whatever the method kept to.
  kind = choice and schedule_lib.REGISTRY[choice.chosen]
  budget = config_plan.memory_budget(config, params, devices, memory, kind)
  return _Solved(
    plan,
    costs,
    method,
    devices,
    seconds,
    partition.stage_memory_bytes(
      traced, plan, budget, config.pipeline.replica_routing
    ),
    memory,
    last_stage_costs,
    choice,
    cost_model,
    config.pipeline.paper_plan,
  )


def _rank(config, plan, traced, params, bandwidth, memory):
  """Auto's ranked table on ``plan``, as training ranks it."""
  return runtime.rank_for_plan(
    plan,
    traced,
    params,
    config_plan.optimizer_of(config),
    config.pipeline.num_microbatches,
    recompute=config.pipeline.recompute,
    bandwidth=bandwidth or None,
    limit=memory,
    fused_last=config.pipeline.fuse_last_stage,
    grad_accum_dtype=config.optimizer.grad_accum_dtype or None,
  )


def _result(solved: _Solved) -> dict:
  """The plan and its figures, as the JSON output holds them."""
  plan, costs = solved.plan, solved.costs
  node_seconds = costs.forward_seconds + costs.backward_seconds
  if solved.last_stage_costs is not None:  # A node may sit on the last.
    last = solved.last_stage_costs
    node_seconds = np.minimum(
      node_seconds, last.forward_seconds + last.backward_seconds
    )
  lower_bound = node_seconds.sum() / solved.devices
  replicated = any(len(d) > 1 for d in plan.stage_devices)
  if not replicated:  # (Replicas split a node.)
    lower_bound = max(lower_bound, node_seconds.max())
  return {
    "method": solved.method,
    "stage_of": plan.stage_of,
    "stage_devices": [list(d) for d in plan.stage_devices],
    "stage_costs": [
      f + b
      for f, b in zip(
        plan.stage_forward_seconds, plan.stage_backward_seconds, strict=True
      )
    ],
    "stage_seconds": list(plan.stage_seconds),
    "bottleneck": plan.bottleneck_seconds,
    "lower_bound": float(lower_bound),
    "sequential": plan.sequential_seconds,
    # Over one device without recomputation (FTPipe's "vs seq no
    # recomp"), and the stages' own work, as priced, over the bottleneck
    # (its "expected speedup": at most the devices).
    "speedup": plan.sequential_seconds / plan.bottleneck_seconds,
    "speedup_at_stage_costs": float(
      np.sum(plan.stage_forward_seconds) + np.sum(plan.stage_backward_seconds)
    )
    / plan.bottleneck_seconds,
    "cost_model": solved.cost_model,
    "paper_plan": solved.paper_plan,
    "solve_seconds": solved.seconds,
    "stage_memory_bytes": solved.stage_bytes.total.tolist(),
    "stage_working_bytes": solved.stage_bytes.working.tolist(),
    "device_memory_bytes": solved.stage_bytes.per_device(
      solved.plan.stage_devices
    ),
    "memory_limit": solved.memory_limit,
    "plan": json.loads(plan.to_json()),
    "schedule_choice": solved.choice and solved.choice.to_dict(),
  }


def _print(args, solved: _Solved, result: dict) -> None:
  """The plan as a table, then each stage's nodes."""
  plan = solved.plan
  partition.print_plan_table(
    f"{len(plan.node_names)} nodes of {args.config}, {solved.method}, "
    f"{plan.num_stages} stages on "
    f"{len({d for ds in plan.stage_devices for d in ds})} devices, solved in "
    f"{1e3 * solved.seconds:.1f} ms",
    result,
    list(plan.stage_of_node),
  )
  print(
    f"cost model {solved.cost_model!r}: speed-up "
    f"{result['speedup']:.2f}x over one device without recomputation, "
    f"{result['speedup_at_stage_costs']:.2f}x the stages' work as priced "
    "over the bottleneck"
  )
  if solved.paper_plan:
    print(f"the paper: {solved.paper_plan}")
  if plan.indivisible_note:
    print(f"Warning: {plan.indivisible_note}.")
  if solved.choice is not None:
    print("\n".join(solved.choice.table()))
  limit = solved.memory_limit
  print(
    "predicted memory per device (the partitioner's model; training "
    "prints the built programs' own)"
    + (f", limit {runtime.format_bytes(limit)}:" if limit else ":")
  )
  for d, held in result["device_memory_bytes"].items():
    stages = [s for s, ds in enumerate(plan.stage_devices) if d in ds]
    print(
      f"  device {d}: {runtime.format_bytes(held)}"
      + (f" ({100 * held / limit:.0f}%)" if limit else "")
      + f", stages {_ranges(stages)}"
    )
  over = [
    d for d, b in result["device_memory_bytes"].items() if limit and b > limit
  ]
  if over and solved.method == "split":  # Given, not solved.
    print(
      f"  over the limit by this model: devices {_ranges(over)}; the "
      "config's pipeline.split / replicas are taken as given (training "
      "checks the built pipeline and stops before the first step)"
    )
  elif over:  # PipeDream's DP keeps to its own (stash) memory model.
    print(
      f"  over the limit by this model: devices {_ranges(over)}; "
      f"{solved.method!r} keeps to PipeDream's own memory model -- "
      "--method contiguous or mixed keeps to this one (training checks "
      "the built pipeline and stops before the first step)"
    )
  for s in range(plan.num_stages):
    names = [k for k, v in plan.stage_of.items() if v == s]
    print(
      f"  stage {s} ({runtime.format_bytes(solved.stage_bytes.total[s])}): {_ranges_of(names)}"
    )


def _ranges(stages: list[int]) -> str:
  """[0, 1, 2, 5] -> "0-2, 5"."""
  runs, start = [], None
  for i, s in enumerate(stages):
    if start is None:
      start = s
    if i + 1 == len(stages) or stages[i + 1] != s + 1:
      runs.append(str(start) if start == s else f"{start}-{s}")
      start = None
  return ", ".join(runs)


def _ranges_of(names: list[str]) -> str:
  """A stage's node names, the middle elided past 6."""
  if len(names) <= 6:
    return ", ".join(names)
  return f"{', '.join(names[:3])}, ... ({len(names) - 6} more), " + ", ".join(
    names[-3:]
  )


if __name__ == "__main__":
  sys.exit(main())
