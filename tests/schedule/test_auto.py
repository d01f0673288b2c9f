"""``schedule="auto"``'s choice (``jpipe.schedule.rank_schedules``)
against a brute-force restatement: every candidate's step time by a
longest path over the action lists (not the event simulator), its peak
memory by counting microbatches open at each point of a device's order,
and the fastest that fits."""

import functools

import numpy as np
import pytest

import jpipe.schedule as sc

FWD, BWD, INP, WGT, UPD = (
  sc.FORWARD,
  sc.BACKWARD,
  sc.INPUT,
  sc.WEIGHT,
  sc.UPDATE,
)


def _step_seconds(lists, forward, backward, inp, comm):
  """Makespan and bubble: each action ends at its cost after the later of
  the previous action on its device and its inputs' arrival."""
  n = lists.num_stages
  cost = {
    FWD: forward,
    BWD: backward,
    INP: inp,
    WGT: np.subtract(backward, inp),
  }
  listed = lists.actions()
  dev = lists.stage_device
  before = {}
  for actions in lists.device_actions:
    for a, b in zip(actions[:-1], actions[1:], strict=True):
      before[b] = a

  def inputs(a):
    s, m = a.stage, a.microbatch
    if a.kind == FWD:
      return [sc.Action(FWD, s - 1, m)] if s else []
    if a.kind in (BWD, INP):
      up = sc.Action(INP, s + 1, m)
      up = up if up in listed else sc.Action(BWD, s + 1, m)
      return [sc.Action(FWD, s, m)] + ([up] if s < n - 1 else [])
    if a.kind == WGT:
      return [sc.Action(INP, s, m)]
    return [b for b in listed if b.stage == s and b.kind in (BWD, WGT)]

  @functools.cache
  def end(a):
    t = end(before[a]) if a in before else 0.0
    for src in inputs(a):
      hop = (
        comm[min(a.stage, src.stage)] if dev[src.stage] != dev[a.stage] else 0
      )
      t = max(t, end(src) + hop)
    return t + (cost[a.kind][a.stage] if a.kind in cost else 0.0)

  makespan = max(end(a) for a in listed)
  busy = sum(cost[a.kind][a.stage] for a in listed if a.kind in cost)
  return makespan, 1 - busy / (lists.num_devices * makespan)


def _peaks(lists, fixed, kept, working, weight_kept=None):
  """Per device: fixed bytes, the most bytes microbatches keep at any
  point of its order (``kept`` between F and B or I, ``weight_kept``
  between I and W), largest working."""
  weight_kept = kept if weight_kept is None else weight_kept
  out = []
  for d, actions in enumerate(lists.device_actions):
    stages = [s for s, x in enumerate(lists.stage_device) if x == d]
    worst = 0.0
    for i in range(len(actions) + 1):
      done = {(a.kind, a.stage, a.microbatch) for a in actions[:i]}
      held = 0.0
      for kind, s, m in done:
        if kind == FWD and not {(BWD, s, m), (INP, s, m)} & done:
          held += kept[s]
        if kind == INP and (WGT, s, m) not in done:
          held += weight_kept[s]
      worst = max(worst, held)
    out.append(
      sum(fixed[s] for s in stages) + worst + max(working[s] for s in stages)
    )
  return out


def _brute_force(
  names, stage_device, m, forward, backward, inp, comm, mem, limit
):
  """(chosen name, {name: (step, peak)}) by the restatements above."""
  rows = {}
  for name in names:
    kind = sc.lookup(name)
    if kind.placement and kind.stage_devices(len(stage_device)) != tuple(
      stage_device
    ):
      continue
    try:
      lists = kind.on_devices(stage_device, m)
    except ValueError:
      continue
    step, bubble = _step_seconds(lists, forward, backward, inp, comm)
    rows[name] = (step, max(_peaks(lists, *mem)), bubble)
  fits = [n for n in rows if limit is None or rows[n][1] <= limit]
  best = min(rows[n][0] for n in fits)
  tied = [n for n in fits if rows[n][0] <= best * (1 + 1e-9)]
  return min(tied, key=lambda n: rows[n][1]), rows


def _rank(names, stage_device, m, forward, backward, inp, comm, mem, limit):
  return sc.rank_schedules(
    [sc.lookup(n) for n in names],
    stage_device,
    m,
    sc.StageCosts(tuple(forward), tuple(backward), tuple(inp), tuple(comm)),
    sc.StageMemoryTerms(*map(tuple, mem)),
    limit,
  )


def _check_against_brute_force(
  names, stage_device, m, f, b, i, comm, mem, limit
):
  choice = _rank(names, stage_device, m, f, b, i, comm, mem, limit)
  want, rows = _brute_force(names, stage_device, m, f, b, i, comm, mem, limit)
  assert choice.chosen == want
  for row in choice.rows:  # Deduplicated lists keep the first name.
    step, peak, bubble = rows[row.name]
    assert row.step_seconds == pytest.approx(step, rel=1e-12)
    assert row.bubble == pytest.approx(bubble, abs=1e-12)
    assert row.peak_bytes == pytest.approx(peak, rel=1e-12)
    assert row.fits == (limit is None or peak <= limit)
  return choice


def _uniform(n, value):
  return [float(value)] * n


def test_weight_heavy_backwards_make_zbh1_win_over_1f1b():
  n, m = 4, 8
  mem = (_uniform(n, 0), _uniform(n, 1), _uniform(n, 0))
  # W three quarters of B: deferred Ws fill 1F1B's bubbles.
  choice = _check_against_brute_force(
    ["1f1b", "zbh1"],
    list(range(n)),
    m,
    _uniform(n, 1),
    _uniform(n, 4),
    _uniform(n, 1),
    _uniform(n - 1, 0),
    mem,
    None,
  )
  assert choice.chosen == "zbh1"
  steps = {r.name: r.step_seconds for r in choice.rows}
  assert steps["zbh1"] < steps["1f1b"]


def test_a_tight_limit_makes_1f1b_win_over_gpipe():
  n, m = 4, 8
  mem = (_uniform(n, 10), _uniform(n, 1), _uniform(n, 2))
  args = (list(range(n)), m, _uniform(n, 1), _uniform(n, 2), _uniform(n, 1))
  comm = _uniform(n - 1, 0.1)  # gpipe's sends overlap: gpipe is faster.
  free = _check_against_brute_force(["gpipe", "1f1b"], *args, comm, mem, None)
  assert free.chosen == "gpipe"
  # 1f1b holds n - s microbatches, gpipe all m: 10 + 4 + 2 < 15 < 10 + 8 + 2.
  tight = _check_against_brute_force(["gpipe", "1f1b"], *args, comm, mem, 16.0)
  assert tight.chosen == "1f1b"
  assert [r.fits for r in tight.rows] == [True, False]


def test_a_limit_nothing_fits_is_one_line_naming_the_smallest_need():
  n, m = 4, 8
  mem = (_uniform(n, 2 * 1024**3), _uniform(n, 1024**3), _uniform(n, 0))
  names = ["gpipe", "1f1b"]
  with pytest.raises(sc.NoScheduleFits) as error:
    _rank(
      names,
      list(range(n)),
      m,
      _uniform(n, 1),
      _uniform(n, 2),
      _uniform(n, 1),
      (),
      mem,
      3 * 1024**3,
    )
  text = str(error.value)
  assert "\n" not in text
  # 1f1b's stage 0 holds 4 microbatches: 2 + 4 GiB (gpipe's all 8).
  assert "the smallest need is '1f1b' at 6.00 GiB (device 0)" in text
  assert "raise the limit" in text


@pytest.mark.parametrize("seed", range(6))
def test_random_costs_choose_as_the_brute_force(seed):
  rng = np.random.default_rng(seed)
  n = int(rng.integers(2, 5))
  m = int(rng.choice([n, 2 * n, 3]))
  f = rng.uniform(0.5, 2, n)
  b = f * rng.uniform(1.5, 3, n)
  i = b * rng.uniform(0.2, 0.8, n)
  comm = rng.uniform(0, 0.5, n - 1)
  mem = (rng.uniform(5, 10, n), rng.uniform(0, 2, n), rng.uniform(0, 1, n))
  if seed % 3 == 0:  # What W reads apart from what F keeps for I.
    mem = (*mem, rng.uniform(0, 3, n))
  limit = float(rng.uniform(8, 20)) if seed % 2 else None
  names = [k.name for k in sc.candidates()]
  try:
    _check_against_brute_force(
      names, list(range(n)), m, f, b, i, comm, mem, limit
    )
  except sc.NoScheduleFits:
    _, rows = _brute_force(names, list(range(n)), m, f, b, i, comm, mem, None)
    assert min(peak for _, peak, _ in rows.values()) > limit


def test_the_v_placement_ranks_zbv_and_dualpipev():
  p, m = 2, 4
  stage_device = list(sc.v_placement(p))
  n = len(stage_device)
  mem = (_uniform(n, 1), _uniform(n, 1), _uniform(n, 0))
  choice = _check_against_brute_force(
    [k.name for k in sc.candidates()],
    stage_device,
    m,
    _uniform(n, 1),
    _uniform(n, 2),
    _uniform(n, 1),
    _uniform(n - 1, 0),
    mem,
    None,
  )
  ranked = {r.name for r in choice.rows}
  assert {"zbv", "dualpipev"} <= ranked
  assert "interleaved_zb" in dict(choice.skipped)  # Not the loop.


def test_streams_are_refused():
  with pytest.raises(ValueError, match="synchronous schedules only"):
    _rank(["async"], [0, 1], 2, [1, 1], [2, 2], [1, 1], (), ([0, 0],) * 3, None)


def test_simulate_takes_a_transfer_time_per_cut():
  lists = sc.build("1f1b", 3, 4)
  same = sc.simulate(lists, 1.0, 2.0, comm_seconds=0.3)
  per_cut = sc.simulate(lists, 1.0, 2.0, comm_seconds=[0.3, 0.3])
  assert per_cut.makespan == same.makespan
  uneven = sc.simulate(lists, 1.0, 2.0, comm_seconds=[0.0, 0.5])
  want, _ = _step_seconds(lists, [1.0] * 3, [2.0] * 3, [1.0] * 3, [0.0, 0.5])
  assert uneven.makespan == pytest.approx(want)
  with pytest.raises(ValueError, match="one per cut"):
    sc.simulate(lists, 1.0, 2.0, comm_seconds=[0.1])
