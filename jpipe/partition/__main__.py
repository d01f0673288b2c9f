"""Partition a PipeDream profile or a training config's model.

  python -m jpipe.partition --pipedream-profile PATH
      (--stages N | --machines M1 [M2 ..])
      [--method pipedream|contiguous|mixed] [--straight]
      [--bandwidth B1 [B2 ..]] [--memory BYTES] [--use-memory-constraint]
      [--use-fewer-machines] [--activation-compression-ratio R]
      [--compress-branches] [--json] [--png FILE]
  python -m jpipe.partition --config configs/X.py[:VARIANT] --stages N
      [--method contiguous|mixed|pipedream|pipedream_hybrid]
      [--bandwidth B] [--memory BYTES]
      [--cost-model analytic|xla|measured] [--json] [--png FILE]

``pipedream`` (the default) is PipeDream's optimizer: a DP over the graph's
antichains with stage replication (``--straight``: none), levels of
machines innermost first (``--machines 4 4``: 4 servers of 4 GPUs), one
bandwidth per level (default 1e9 bytes/s); transfers between stages count
only with ``--activation-compression-ratio``, as in PipeDream.
``contiguous`` is the exact min-max split of one topological order
(straight); ``mixed`` is FTPipe's mixed pipe (N devices, possibly more
stages). For these two, ``--bandwidth`` defaults to compute only.

``--config`` traces the config's model on one microbatch of its data and
costs its nodes as ``python -m jpipe.train`` would (``--method`` and
``--cost-model`` and ``--bandwidth`` default to the config's
``pipeline.partition``, ``pipeline.cost_model`` and
``pipeline.bandwidth``), then prints the plan that training would use on
N devices (for a config, ``pipedream`` is straight and
``pipedream_hybrid`` may replicate stages). Its ``--json`` adds ``plan``
(the full ``jpipe.partition.Plan``).
"""

import argparse
import json
import sys
import time

import numpy as np

from jpipe.partition._contiguous import solve_contiguous
from jpipe.partition._graph_txt import load_pipedream_profile
from jpipe.partition._mixed import solve_mixed
from jpipe.partition._pipedream import solve_pipedream

METHODS = ("pipedream", "contiguous", "mixed")


def _parser():
  parser = argparse.ArgumentParser(
    prog="python -m jpipe.partition", description=__doc__.splitlines()[0]
  )
  source = parser.add_mutually_exclusive_group(required=True)
  source.add_argument(
    "--pipedream-profile", help="a PipeDream graph.txt (or its folder)"
  )
  source.add_argument(
    "--config", help="a training config, configs/X.py[:VARIANT]"
  )
  size = parser.add_mutually_exclusive_group(required=True)
  size.add_argument(
    "--stages", type=int, help="devices (one level of machines)"
  )
  size.add_argument(
    "--machines",
    type=int,
    nargs="+",
    help="machines per level, innermost first (pipedream's -n)",
  )
  parser.add_argument(
    "--method",
    default=None,
    help=f"profiles: one of {METHODS}, default pipedream; configs: also "
    "pipedream_hybrid, default the config's",
  )
  parser.add_argument(
    "--cost-model",
    default=None,
    help="--config: analytic, xla or measured (default: the config's)",
  )
  parser.add_argument(
    "--straight", action="store_true", help="no stage replication"
  )
  parser.add_argument(
    "--bandwidth",
    type=float,
    nargs="+",
    default=None,
    help="link bytes/s, one per level (pipedream's -b; default 1e9 for "
    "pipedream, compute only otherwise)",
  )
  parser.add_argument(
    "--memory",
    type=float,
    default=None,
    help="bytes per device (contiguous; pipedream's -s with "
    "--use-memory-constraint, default 16e9)",
  )
  parser.add_argument(
    "--use-memory-constraint",
    action="store_true",
    help="pipedream: enforce --memory",
  )
  parser.add_argument(
    "--use-fewer-machines",
    action="store_true",
    help="pipedream: leave machines idle when faster",
  )
  parser.add_argument(
    "--activation-compression-ratio",
    type=float,
    default=None,
    help="pipedream: count transfers, compressed by this ratio (1: raw)",
  )
  parser.add_argument(
    "--compress-branches",
    action="store_true",
    help="pipedream: merge single-in/single-out chains first",
  )
  parser.add_argument(
    "--json", action="store_true", help="print one JSON object"
  )
  parser.add_argument("--png", default=None, help="write a stage-cost PNG")
  return parser


def main(argv=None) -> int:
  parser = _parser()
  args = parser.parse_args(argv)
  if args.config is not None:
    return _main_config(parser, args)
  if args.cost_model is not None:
    parser.error("--cost-model applies to --config only")
  args.method = args.method or "pipedream"
  if args.method not in METHODS:
    parser.error(f"unknown method {args.method!r}: one of {METHODS}")
  machines = [args.stages] if args.stages is not None else args.machines
  if args.method != "pipedream" and (
    len(machines) > 1 or (args.bandwidth and len(args.bandwidth) > 1)
  ):
    parser.error(f"--method {args.method} takes one level of machines")
  try:
    graph = load_pipedream_profile(args.pipedream_profile)
    order, compute, edges = graph.ordered()
    start = time.perf_counter()
    extra = {}
    if args.method == "pipedream":
      solution = _pipedream(graph, machines, args)
      stage_of = solution.stage_of
      stage_time = list(solution.stage_seconds)
      bottleneck = solution.bottleneck_seconds
      starts = np.concatenate([[0], np.cumsum(solution.replicas)])
      devices = [
        list(range(int(a), int(b)))
        for a, b in zip(starts[:-1], starts[1:], strict=True)
      ]
      bound = compute.sum() / int(np.prod(machines))
      if args.straight:
        bound = max(bound, compute.max())
      extra = {
        "replicas": list(solution.replicas),
        "data_parallel_seconds": solution.data_parallel_seconds,
        "speedup_vs_data_parallel": solution.speedup_vs_data_parallel,
        "num_states": solution.num_states,
      }
    else:
      stage_of, stage_time, bottleneck, devices = _one_order(
        graph, order, compute, edges, machines[0], args
      )
      bound = max(compute.sum() / machines[0], compute.max())
    solve_seconds = time.perf_counter() - start
  except ValueError as error:
    print(f"error: {error}", file=sys.stderr)
    return 2
  stage_of_pos = [stage_of[graph.names[node]] for node in order]
  num_stages = len(stage_time)
  costs = np.zeros(num_stages)
  np.add.at(costs, stage_of_pos, compute)
  result = {
    "method": args.method,
    "stage_of": stage_of,
    "stage_devices": devices,
    "stage_costs": costs.tolist(),
    "stage_seconds": list(stage_time),
    "bottleneck": bottleneck,
    "lower_bound": float(bound),
    "sequential": float(compute.sum()),
    "solve_seconds": solve_seconds,
    **extra,
  }
  if args.json:
    print(json.dumps(result))
  else:
    _print(graph, args, machines, result, stage_of_pos)
  if args.png:
    memory = {}
    if graph.parameter_bytes is not None:
      memory["params"] = np.bincount(
        stage_of_pos, graph.parameter_bytes[order], minlength=num_stages
      )
    _plot(costs, stage_time, args.png, memory)
  return 0


def _main_config(parser, args) -> int:
  """The plan ``python -m jpipe.train`` would make for a config."""
  from jpipe.partition._plan import METHODS as PLAN_METHODS
  from jpipe.partition._plan import plan_traced
  from jpipe.train import config_plan

  if args.stages is None:
    parser.error("--config takes --stages N (devices)")
  if args.bandwidth and len(args.bandwidth) > 1:
    parser.error("--config takes one --bandwidth")
  try:
    config = config_plan.load_config_file(args.config)
    method = args.method or config.pipeline.partition
    if method not in PLAN_METHODS:
      raise ValueError(f"unknown method {method!r}: one of {PLAN_METHODS}")
    with config.unlocked():  # The planned devices, as training gets them.
      config.pipeline.num_stages = args.stages
    traced, costs = config_plan.trace_config(
      config, args.cost_model, args.stages, method
    )
    start = time.perf_counter()
    plan = plan_traced(
      traced,
      costs,
      args.stages,
      method=method,
      bandwidth=args.bandwidth[0]
      if args.bandwidth
      else config.pipeline.bandwidth or None,
      memory_limit=args.memory,
    )
    solve_seconds = time.perf_counter() - start
  except ValueError as error:
    print(f"error: {error}", file=sys.stderr)
    return 2
  node_seconds = costs.forward_seconds + costs.backward_seconds
  n = args.stages
  result = {
    "method": method,
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
    "lower_bound": float(max(node_seconds.sum() / n, node_seconds.max())),
    "sequential": plan.sequential_seconds,
    "solve_seconds": solve_seconds,
    "plan": json.loads(plan.to_json()),
  }
  if args.json:
    print(json.dumps(result))
  else:
    stage_of_pos = list(plan.stage_of_node)
    _print_table(
      f"{len(plan.node_names)} nodes of {args.config}, {method}, "
      f"{n} devices, solved in {1e3 * solve_seconds:.1f} ms",
      result,
      stage_of_pos,
    )
    for s in range(plan.num_stages):
      names = [k for k, v in plan.stage_of.items() if v == s]
      print(f"  stage {s}: {', '.join(names)}")
  if args.png:
    memory = {
      "params": plan.stage_param_bytes,
      "activations": plan.stage_activation_bytes,
      "stash": plan.stage_stash_bytes,
    }
    _plot(result["stage_costs"], result["stage_seconds"], args.png, memory)
  return 0


def _pipedream(graph, machines, args):
  bandwidth = args.bandwidth or [1e9]
  return solve_pipedream(
    graph,
    machines,
    bandwidth=bandwidth[0] if len(bandwidth) == 1 else bandwidth,
    memory_bytes=16e9 if args.memory is None else args.memory,
    use_memory_constraint=args.use_memory_constraint,
    straight=args.straight,
    use_fewer_machines=args.use_fewer_machines,
    activation_compression_ratio=args.activation_compression_ratio,
    compress_branches=args.compress_branches,
  )


def _one_order(graph, order, compute, edges, n, args):
  """(stage_of, stage seconds, bottleneck, devices) of contiguous/mixed."""
  bandwidth = args.bandwidth[0] if args.bandwidth else None
  if args.method == "contiguous":
    static = graph.parameter_bytes[order] * 4.0  # params, grads, 2 moments
    solution = solve_contiguous(
      compute,
      n,
      edges=edges,
      bandwidth=bandwidth,
      static_bytes=static,
      activation_bytes=graph.activation_bytes[order],
      memory_limit=args.memory,
    )
    bottleneck = solution.bottleneck_seconds
    devices = list(range(len(solution.stage_seconds)))
  else:
    solution = solve_mixed(compute, n, edges=edges, bandwidth=bandwidth)
    bottleneck = solution.objective_seconds
    devices = list(solution.stage_device)
  pos = solution.stage_of_node()
  stage_of = {graph.names[node]: pos[k] for k, node in enumerate(order)}
  return stage_of, list(solution.stage_seconds), bottleneck, devices


def _print(graph, args, machines, result, stage_of_pos):
  _print_table(
    f"{graph.num_nodes} nodes, {args.method}, machines {machines}, "
    f"solved in {1e3 * result['solve_seconds']:.1f} ms",
    result,
    stage_of_pos,
  )


def _print_table(title, result, stage_of_pos):
  print(title)
  print("stage  devices  nodes  compute ms  stage ms")
  for s, devices in enumerate(result["stage_devices"]):
    shown = devices
    if isinstance(devices, list):
      shown = devices[0] if len(devices) == 1 else f"{devices[0]}-{devices[-1]}"
    print(
      f"{s:5d}  {shown!s:>7}  {stage_of_pos.count(s):5d}  "
      f"{1e3 * result['stage_costs'][s]:10.3f}  "
      f"{1e3 * result['stage_seconds'][s]:8.3f}"
    )
  bottleneck = result["bottleneck"]
  print(
    f"bottleneck {1e3 * bottleneck:.3f} ms, lower bound "
    f"{1e3 * result['lower_bound']:.3f} ms, speed-up "
    f"{result['sequential'] / bottleneck:.2f}x"
  )
  if "replicas" in result:
    print(
      f"replication {'-'.join(map(str, result['replicas']))}, data "
      f"parallel {1e3 * result['data_parallel_seconds']:.3f} ms, speed-up "
      f"vs data parallel {result['speedup_vs_data_parallel']:.2f}x"
    )


def _plot(costs, stage_time, path, memory=None):
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
      values = np.asarray(per_stage, float) / 1e6
      axes[1].bar(x, values, 0.6, bottom=bottom, label=label)
      bottom += values
    axes[1].set_xticks(x)
    axes[1].set_xlabel("stage")
    axes[1].set_ylabel("MB")
    axes[1].legend()
  fig.tight_layout()
  fig.savefig(path, dpi=100)
  plt.close(fig)


if __name__ == "__main__":
  sys.exit(main())
