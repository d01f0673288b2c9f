r"""Partition quality on PipeDream's 14 published profiles.

For n in {2, 4, 8}, compute only and with 10 GB/s links: jpipe's exact
contiguous split of a topological order (straight, no replication) beside
an equal-node split of the same order and the lower bound
max(total / n, largest node), and the solve time. PipeDream's own
antichain DP (with replication) is not implemented yet, so its bottleneck
is not in the table.

Usage: python -m experiments.partition.pipedream_profiles
"""

import glob
import json
import os
import time

import numpy as np

from jpipe.partition import load_pipedream_profile, solve_contiguous
from jpipe.partition._contiguous import stage_seconds

ROOT = os.path.join(
  os.path.dirname(__file__), "..", "..", "..", "shared", "profiles", "pipedream"
)
OUT = os.path.join(os.path.dirname(__file__), "results")


def equal_split_bottleneck(compute, edges, n, bandwidth):
  """Bottleneck of cutting the order into n runs of equal node count."""
  bounds = np.linspace(0, len(compute), n + 1).round().astype(int)
  stage_of = np.repeat(np.arange(n), np.diff(bounds))
  worst = 0.0
  for s in range(n):
    c = compute[stage_of == s].sum()
    t_in = t_out = 0.0
    if bandwidth:
      for (u, v), w in edges.items():
        if stage_of[u] != stage_of[v]:
          t_in += 2 * w / bandwidth if stage_of[v] == s else 0.0
          t_out += 2 * w / bandwidth if stage_of[u] == s else 0.0
    worst = max(worst, float(stage_seconds(c, t_in, t_out, "overlapped")))
  return worst


def main():
  rows, records = [], []
  for path in sorted(glob.glob(os.path.join(ROOT, "*", "graph.txt"))):
    name = path.split(os.sep)[-2]
    graph = load_pipedream_profile(path)
    _, compute, edges = graph.ordered()
    for n in (2, 4, 8):
      bound = max(compute.sum() / n, compute.max())
      for bandwidth in (None, 10e9):
        start = time.perf_counter()
        sol = solve_contiguous(compute, n, edges=edges, bandwidth=bandwidth)
        seconds = time.perf_counter() - start
        equal = equal_split_bottleneck(compute, edges, n, bandwidth)
        record = {
          "model": name,
          "nodes": graph.num_nodes,
          "n": n,
          "bandwidth": bandwidth,
          "bottleneck_ms": 1e3 * sol.bottleneck_seconds,
          "equal_split_ms": 1e3 * equal,
          "lower_bound_ms": 1e3 * bound,
          "solve_seconds": seconds,
        }
        records.append(record)
        link = "compute" if bandwidth is None else "10 GB/s"
        rows.append(
          f"| {name} | {graph.num_nodes} | {n} | {link} | "
          f"{record['bottleneck_ms']:.2f} | {1e3 * equal:.2f} | "
          f"{1e3 * bound:.2f} | {1e3 * seconds:.1f} |"
        )
  table = (
    "| profile | nodes | n | links | jpipe contiguous ms | equal-node "
    "split ms | lower bound ms | solve ms |\n|---|---|---|---|---|---|"
    "---|---|\n" + "\n".join(rows)
  )
  os.makedirs(OUT, exist_ok=True)
  with open(os.path.join(OUT, "pipedream_profiles.md"), "w") as f:
    f.write(table + "\n")
  with open(os.path.join(OUT, "pipedream_profiles.json"), "w") as f:
    json.dump(records, f, indent=1)
  print(table)


if __name__ == "__main__":
  main()
