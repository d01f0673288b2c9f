r"""FTPipe's acyclic partitioner on PipeDream's branchy profiles.

For inception_v3, NASNet (mobile, large), DenseNet-121 and the ResNets /
ResNeXt, n in {4, 8} straight stages, compute only and 10 GB/s links:

- jpipe's exact contiguous split of one topological order;
- ``acyclic`` (FTPipe's default: stages as acyclic subgraphs; restarts,
  advanced / Fiduccia-Mattheyses / global moves, iterated local search),
  single-level and multilevel;
- PipeDream's DP over antichains, straight (inception after
  ``compress_branches``; NASNet's antichain DAG is too large), and its plan
  re-costed with jpipe's edge model (the like-for-like column on the
  10 GB/s rows, as in ``pipedream_profiles``);
- the lower bound max(total / n, largest node) and solve times.

All columns of a row use the same edge model (``solve_contiguous``'s
"overlapped") except "pipedream (own model)".

Usage: python -m experiments.partition.acyclic_profiles [--quick]
"""

import argparse
import json
import os
import time

from experiments.partition.pipedream_profiles import _ms, pipedream_straight
from jpipe.partition import (
  GraphCosts,
  load_pipedream_profile,
  solve_acyclic,
  solve_contiguous,
)

OUT = os.path.join(os.path.dirname(__file__), "results")
PROFILES = (
  "inception_v3",
  "nasnetamobile",
  "nasnetalarge",
  "densenet121",
  "resnet18",
  "resnet50",
  "resnext50",
)


def rows_for(name, stages, quick):
  graph = load_pipedream_profile(name)
  _, compute, edges = graph.ordered()
  records, rows = [], []
  for n in stages:
    bound = max(compute.sum() / n, compute.max())
    for bandwidth in (None, 10e9):
      start = time.perf_counter()
      costs = GraphCosts(compute, edges=edges, bandwidth=bandwidth)
      contiguous = solve_contiguous(costs, n)
      contiguous_s = time.perf_counter() - start
      acyclic = {}
      for multilevel in (False, True):
        start = time.perf_counter()
        sol = solve_acyclic(
          costs,
          n,
          multilevel=multilevel,
          **({"runs": 1, "kicks": 1} if quick else {}),
        )
        acyclic[multilevel] = (sol, time.perf_counter() - start)
      _, pd_s, pd_ms, pd_edge_ms = (
        (None,) * 4 if quick else pipedream_straight(graph, name, n, bandwidth)
      )
      single, single_s = acyclic[False]
      multi, multi_s = acyclic[True]
      records.append(
        {
          "model": name,
          "nodes": graph.num_nodes,
          "n": n,
          "bandwidth": bandwidth,
          "contiguous_ms": 1e3 * contiguous.bottleneck_seconds,
          "acyclic_ms": 1e3 * single.bottleneck_seconds,
          "acyclic_multilevel_ms": 1e3 * multi.bottleneck_seconds,
          "pipedream_own_model_ms": pd_ms,
          "pipedream_plan_edge_model_ms": pd_edge_ms,
          "lower_bound_ms": 1e3 * bound,
          "contiguous_solve_seconds": contiguous_s,
          "acyclic_solve_seconds": single_s,
          "acyclic_multilevel_solve_seconds": multi_s,
          "pipedream_solve_seconds": pd_s,
        }
      )
      link = "compute" if bandwidth is None else "10 GB/s"
      rows.append(
        f"| {name} | {graph.num_nodes} | {n} | {link} | "
        f"{1e3 * contiguous.bottleneck_seconds:.2f} | "
        f"{1e3 * single.bottleneck_seconds:.2f} | "
        f"{1e3 * multi.bottleneck_seconds:.2f} | {_ms(pd_edge_ms)} | "
        f"{_ms(pd_ms)} | {1e3 * bound:.2f} | {1e3 * contiguous_s:.0f} / "
        f"{single_s:.1f} / {multi_s:.1f} / {_ms(pd_s, 1)} |"
      )
  return records, rows


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument(
    "--quick", action="store_true", help="2 profiles, 4 stages, 1 restart"
  )
  parser.add_argument("--out", default=OUT)
  args = parser.parse_args(argv)
  profiles = ("resnet18", "inception_v3") if args.quick else PROFILES
  stages = (4,) if args.quick else (4, 8)
  records, rows = [], []
  for name in profiles:
    more, lines = rows_for(name, stages, args.quick)
    records += more
    rows += lines
    print(name, flush=True)
  table = (
    "Bottleneck per microbatch (ms); every column in jpipe's edge model "
    "but 'pipedream own model' (PipeDream's cut model). Solve: contiguous "
    "ms / acyclic s / multilevel s / pipedream s.\n\n"
    "| profile | nodes | n | links | contiguous | acyclic | acyclic "
    "multilevel | pipedream plan @ edge model | pipedream own model | lower "
    "bound | solve |\n|---|---|---|---|---|---|---|---|---|---|---|\n"
    + "\n".join(rows)
    + "\n"
  )
  print(table)
  os.makedirs(args.out, exist_ok=True)
  with open(os.path.join(args.out, "acyclic_profiles.md"), "w") as f:
    f.write(table)
  with open(os.path.join(args.out, "acyclic_profiles.json"), "w") as f:
    json.dump(records, f, indent=1)


if __name__ == "__main__":
  main()
