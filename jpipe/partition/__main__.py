"""Partition a PipeDream profile (``graph.txt``) onto devices.

  python -m jpipe.partition --pipedream-profile PATH|NAME
      (--devices N | --machines M1 [M2 ..]) [--stages K]
      [--method pipedream|contiguous|acyclic|mixed] [--straight]
      [--bandwidth B1 [B2 ..]] [--memory BYTES] [--use-memory-constraint]
      [--use-fewer-machines] [--activation-compression-ratio R]
      [--compress-branches] [--objective stage_time|edge_cut]
      [--constraint time|memory] [--epsilon E] [--multilevel]
      [--json] [--png FILE]

``--devices`` is always the device count, ``--stages`` always the stage
count. ``pipedream`` (the default) is PipeDream's optimizer: a DP over the
graph's antichains that also chooses the stages, replicating some of them
over several devices (``--straight``: none, one stage per device, so
``--stages K`` means K devices); levels of machines innermost first
(``--machines 4 4``: 4 servers of 4 GPUs), one bandwidth per level (default
1e9 bytes/s); transfers between stages count only with
``--activation-compression-ratio``, as in PipeDream. ``contiguous`` is the
exact min-max split of one topological order into K stages on K devices;
``acyclic`` is FTPipe's default, K stages on K devices, each an acyclic
subgraph of the DAG (``--objective``, ``--constraint``, ``--epsilon``,
``--multilevel`` as FTPipe's partitioner has them); ``mixed`` is FTPipe's mixed pipe (N devices; it chooses the stages,
possibly more than devices). For these three, ``--bandwidth`` defaults to
compute only. A NAME is one of the PipeDream profiles shipped with jpipe
(``vgg16``, ``resnet50``, ``gnmt``, ...: ``jpipe.partition.PIPEDREAM_PROFILES``).

A training config's model: ``python -m jpipe.train.plan --config ...``.
"""

import argparse
import json
import sys
import time

import numpy as np

from jpipe.partition._acyclic import CONSTRAINTS, OBJECTIVES, solve_acyclic
from jpipe.partition._contiguous import solve_contiguous
from jpipe.partition._cost_model import GraphCosts, MemoryModel
from jpipe.partition._graph_txt import load_pipedream_profile
from jpipe.partition._mixed import solve_mixed
from jpipe.partition._pipedream import solve_pipedream
from jpipe.partition._report import plot_plan, print_plan_table

METHODS = ("pipedream", "contiguous", "acyclic", "mixed")


def _parser():
  """The command's flags (module docstring)."""
  parser = argparse.ArgumentParser(
    prog="python -m jpipe.partition", description=__doc__.splitlines()[0]
  )
  parser.add_argument(
    "--pipedream-profile",
    required=True,
    help="a PipeDream graph.txt, its folder, or a shipped profile's name",
  )
  size = parser.add_mutually_exclusive_group()
  size.add_argument("--devices", type=int, help="devices (one level)")
  size.add_argument(
    "--machines",
    type=int,
    nargs="+",
    help="machines per level, innermost first (pipedream's -n)",
  )
  parser.add_argument(
    "--stages",
    type=int,
    default=None,
    help="stages (contiguous, acyclic, or pipedream --straight): one per device",
  )
  parser.add_argument(
    "--method",
    default="pipedream",
    help=f"one of {METHODS} (default pipedream)",
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
    help="bytes per device (contiguous, acyclic, mixed; pipedream's -s with "
    "--use-memory-constraint, default 16e9)",
  )
  _add_pipedream_options(parser)
  _add_acyclic_options(parser)
  parser.add_argument(
    "--json", action="store_true", help="print one JSON object"
  )
  parser.add_argument("--png", default=None, help="write a stage-cost PNG")
  return parser


def _add_pipedream_options(parser) -> None:
  """PipeDream's optimizer's own flags (its names)."""
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


def _add_acyclic_options(parser) -> None:
  """FTPipe's acyclic partitioner's flags."""
  parser.add_argument(
    "--objective",
    default="stage_time",
    choices=OBJECTIVES,
    help="acyclic: minimise the slowest stage or the bytes cut",
  )
  parser.add_argument(
    "--constraint",
    default="time",
    choices=CONSTRAINTS,
    help="acyclic: balance stage time or parameter bytes",
  )
  parser.add_argument(
    "--epsilon",
    type=float,
    default=0.1,
    help="acyclic: no stage above (1 + epsilon) x the mean (default 0.1)",
  )
  parser.add_argument(
    "--multilevel",
    action="store_true",
    help="acyclic: refine a coarsened graph first",
  )


# The solvers' Python spellings, as this command line spells them (a
# profile's nodes are fixed: no depth to trace at).
_FLAG_SPELLINGS = (
  ("use_fewer_machines=True", "--use-fewer-machines"),
  ("memory_bytes=", "--memory "),
  ("drop use_memory_constraint", "drop --use-memory-constraint"),
  ("or allow replication", "or drop --straight"),
  (", or trace the model at a larger depth to get more nodes", ""),
  (", or trace the model at a larger depth", ""),
)


def _as_flags(message: str) -> str:
  for python, flag in _FLAG_SPELLINGS:
    message = message.replace(python, flag)
  return message


def main(argv=None) -> int:
  """The command (module docstring); returns its exit status."""
  parser = _parser()
  if argv is None:
    argv = sys.argv[1:]
  # Before parsing: --pipedream-profile is required, and a config user
  # should learn where the config mode went, not that.
  if "--config" in argv or any(a.startswith("--config=") for a in argv):
    parser.error(
      "a training config's plan moved to: python -m jpipe.train.plan "
      "--config FILE [--stages K] [--devices N]"
    )
  args = parser.parse_args(argv)
  if args.method not in METHODS:
    parser.error(f"unknown method {args.method!r}: one of {METHODS}")
  machines = _machines(parser, args)
  if args.method != "pipedream" and (
    len(machines) > 1 or (args.bandwidth and len(args.bandwidth) > 1)
  ):
    parser.error(f"--method {args.method} takes one level of machines")
  try:
    graph = load_pipedream_profile(args.pipedream_profile)
    order, compute, edges = graph.ordered()
    start = time.perf_counter()
    stage_of, stage_time, bottleneck, devices, bound, extra = _solve(
      graph, (order, compute, edges), machines, args
    )
    solve_seconds = time.perf_counter() - start
  except ValueError as error:
    print(f"error: {_as_flags(str(error))}", file=sys.stderr)
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
    plot_plan(costs, stage_time, args.png, memory)
  return 0


def _solve(graph, ordered, machines, args):
  """The method's plan (``ordered``: ``graph.ordered()``): (stage_of
  {name: stage}, stage seconds, the bottleneck's seconds, each stage's
  devices, the lower bound on the bottleneck, the method's extra
  figures)."""
  order, compute, edges = ordered
  if args.method != "pipedream":
    stage_of, stage_time, bottleneck, devices = _one_order(
      graph, order, compute, edges, machines[0], args
    )
    bound = max(compute.sum() / machines[0], compute.max())
    return stage_of, stage_time, bottleneck, devices, bound, {}
  solution = _pipedream(graph, machines, args)
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
  return (
    solution.stage_of,
    list(solution.stage_seconds),
    solution.bottleneck_seconds,
    devices,
    bound,
    extra,
  )


def _machines(parser, args) -> list[int]:
  """Devices per level from --devices / --machines / --stages, with
  --stages meaning stages only where the method fixes one per device."""
  machines = [args.devices] if args.devices is not None else args.machines
  if args.stages is None:
    if machines is None:
      parser.error("give --devices N (or --machines M1 M2 ..)")
    return machines
  if args.method == "mixed":
    parser.error(
      f"--stages {args.stages}: mixed chooses its stages (possibly more "
      "than devices); give --devices N"
    )
  if args.method == "pipedream" and not args.straight:
    parser.error(
      f"--stages {args.stages}: pipedream chooses the stages of its "
      "devices (replicating some); give --devices N, or --straight for "
      f"one stage per device ({args.stages} stages on {args.stages} devices)"
    )
  if machines is not None and machines != [args.stages]:
    parser.error(
      f"--stages {args.stages} with {machines} devices: {args.method} "
      f"puts one stage per device; give --devices {args.stages} or omit it"
    )
  return [args.stages]


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
  """(stage_of, stage seconds, bottleneck, devices) of contiguous,
  acyclic or mixed."""
  bandwidth = args.bandwidth[0] if args.bandwidth else None
  memory = MemoryModel(
    static_bytes=graph.parameter_bytes[order] * 4.0,  # params, grads, Adam
    activation_bytes=graph.activation_bytes[order],
    param_bytes=graph.parameter_bytes[order],
    limit=args.memory,
  )
  if args.method == "contiguous":
    costs = GraphCosts(compute, edges=edges, bandwidth=bandwidth)
    solution = solve_contiguous(costs, n, memory=memory)
    bottleneck = solution.bottleneck_seconds
    devices = list(range(len(solution.stage_seconds)))
  elif args.method == "acyclic":
    costs = GraphCosts(compute, edges=edges, bandwidth=bandwidth)
    solution = solve_acyclic(
      costs,
      n,
      memory=memory,
      objective=args.objective,
      constraint=args.constraint,
      epsilon=args.epsilon,
      multilevel=args.multilevel,
    )
    bottleneck = solution.bottleneck_seconds
    devices = list(range(n))
    pos = solution.stage_of_node
    stage_of = {graph.names[node]: pos[k] for k, node in enumerate(order)}
    return stage_of, list(solution.stage_seconds), bottleneck, devices
  else:  # FTPipe's objective: the transfers compute cannot hide.
    costs = GraphCosts(
      compute, edges=edges, bandwidth=bandwidth, comm_model="ftpipe"
    )
    solution = solve_mixed(costs, n, memory=memory)
    bottleneck = solution.objective_seconds
    devices = list(solution.stage_device)
  pos = solution.stage_of_node()
  stage_of = {graph.names[node]: pos[k] for k, node in enumerate(order)}
  return stage_of, list(solution.stage_seconds), bottleneck, devices


def _print(graph, args, machines, result, stage_of_pos):
  print_plan_table(
    f"{graph.num_nodes} nodes, {args.method}, machines {machines}, "
    f"solved in {1e3 * result['solve_seconds']:.1f} ms",
    result,
    stage_of_pos,
  )


if __name__ == "__main__":
  sys.exit(main())
