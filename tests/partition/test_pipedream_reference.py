"""``solve_pipedream`` against PipeDream's own optimizer: for 12 of its
published profiles under up to 7 machine settings (one and two levels,
straight, fewer machines with transfers counted, a memory limit;
Inception v3 on PipeDream's branch-compressed graph),
``pipedream_reference.json`` holds what msr-fiddle/pipedream's
``optimizer_graph_hierarchical.py`` answered (``make_pipedream_reference``
ran it). jpipe reaches the same optimum -- time per minibatch and the
data-parallel time it is compared with -- in all 73, with a plan whose
every stage fits under it.

The plans are compared by each node's stage, not by PipeDream's printed
state ranges: it numbers the antichain states in the iteration order of
Python sets, which changes from run to run (two runs of it printed
different ranges for the same partition in 35 of 70 cases). Where several
plans reach the optimum, PipeDream keeps the first strictly better one in
that order too, so the plans may differ there."""

import functools
import json
import os

import pytest

from jpipe import partition
from jpipe.partition._graph_txt import load_pipedream_profile

REFERENCE = os.path.join(os.path.dirname(__file__), "pipedream_reference.json")


@functools.cache
def _cases():
  with open(REFERENCE) as f:
    return json.load(f)["cases"]


def _ids(case):
  return f"{case['profile']} at {case['setting']}"


def _solve(case):
  graph = load_pipedream_profile(case["profile"])
  return partition.solve_pipedream(graph, **case["kwargs"])


def _same_nodes(sol, case) -> bool:
  theirs = case["stage_of"]
  return bool(theirs) and {n: sol.stage_of[n] for n in theirs} == theirs


@pytest.mark.parametrize("profile", sorted({c["profile"] for c in _cases()}))
def test_optima_are_pipedreams(profile):
  for case in _cases():
    if case["profile"] != profile:
      continue
    assert "error" not in case  # (None recorded: every setting solves.)
    sol = _solve(case)
    want = case["bottleneck_seconds"]
    assert sol.bottleneck_seconds == pytest.approx(want, rel=1e-9), _ids(case)
    assert sol.data_parallel_seconds == pytest.approx(
      case["data_parallel_seconds"], rel=1e-9
    ), _ids(case)
    if len(case["kwargs"]["num_machines"]) == 1:
      assert max(sol.stage_seconds) <= want * (1 + 1e-9), _ids(case)
    if _same_nodes(sol, case):  # The same plan: the same stage times.
      ours = [t for _, t, _ in sol.level_stages[0]]
      theirs = [t for _, t, _ in case["level_stages"][0]]
      assert ours == pytest.approx(theirs, rel=1e-9), _ids(case)


def test_most_plans_put_every_node_where_pipedream_does():
  """Ties aside, the same plans: 35 of the 70 with node stages recorded
  (a guard that jpipe's tie-breaking has not drifted)."""
  assert sum(_same_nodes(_solve(c), c) for c in _cases()) >= 35


def test_pipedreams_straight_plans_cost_jpipes_optimum():
  """Where the plans differ they tie: PipeDream's own straight plans,
  each stage's forward + backward summed from the profile as jpipe reads
  it (the inputs and the unused ``__getitem__`` sinks PipeDream removes
  free), peak at jpipe's optimum."""
  for case in _cases():
    if case["setting"] != "4 straight" or not case["stage_of"]:
      continue
    graph = load_pipedream_profile(case["profile"])
    seconds = {}
    for i, name in enumerate(graph.names):
      stage = case["stage_of"].get(name)
      if stage is None or graph.descriptions[i].startswith("Input"):
        continue  # (Removed sinks and the inputs cost PipeDream nothing.)
      cost = graph.forward_seconds[i] + graph.backward_seconds[i]
      seconds[stage] = seconds.get(stage, 0.0) + cost
    assert max(seconds.values()) == pytest.approx(
      _solve(case).bottleneck_seconds, rel=1e-9
    ), _ids(case)
