"""Partition a PipeDream profile from the command line.

  python -m jpipe.partition --pipedream-profile PATH --stages N
      [--method contiguous|mixed] [--straight] [--bandwidth BYTES_PER_S]
      [--memory BYTES] [--json] [--png FILE]

``contiguous`` is the exact min-max split of a topological order (straight:
no stage replication); ``mixed`` is FTPipe's mixed pipe (N devices, possibly
more stages). PipeDream's own antichain DP ("pipedream", with replication)
is not implemented yet.
"""

import argparse
import json
import sys
import time

import numpy as np

from jpipe.partition._contiguous import solve_contiguous
from jpipe.partition._graph_txt import load_pipedream_profile
from jpipe.partition._mixed import solve_mixed

METHODS = ("contiguous", "mixed")


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(
    prog="python -m jpipe.partition", description=__doc__.splitlines()[0]
  )
  parser.add_argument(
    "--pipedream-profile",
    required=True,
    help="a PipeDream graph.txt (or its folder)",
  )
  parser.add_argument(
    "--stages", type=int, required=True, help="devices / pipeline stages"
  )
  parser.add_argument(
    "--method", default="contiguous", help=f"one of {METHODS}"
  )
  parser.add_argument(
    "--straight",
    action="store_true",
    help="no stage replication (always true here)",
  )
  parser.add_argument(
    "--bandwidth",
    type=float,
    default=None,
    help="link bytes/s; default: compute only",
  )
  parser.add_argument(
    "--memory",
    type=float,
    default=None,
    help="bytes per device (contiguous only)",
  )
  parser.add_argument(
    "--json", action="store_true", help="print one JSON object"
  )
  parser.add_argument("--png", default=None, help="write a stage-cost PNG")
  args = parser.parse_args(argv)
  if args.method not in METHODS:
    parser.error(
      f"unknown method {args.method!r}: one of {METHODS}"
      " ('pipedream' is not implemented yet)"
    )
  try:
    graph = load_pipedream_profile(args.pipedream_profile)
    order, compute, edges = graph.ordered()
    start = time.perf_counter()
    if args.method == "contiguous":
      static = graph.parameter_bytes[order] * 4.0  # params, grads, 2 moments
      solution = solve_contiguous(
        compute,
        args.stages,
        edges=edges,
        bandwidth=args.bandwidth,
        static_bytes=static,
        activation_bytes=graph.activation_bytes[order],
        memory_limit=args.memory,
      )
      stage_time = solution.stage_seconds
      bottleneck = solution.bottleneck_seconds
      devices = list(range(len(stage_time)))
    else:
      solution = solve_mixed(
        compute, args.stages, edges=edges, bandwidth=args.bandwidth
      )
      stage_time = solution.stage_seconds
      bottleneck = solution.objective_seconds
      devices = list(solution.stage_device)
    solve_seconds = time.perf_counter() - start
  except ValueError as error:
    print(f"error: {error}", file=sys.stderr)
    return 2
  stage_of_pos = solution.stage_of_node()
  stage_of = {
    graph.names[node]: stage_of_pos[k] for k, node in enumerate(order)
  }
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
    "lower_bound": float(max(compute.sum() / args.stages, compute.max())),
    "sequential": float(compute.sum()),
    "solve_seconds": solve_seconds,
  }
  if args.json:
    print(json.dumps(result))
  else:
    print(
      f"{graph.num_nodes} nodes, {args.method}, {args.stages} devices, "
      f"solved in {1e3 * solve_seconds:.1f} ms"
    )
    print("stage  device  nodes  compute ms  stage ms")
    for s in range(num_stages):
      print(
        f"{s:5d}  {devices[s]:6d}  {stage_of_pos.count(s):5d}  "
        f"{1e3 * costs[s]:10.3f}  {1e3 * stage_time[s]:8.3f}"
      )
    print(
      f"bottleneck {1e3 * bottleneck:.3f} ms, lower bound "
      f"{1e3 * result['lower_bound']:.3f} ms, speed-up "
      f"{result['sequential'] / bottleneck:.2f}x"
    )
  if args.png:
    _plot(costs, stage_time, args.png)
  return 0


def _plot(costs, stage_time, path):
  import matplotlib

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  fig, ax = plt.subplots(figsize=(max(4, 0.6 * len(costs) + 2), 3))
  x = np.arange(len(costs))
  ax.bar(x - 0.2, 1e3 * np.asarray(costs), 0.4, label="compute")
  ax.bar(x + 0.2, 1e3 * np.asarray(stage_time), 0.4, label="stage time")
  ax.set_xlabel("stage")
  ax.set_ylabel("ms per minibatch")
  ax.legend()
  fig.tight_layout()
  fig.savefig(path, dpi=100)
  plt.close(fig)


if __name__ == "__main__":
  sys.exit(main())
