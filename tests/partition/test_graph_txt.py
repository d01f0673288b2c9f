"""PipeDream profiles load; the CLI partitions them."""

import dataclasses
import json
import os
import re
import subprocess
import sys

import numpy as np
import pytest

from jpipe.partition import PIPEDREAM_PROFILES, _graph_txt
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


def _equal_graphs(a, b):
  for x, y in zip(dataclasses.astuple(a), dataclasses.astuple(b), strict=True):
    if isinstance(x, np.ndarray):
      assert x.dtype == y.dtype and x.tobytes() == y.tobytes()
    else:
      assert x == y


def _mutate(lines, rng):
  """``lines`` with one random edit of the kind a hand-edited or truncated
  profile has."""
  lines = list(lines)
  i = int(rng.integers(len(lines)))
  line = lines[i]
  # Anywhere, or half the time beside a separator or an end.
  ends = [0, 1, len(line) - 1, len(line)]
  ends += [
    m.start() + d for m in re.finditer(" -- |, |=", line) for d in (0, 1)
  ]
  at = int(
    rng.choice(ends) if rng.random() < 0.5 else rng.integers(len(line) + 1)
  )
  at = min(max(at, 0), len(line))
  pieces = [" -- ", ", ", ",", " ", "\t", "[", ";", "]", "x", "1", "\r", "-"]
  kind = int(rng.integers(7))
  if kind == 0:  # a piece inserted
    lines[i] = line[:at] + pieces[int(rng.integers(len(pieces)))] + line[at:]
  elif kind == 1:  # a character dropped
    lines[i] = line[:at] + line[at + 1 :]
  elif kind == 2:  # a line repeated or dropped
    lines.insert(i, line) if rng.random() < 0.5 else lines.pop(i)
  elif kind == 3:  # PipeDream's stage_id suffix, or trailing space
    lines[i] = line + rng.choice([" -- stage_id=3", "  ", "\t"])
  elif kind == 4:  # a blank line of spaces or tabs
    lines.insert(i, rng.choice(["", "  ", "\t", " \t "]))
  elif kind == 5:  # two fields swapped
    parts = line.split(", ")
    if len(parts) > 2:
      parts[1], parts[2] = parts[2], parts[1]
    lines[i] = ", ".join(parts)
  else:  # an edge to a name no node has
    lines.insert(i, "\tnode1 -- nodeX")
  return lines


def _both_parses(path, text):
  """(the column parse or None, the line parse or its error)."""
  fast = _graph_txt._parse_text(text)
  try:
    return fast, _graph_txt._parse_lines(path, text)
  except ValueError as error:
    return fast, error


_NODE = (
  "{} -- Conv -- forward_compute_time=1.5, backward_compute_time=2.0, "
  "activation_size={}, parameter_size=8.000"
)


@pytest.mark.parametrize(
  "extra, read",
  [
    (_NODE.format("node99", "[1.0; 2.0]"), True),  # outputs summed
    (_NODE.format("node99", "4") + " -- stage_id=2", True),
    (_NODE.format("node99", "4") + "  ", True),  # trailing space
    (_NODE.format("node 99", "4"), False),  # a name is \S+
    (_NODE.format("node99", "4").replace("=1.5", "=forward_compute_time=1"), 0),
    (_NODE.format("node99", "4").replace(", b", ",b"), False),
    (_NODE.format("node99", "4").replace("-- C", "-- A -- C"), True),
    (_NODE.format("node1", "4"), False),  # a name twice
    ("\tnode1 -- node99", False),
    ("\tnode1 -- node2 ", True),
    ("\tnode1 --  node2", False),
    ("\tnode1 -- node2 -- node3\n\tnode4", False),  # 4 names, 2 lines
    (" \t ", True),  # a blank line
  ],
)
def test_column_parse_leaves_the_rest_to_the_line_parse(extra, read, tmp_path):
  """Lines the column parse does not read exactly as the regexes would
  go to the line parse: it reads them, or names the bad line."""
  with open(os.path.join(profile_path("gnmt"), "graph.txt")) as f:
    text = f.read().rstrip("\n") + "\n" + extra + "\n"
  path = tmp_path / "graph.txt"
  path.write_text(text)
  fast, slow = _both_parses(str(path), text)
  if not read:
    assert fast is None and isinstance(slow, ValueError)
    with pytest.raises(ValueError, match=re.escape(str(slow))):
      _graph_txt.load_pipedream_profile(str(path))
    return
  if fast is not None:
    _equal_graphs(fast, slow)
  _equal_graphs(_graph_txt.load_pipedream_profile(str(path)), slow)


@pytest.mark.parametrize("name", ["gnmt", "resnet18"])
def test_column_parse_reads_what_the_line_parse_reads(name):
  """``load_pipedream_profile`` splits a file a column at a time and falls
  back to the line-by-line parse (the regexes) on anything else: on the
  shipped file and on edited copies, whatever it reads the line parse
  reads the same way, bit for bit."""
  path = os.path.join(profile_path(name), "graph.txt")
  with open(path) as f:
    text = f.read()
  fast = _graph_txt._parse_text(text)
  assert fast is not None
  _equal_graphs(fast, _graph_txt._parse_lines(path, text))
  rng = np.random.default_rng(0)
  lines, kept = text.split("\n"), 0
  for _ in range(300):
    fast, slow = _both_parses(path, "\n".join(_mutate(lines, rng)))
    if fast is not None:
      kept += 1
      _equal_graphs(fast, slow)
  assert kept > 30  # many edits leave a well-formed file
