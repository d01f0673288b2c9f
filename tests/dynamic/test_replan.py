"""DynPipe's decision rules against plain restatements: the trigger, the
candidate cuts, the 1F1B score (against jpipe's own event simulator) and
the re-partitions (against brute force over every split)."""

import itertools

import numpy as np
import pytest

from jpipe import dynamic
from jpipe import schedule as schedule_lib


def test_trigger_ratios_reference_and_rebase():
  trigger = dynamic.Trigger(high=2.0, low=0.5, warmup_windows=1)
  assert trigger.add([9.0, 9.0]) is None  # warm-up: ignored
  assert trigger.add([1.0, 2.0]) is None  # the reference
  assert trigger.add([1.9, 1.1]) is None  # inside (0.5, 2): no trigger
  got = trigger.add([1.0, 4.4])
  np.testing.assert_allclose(got, [1.0, 2.2])  # 1.0 kept, 2.2 triggers
  got = trigger.add([0.5, 2.0])
  np.testing.assert_allclose(got, [0.5, 1.0])  # <= low triggers
  trigger.rebase()
  assert trigger.add([3.0, 3.0]) is None  # warm-up again
  assert trigger.add([3.0, 3.0]) is None  # new reference
  assert trigger.add([3.0, 5.0]) is None
  with pytest.raises(ValueError, match="low < 1 < high"):
    dynamic.Trigger(high=0.9)


def test_clamped_ratios_is_dynpipes_rule():
  window, reference = np.array([1.0, 3.0, 0.4, 1.5]), np.ones(4)
  want = []
  for w, r in zip(window, reference, strict=True):
    ratio = w / r
    want.append(ratio if ratio >= 2 or ratio <= 0.5 else 1.0)
  np.testing.assert_allclose(dynamic.clamped_ratios(window, reference), want)
  assert dynamic.triggers(want) and not dynamic.triggers([1.0, 1.9])


def test_candidate_cuts_are_the_top_k_heaviest_per_stage():
  rng = np.random.default_rng(0)
  weights = rng.uniform(1, 10, 20)
  boundaries = (0, 6, 11, 20)
  for k in (1, 2, 3):
    want = set()
    for a, b in zip(boundaries[:-1], boundaries[1:], strict=True):
      ranked = sorted(range(a, b), key=lambda i: -weights[i])
      want.update(i + 1 for i in ranked[:k])
    want -= {0, 20}
    assert dynamic.candidate_cuts(weights, boundaries, k) == sorted(want)


def test_node_weights_add_the_transfers_in_and_out():
  f, b, c = (
    np.array([1.0, 2, 3]),
    np.array([2.0, 4, 6]),
    np.array([0.1, 0.2, 9]),
  )
  # Node 0: no input; node 2: no output (its own comm is unused).
  np.testing.assert_allclose(
    dynamic.node_weights(f, b, c), [3 + 0.1, 6 + 0.1 + 0.2, 9 + 0.2]
  )


@pytest.mark.parametrize(
  "forward,backward,comm",
  [
    ([1, 1, 1, 1], [2, 2, 2, 2], None),
    ([1, 1, 3, 1], [2, 2, 6, 2], None),
    ([0.5, 2.0, 1.0], [1.5, 3.0, 2.5], None),
    ([1, 2], [2, 3], [0.7]),
  ],
)
def test_dynpipe_score_matches_jpipes_event_simulation(forward, backward, comm):
  """DynPipe's 1F1B recurrence against jpipe.schedule.simulate of a 1F1B
  schedule of 99 microbatches: the same mean gap between stage 0's
  forwards k*S apart."""
  n, m = len(forward), 99
  lists = schedule_lib.build("1f1b", n, m)
  timeline = schedule_lib.simulate(
    lists,
    forward,
    backward,
    comm_seconds=0.0 if comm is None else comm[0],
  )
  starts = {
    a.microbatch: t
    for a, t in timeline.start.items()
    if a.stage == 0 and a.kind == schedule_lib.FORWARD
  }
  gaps = [
    (starts[k * n] - starts[(k - 1) * n]) / n for k in range(1, 98 // n + 1)
  ]
  got = dynamic.dynpipe_score(forward, backward, comm, m)
  assert got == pytest.approx(np.mean(gaps), rel=1e-9)


def _brute_force(compute, stages, slowdown):
  n, best = len(compute), (None, np.inf)
  for cuts in itertools.combinations(range(1, n), stages - 1):
    split = (0, *cuts, n)
    worst = max(
      slowdown[s] * sum(compute[split[s] : split[s + 1]]) for s in range(stages)
    )
    if worst < best[1] - 1e-12:
      best = (split, worst)
  return best


def test_jpipe_split_is_the_best_of_every_split():
  rng = np.random.default_rng(1)
  for _ in range(5):
    f = rng.uniform(0.5, 2.0, 9)
    b = 2 * f
    slowdown = rng.choice([1.0, 1.0, 3.0], 3)
    split, bottleneck = dynamic.jpipe_split(f, b, slowdown)
    want_split, want = _brute_force(f + b, 3, slowdown)
    assert bottleneck == pytest.approx(want)
    costs = dynamic.stage_costs(f + b, split, slowdown)
    assert max(costs) == pytest.approx(want)


def test_dynpipe_split_is_the_best_candidate_and_moves_off_the_slowed():
  f, b = np.ones(12), 2 * np.ones(12)
  current = (0, 3, 6, 9, 12)
  slowdown = [1.0, 3.0, 1.0, 1.0]
  split, score = dynamic.dynpipe_split(f, b, current, slowdown, top_k=2)
  cuts = dynamic.candidate_cuts(dynamic.node_weights(f, b), current, 2)
  scores = {
    c: dynamic.dynpipe_score(
      dynamic.stage_costs(f, (0, *c, 12), slowdown),
      dynamic.stage_costs(b, (0, *c, 12), slowdown),
    )
    for c in itertools.combinations(cuts, 3)
  }
  assert score == pytest.approx(min(scores.values()))
  assert split[2] - split[1] < 3  # The slowed stage holds fewer nodes.
  assert score < dynamic.dynpipe_score(
    dynamic.stage_costs(f, current, slowdown),
    dynamic.stage_costs(b, current, slowdown),
  )


def test_predicted_step_time_favours_the_rebalanced_split():
  f, b = np.ones(12), 2 * np.ones(12)
  slowdown = [1.0, 3.0, 1.0, 1.0]
  split, _ = dynamic.jpipe_split(f, b, slowdown)
  before = dynamic.predicted_step_seconds(f, b, (0, 3, 6, 9, 12), slowdown)
  after = dynamic.predicted_step_seconds(f, b, split, slowdown)
  assert after < 0.7 * before


def test_boundaries_round_trip():
  of = (0, 0, 1, 1, 1, 2)
  assert dynamic.boundaries_of(of) == (0, 2, 5, 6)
  assert dynamic.stage_of_node((0, 2, 5, 6)) == of
  with pytest.raises(ValueError, match="straight plan"):
    dynamic.boundaries_of((0, 1, 0))


def test_dynpipe_split_keeps_the_split_in_force_on_a_tie():
  """Node 2 is free: cutting after node 1 or node 2 gives the same
  stages' costs; DynPipe's argmin would take the first (a move for
  nothing), jpipe's reading keeps the split in force."""
  f = np.array([1.0, 1.0, 0.0, 1.0, 1.0])
  current = (0, 3, 5)
  new, score = dynamic.dynpipe_split(f, f, current, [1.0, 1.0], top_k=3)
  assert new == current
  other, other_score = dynamic.dynpipe_split(
    f, f, (0, 1, 5), [1.0, 1.0], top_k=3
  )
  assert other == (0, 2, 5) and other_score == score  # From elsewhere: moves.
