"""Writes ``pipedream_reference.json``: what PipeDream's own optimizer
(msr-fiddle/pipedream, ``optimizer/optimizer_graph_hierarchical.py``)
answers for its published profiles under several machine settings --
the pipeline's time per minibatch, the data-parallel time, its printout
of stages per level and each node's stage -- for the tests to hold
``jpipe.partition.solve_pipedream`` to.

  pip install -e ".[reference]"   # graphviz: PipeDream's graph module imports it
  git clone https://github.com/msr-fiddle/pipedream /tmp/pipedream
  python -m tests.partition.make_pipedream_reference --pipedream /tmp/pipedream

Written from PipeDream at 11c40c01. Its modules are imported from the
checkout, not copied, and ``main`` is called as its command line calls
it; its drawing of the partitioned graph (``Graph.to_dot``, which needs
the Graphviz binaries) is skipped, the graph's text (each node's
``stage_id``) is kept. Inception v3's antichain DAG needs PipeDream's
separate branch compression first (its optimizer runs for minutes
without it): it is solved on the graph ``Graph.compress_branches`` makes
of it, as its ``compress_graph_branches.py`` does. The NASNets are left
out: even compressed, their DAGs take its DP minutes.
"""

import argparse
import contextlib
import importlib
import io
import json
import os
import re
import sys
import tempfile

from jpipe.partition._graph_txt import profile_path

OUT = os.path.join(os.path.dirname(__file__), "pipedream_reference.json")

PROFILES = (
  "alexnet densenet121 gnmt gnmt_large resnet101 resnet18 resnet50 "
  "resnext101 resnext50 squeezenet1_0 vgg16"
).split()

# Settings: jpipe's keyword arguments (PipeDream's flags in comments).
SETTINGS = {
  "4": dict(num_machines=[4], bandwidth=[1e9]),  # -n 4 (its defaults)
  "8@10GB/s": dict(num_machines=[8], bandwidth=[1e10]),
  "16@5GB/s": dict(num_machines=[16], bandwidth=[5e9]),
  "4x4": dict(num_machines=[4, 4], bandwidth=[1e10, 1.25e9]),  # -n 4 4
  "4 straight": dict(num_machines=[4], bandwidth=[1e9], straight=True),
  "8 fewer, transfers": dict(  # --use_fewer_machines
    num_machines=[8],
    bandwidth=[1e9],
    use_fewer_machines=True,
    activation_compression_ratio=1.0,
  ),
  "4 memory 2GB": dict(  # --use_memory_constraint -s 2e9
    num_machines=[4],
    bandwidth=[1e9],
    use_memory_constraint=True,
    memory_bytes=2e9,
  ),
}

# PipeDream's DP is pure Python, cubic in the antichain states at an inner
# level and quadratic in the machines: two levels only for the profiles of
# at most 100 states (its solve takes minutes beyond), 16 machines for all
# but GNMT-16 (1,495 states).
SETTING_PROFILES = {
  "4x4": ("alexnet", "gnmt", "resnet18", "squeezenet1_0", "vgg16"),
  "16@5GB/s": tuple(p for p in PROFILES if p != "gnmt_large"),
}

# Profiles whose antichain DAG needs PipeDream's branch compression first
# (``optimizer/scripts/compress_graph_branches.py``: ``Graph.
# compress_branches``); jpipe's ``compress_branches=True``. The NASNets'
# compressed DAGs still take its DP minutes.
COMPRESSED = ("inception_v3",)
COMPRESSED_SETTINGS = ("4", "8@10GB/s", "4 straight")

_STAGE_LINE = re.compile(r"^\((\d+), (\d+)\) (\S+) (\d+)$")


def _import_pipedream(root: str):
  """PipeDream's optimizer module, from the checkout's own folders."""
  sys.path.insert(0, os.path.join(root, "optimizer"))
  sys.path.insert(0, root)
  graph = importlib.import_module("graph")
  optimizer_graph_hierarchical = importlib.import_module(
    "optimizer_graph_hierarchical"
  )

  # (Drawing needs the Graphviz binaries; the text of the graph is kept.
  # check_fidelity is Python 2's: xrange.)
  graph.Graph.to_dot = lambda self, arch: None
  sys.modules["graph.graph"].xrange = range
  return optimizer_graph_hierarchical


def _compressed(optimizer, profile: str, out_dir: str) -> str:
  """PipeDream's branch-compressed graph of a profile, as
  ``compress_graph_branches.py`` writes it: its path."""
  graph = optimizer.graph
  with open(os.path.join(profile_path(profile), "graph.txt")) as f:
    full = graph.Graph.from_str(f.read())
  compressed = full.compress_branches()
  full.check_fidelity(compressed)
  path = os.path.join(out_dir, "compressed.txt")
  with open(path, "w") as f:
    f.write(str(compressed))
  return path


def _stage_ids(graph_txt: str) -> dict[str, int]:
  """node id -> stage_id from PipeDream's partitioned graph text."""
  out = {}
  for line in graph_txt.splitlines():
    found = re.match(r"^(node\d+) -- .* -- stage_id=(\d+)$", line)
    if found:
      out[found.group(1)] = int(found.group(2))
  return out


def solve(optimizer, profile: str, setting: dict, out_dir: str) -> dict:
  levels, current = [], None
  printed = io.StringIO()
  filename = os.path.join(profile_path(profile), "graph.txt")
  if setting.get("compress_branches"):
    filename = _compressed(optimizer, profile, out_dir)
  # Its command line's arguments, which its DP reads as module globals.
  args = dict(
    all_num_machines=setting["num_machines"],
    profile_filename=filename,
    network_bandwidths=setting["bandwidth"],
    memory_size=setting.get("memory_bytes", 16e9),
    straight_pipeline=setting.get("straight", False),
    use_memory_constraint=setting.get("use_memory_constraint", False),
    use_fewer_machines=setting.get("use_fewer_machines", False),
    activation_compression_ratio=setting.get("activation_compression_ratio"),
  )
  vars(optimizer).update(args)
  with contextlib.redirect_stdout(printed):
    pipeline, data_parallel = optimizer.main(
      *args.values(), output_directory=out_dir, verbose=True
    )
  total = 1
  for n in setting["num_machines"]:
    total *= n
  with open(os.path.join(out_dir, f"gpus={total}.txt")) as f:
    # (Of a compressed graph: its merged nodes; not recorded.)
    stage_of = {} if "compress_branches" in setting else _stage_ids(f.read())
  for line in printed.getvalue().splitlines():
    if line.startswith("Level "):
      current = []
      levels.append(current)
    found = _STAGE_LINE.match(line.strip())
    if found and current is not None:
      start, end, seconds, replicas = found.groups()
      current.append([[int(start), int(end)], float(seconds), int(replicas)])
  return {
    "bottleneck_seconds": pipeline,
    "data_parallel_seconds": data_parallel,
    "level_stages": levels[::-1],  # (Printed outermost first.)
    "stage_of": stage_of,
  }


def main():
  parser = argparse.ArgumentParser()
  parser.add_argument("--pipedream", required=True, help="its checkout")
  optimizer = _import_pipedream(parser.parse_args().pipedream)
  cases = []
  runs = [
    (profile, name, setting)
    for profile in PROFILES
    for name, setting in SETTINGS.items()
    if profile in SETTING_PROFILES.get(name, PROFILES)
  ] + [
    (profile, name, dict(SETTINGS[name], compress_branches=True))
    for profile in COMPRESSED
    for name in COMPRESSED_SETTINGS
  ]
  for profile, name, setting in runs:
    case = {"profile": profile, "setting": name, "kwargs": setting}
    try:
      with tempfile.TemporaryDirectory() as out_dir:
        case |= solve(optimizer, profile, setting, out_dir)
    except Exception as e:  # (Recorded: what PipeDream does there.)
      case["error"] = f"{type(e).__name__}: {e}"
    cases.append(case)
    result = case.get("error") or case["bottleneck_seconds"]
    print(profile, name, result, flush=True)
  with open(OUT, "w") as f:
    f.write('{"pipedream": "11c40c01", "cases": [\n')
    f.write(",\n".join(json.dumps(case) for case in cases))
    f.write("\n]}\n")
  print("wrote", len(cases), "cases to", OUT)


if __name__ == "__main__":
  main()
