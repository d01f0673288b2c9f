"""PipeDream profiles load; the CLI partitions them."""

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from jpipe.partition import PIPEDREAM_PROFILES
from jpipe.partition._graph_txt import load_pipedream_profile, profile_path

# PipeDream's 14 published profiles, as jpipe ships them (the same files
# as ../shared/profiles/pipedream; no test reads outside the checkout).
FILES = [
  os.path.join(profile_path(name), "graph.txt") for name in PIPEDREAM_PROFILES
]


def test_all_fourteen_profiles_are_present():
  assert len(FILES) == 14


@pytest.mark.parametrize(
  "path", FILES, ids=[p.split(os.sep)[-2] for p in FILES]
)
def test_loads_every_node_and_edge(path):
  with open(path) as f:
    lines = [line for line in f if line.strip()]
  node_lines = [line for line in lines if line.startswith("node")]
  edge_lines = [line for line in lines if line.startswith("\t")]
  graph = load_pipedream_profile(path)
  assert graph.num_nodes == len(node_lines)
  assert len(graph.edges) == len(edge_lines)
  assert np.all(graph.forward_seconds >= 0)
  order = graph.topological_order()
  position = {node: k for k, node in enumerate(order)}
  assert all(position[u] < position[v] for u, v in graph.edges)
  # Milliseconds in the file, seconds here.
  first = node_lines[0].split("forward_compute_time=")[1].split(",")[0]
  name = node_lines[0].split(" -- ")[0]
  assert graph.forward_seconds[graph.names.index(name)] == pytest.approx(
    float(first) / 1e3
  )


def test_multi_output_activations_are_summed():
  graph = load_pipedream_profile(profile_path("gnmt"))
  lstm = graph.names.index("node7")
  assert graph.activation_bytes[lstm] == 6291456.0 + 2 * 131072.0


def test_bad_files(tmp_path):
  with pytest.raises(ValueError, match="no PipeDream profile"):
    load_pipedream_profile(str(tmp_path / "missing.txt"))
  bad = tmp_path / "graph.txt"
  bad.write_text("node1 -- Conv -- forward_compute_time=1.0\n")
  with pytest.raises(ValueError, match="graph.txt:1: not a node or edge"):
    load_pipedream_profile(str(bad))


@pytest.mark.parametrize("method", ["contiguous", "mixed"])
def test_cli_json(method):
  out = subprocess.run(
    [
      sys.executable,
      "-m",
      "jpipe.partition",
      "--pipedream-profile",
      profile_path("resnet18"),
      "--devices",
      "4",
      "--method",
      method,
      "--bandwidth",
      "1e10",
      "--json",
    ],
    check=True,
    capture_output=True,
    text=True,
  ).stdout
  result = json.loads(out)
  graph = load_pipedream_profile(profile_path("resnet18"))
  assert set(result["stage_of"]) == set(graph.names)
  assert result["bottleneck"] >= result["lower_bound"] - 1e-12
  assert result["solve_seconds"] < 5.0
  _, compute, _ = graph.ordered()  # Input nodes cost nothing here.
  assert sum(result["stage_costs"]) == pytest.approx(float(compute.sum()))


def test_cli_errors():
  run = subprocess.run(
    [
      sys.executable,
      "-m",
      "jpipe.partition",
      "--pipedream-profile",
      profile_path("alexnet"),
      "--stages",
      "99",
      "--method",
      "contiguous",
    ],
    capture_output=True,
    text=True,
  )
  assert run.returncode == 2
  assert "cannot split 23 nodes into 99 stages" in run.stderr
  run = subprocess.run(
    [
      sys.executable,
      "-m",
      "jpipe.partition",
      "--pipedream-profile",
      profile_path("alexnet"),
      "--stages",
      "2",
      "--method",
      "metis",
    ],
    capture_output=True,
    text=True,
  )
  assert run.returncode == 2 and "unknown method 'metis'" in run.stderr


@pytest.mark.slow
def test_cli_one_word_for_devices_one_for_stages():
  """--stages is stages: PipeDream's DP (which replicates) refuses it and
  names --devices; a shipped profile's name works from anywhere."""

  def cli(*args):
    return subprocess.run(
      [sys.executable, "-m", "jpipe.partition", *args],
      capture_output=True,
      text=True,
      cwd="/",
    )

  run = cli("--pipedream-profile", "vgg16", "--stages", "4")
  assert run.returncode == 2 and "give --devices N, or --straight" in (
    run.stderr
  )
  run = cli("--pipedream-profile", "vgg16", "--devices", "4", "--json")
  assert run.returncode == 0, run.stderr
  assert json.loads(run.stdout)["replicas"] == [3, 1]  # 2 stages, 4 devices
  run = cli("--pipedream-profile", "vgg16", "--stages", "4", "--straight")
  assert run.returncode == 0 and "replication 1-1-1-1" in run.stdout
  run = cli(
    "--pipedream-profile",
    "vgg16",
    "--stages",
    "4",
    "--devices",
    "2",
    "--method",
    "contiguous",
  )
  assert run.returncode == 2 and "give --devices 4 or omit it" in run.stderr
  run = cli(
    "--pipedream-profile", "vgg16", "--stages", "3", "--method", "mixed"
  )
  assert run.returncode == 2 and "mixed chooses its stages" in run.stderr
  run = cli("--pipedream-profile", "vgg16", "--config", "configs/t5.py")
  assert run.returncode == 2 and "python -m jpipe.train.plan" in run.stderr
  run = cli("--pipedream-profile", "nosuch", "--devices", "2")
  assert run.returncode == 2 and "shipped alexnet" in run.stderr


def test_input_nodes_cost_nothing_when_partitioning():
  graph = load_pipedream_profile(profile_path("alexnet"))
  order, compute, _ = graph.ordered()
  first = graph.names.index("node1")
  assert graph.is_input(first) and graph.forward_seconds[first] > 0.6
  assert compute[order.index(first)] == 0.0
