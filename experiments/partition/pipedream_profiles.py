r"""Partition quality on PipeDream's 14 published profiles.

Table 1 (straight pipelines, no replication), for n in {2, 4, 8}, compute
only and with 10 GB/s links: jpipe's exact contiguous split of one
topological order, an equal-node split of the same order, PipeDream's DP
over antichains (``solve_pipedream(..., straight=True)``, transfers counted
via ``activation_compression_ratio=1`` on the 10 GB/s rows), the lower
bound max(total / n, largest node), and solve times.

The two solvers count transfers differently. jpipe's contiguous model
charges a stage ``max(compute, 2 in / B, 2 out / B)`` with the bytes of the
edges entering and leaving that stage (one edge per consumer, long skips
included). PipeDream charges ``max(compute, 2 cut_before / B, 2 cut_after
/ B)`` with the bytes of its augmented antichains (each tensor once, but
every tensor alive across the cut, also those that skip the stage). So the
table also re-evaluates PipeDream's plan under jpipe's edge model ("pd plan
@ edge model"), the like-for-like comparison. Compute-only rows are the same
model for all columns.

Table 2 (PipeDream's default flags: replication, 1e9 bytes/s, transfers
ignored): PipeDream's stage/replica config and its speed-up over data
parallelism for 4 and 8 machines, and 16 as two levels of 8 (1e9 bytes/s
at both levels).

Inception-v3 needs PipeDream's branch compression (its antichain DAG is
too large otherwise); NASNet's is too large even compressed.

Usage: python -m experiments.partition.pipedream_profiles
"""

import json
import os
import time

import numpy as np

from jpipe.partition import (
  PIPEDREAM_PROFILES,
  GraphCosts,
  load_pipedream_profile,
  solve_contiguous,
  solve_pipedream,
)
from jpipe.partition._cost_model import stage_seconds

OUT = os.path.join(os.path.dirname(__file__), "results")
COMPRESS = ("inception_v3",)  # solved after compress_graph_branches
SKIP = ("nasnetalarge", "nasnetamobile")  # DAG too large even compressed


def plan_bottleneck(stage_of, compute, edges, bandwidth):
  """Bottleneck of a node -> stage assignment (positions in the order)
  under jpipe's edge model (``solve_contiguous``'s "overlapped")."""
  stage_of = np.asarray(stage_of)
  n = int(stage_of.max()) + 1
  c = np.bincount(stage_of, compute, minlength=n)
  t_in, t_out = np.zeros(n), np.zeros(n)
  if bandwidth:
    for (u, v), w in edges.items():
      if stage_of[u] != stage_of[v]:
        t_in[stage_of[v]] += 2 * w / bandwidth
        t_out[stage_of[u]] += 2 * w / bandwidth
  return float(np.max(stage_seconds(c, t_in, t_out, "overlapped")))


def equal_split_bottleneck(compute, edges, n, bandwidth):
  """Bottleneck of cutting the order into n runs of equal node count."""
  bounds = np.linspace(0, len(compute), n + 1).round().astype(int)
  stage_of = np.repeat(np.arange(n), np.diff(bounds))
  return plan_bottleneck(stage_of, compute, edges, bandwidth)


def _pipedream(graph, name, machines, **kwargs):
  """(solution, seconds) or (None, None) where the DAG is too large."""
  if name in SKIP:
    return None, None
  start = time.perf_counter()
  try:
    sol = solve_pipedream(
      graph, machines, compress_branches=name in COMPRESS, **kwargs
    )
  except ValueError:
    return None, None
  return sol, time.perf_counter() - start


def pipedream_straight(graph, name, n, bandwidth):
  """PipeDream's straight DP on ``n`` stages (transfers counted at
  ``bandwidth`` with ratio 1, compute only when None): (solution, solve
  seconds, bottleneck ms in its own cut model, its plan's bottleneck ms
  in jpipe's edge model); Nones where the antichain DAG is too large."""
  pd, seconds = _pipedream(
    graph,
    name,
    n,
    straight=True,
    bandwidth=bandwidth or 1e9,
    activation_compression_ratio=None if bandwidth is None else 1.0,
  )
  if pd is None:
    return None, None, None, None
  order, compute, edges = graph.ordered()
  of = [pd.stage_of[graph.names[node]] for node in order]
  edge_ms = 1e3 * plan_bottleneck(of, compute, edges, bandwidth)
  return pd, seconds, 1e3 * pd.bottleneck_seconds, edge_ms


def straight_rows(name, graph):
  _, compute, edges = graph.ordered()
  records, rows = [], []
  for n in (2, 4, 8):
    bound = max(compute.sum() / n, compute.max())
    for bandwidth in (None, 10e9):
      start = time.perf_counter()
      sol = solve_contiguous(
        GraphCosts(compute, edges=edges, bandwidth=bandwidth), n
      )
      seconds = time.perf_counter() - start
      equal = equal_split_bottleneck(compute, edges, n, bandwidth)
      pd, pd_seconds, pd_ms, pd_edge_ms = pipedream_straight(
        graph, name, n, bandwidth
      )
      records.append(
        {
          "model": name,
          "nodes": graph.num_nodes,
          "n": n,
          "bandwidth": bandwidth,
          "bottleneck_ms": 1e3 * sol.bottleneck_seconds,
          "equal_split_ms": 1e3 * equal,
          "pipedream_straight_ms": pd_ms,
          "pipedream_plan_edge_model_ms": pd_edge_ms,
          "lower_bound_ms": 1e3 * bound,
          "solve_seconds": seconds,
          "pipedream_solve_seconds": pd_seconds,
          "pipedream_states": None if pd is None else pd.num_states,
        }
      )
      link = "compute" if bandwidth is None else "10 GB/s"
      tag = " (c)" if name in COMPRESS else ""
      rows.append(
        f"| {name}{tag} | {graph.num_nodes} | {n} | {link} | "
        f"{1e3 * sol.bottleneck_seconds:.2f} | {1e3 * equal:.2f} | "
        f"{_ms(pd_ms)} | {_ms(pd_edge_ms)} | {1e3 * bound:.2f} | "
        f"{1e3 * seconds:.1f} | {_ms(pd_seconds and 1e3 * pd_seconds, 1)} |"
      )
  return records, rows


def replicated_rows(name, graph):
  records, rows = [], []
  for machines in (4, 8, (8, 2)):
    bandwidth = 1e9 if isinstance(machines, int) else (1e9, 1e9)
    sol, seconds = _pipedream(graph, name, machines, bandwidth=bandwidth)
    label = str(machines) if isinstance(machines, int) else "8x2"
    if sol is None:
      rows.append(f"| {name} | {label} | — | — | — | — | — |")
      continue
    records.append(
      {
        "model": name,
        "machines": machines,
        "config": sol.config(),
        "pipedream_ms": 1e3 * sol.bottleneck_seconds,
        "data_parallel_ms": 1e3 * sol.data_parallel_seconds,
        "speedup_vs_data_parallel": sol.speedup_vs_data_parallel,
        "solve_seconds": seconds,
      }
    )
    tag = " (c)" if name in COMPRESS else ""
    rows.append(
      f"| {name}{tag} | {label} | {sol.config()} | "
      f"{1e3 * sol.bottleneck_seconds:.2f} | "
      f"{1e3 * sol.data_parallel_seconds:.2f} | "
      f"{sol.speedup_vs_data_parallel:.2f}x | {1e3 * seconds:.1f} |"
    )
  return records, rows


def _ms(value, digits=2):
  return "—" if value is None else f"{value:.{digits}f}"


def main():
  straight, replicated = [], []
  straight_table, replicated_table = [], []
  for name in PIPEDREAM_PROFILES:  # The profiles jpipe ships.
    graph = load_pipedream_profile(name)
    records, rows = straight_rows(name, graph)
    straight += records
    straight_table += rows
    records, rows = replicated_rows(name, graph)
    replicated += records
    replicated_table += rows
    print(name, flush=True)
  table = (
    "Straight pipelines. Transfers (10 GB/s rows): jpipe contiguous and "
    "equal split use the edge model (bytes of each stage's in/out edges); "
    "pipedream straight uses PipeDream's cut model (bytes of the augmented "
    "antichain before/after the stage); 'pd plan @ edge model' is "
    "PipeDream's plan re-costed with the edge model. (c): solved after "
    "compress_branches; —: antichain DAG too large.\n\n"
    "| profile | nodes | n | links | jpipe contiguous ms | equal-node "
    "split ms | pipedream straight ms | pd plan @ edge model ms | lower "
    "bound ms | solve ms | pipedream solve ms |\n"
    "|---|---|---|---|---|---|---|---|---|---|---|\n"
    + "\n".join(straight_table)
    + "\n\nReplicated pipelines, PipeDream's default flags (1e9 bytes/s, "
    "transfers ignored; 8x2 = two levels of 8, 1e9 bytes/s each). Config: "
    "machines per stage.\n\n"
    "| profile | machines | config | pipedream ms | data parallel ms | "
    "speed-up vs DP | solve ms |\n|---|---|---|---|---|---|---|\n"
    + "\n".join(replicated_table)
  )
  os.makedirs(OUT, exist_ok=True)
  with open(os.path.join(OUT, "pipedream_profiles.md"), "w") as f:
    f.write(table + "\n")
  with open(os.path.join(OUT, "pipedream_profiles.json"), "w") as f:
    json.dump(
      {"straight": straight, "replicated": replicated}, f, separators=(",", ":")
    )
  print(table)


if __name__ == "__main__":
  main()
