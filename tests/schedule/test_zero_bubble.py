"""Zero-bubble schedules on the action IR: I and W, ZB-H1."""

import pytest

from jpipe import schedule as sc
from jpipe.schedule import FORWARD, INPUT, UPDATE, WEIGHT, Action


def _between(schedule, s, opens, closes):
  """Stage s's most microbatches between an ``opens`` action and a
  ``closes`` one, in its device's order."""
  count = peak = 0
  for a in schedule.device_actions[schedule.stage_device[s]]:
    if a.stage != s:
      continue
    count += (a.kind == opens) - (a.kind == closes)
    peak = max(peak, count)
  return peak


@pytest.mark.parametrize("n, m", [(1, 3), (2, 4), (3, 3), (4, 8), (8, 32)])
def test_zbh1_bubble_is_the_papers_at_1f1b_peak_memory(n, m):
  """Qi et al.'s figures with F = I = W = 1 (B = 2): 1F1B idles
  (n - 1)(F + I + W), ZB-H1 (n - 1)(F + I - W), at m >= n; every stage
  holds at most n microbatches between F and W (1F1B's stage 0 holds n)."""
  zb, one = sc.zero_bubble_h1(n, m), sc.one_f_one_b(n, m)
  work = 3.0 * m  # Per device.
  zb_time = sc.simulate(zb, 1.0, 2.0, input_seconds=1.0).makespan
  one_time = sc.simulate(one, 1.0, 2.0).makespan
  assert one_time - work == 3 * (n - 1)
  assert zb_time - work == 1 * (n - 1)
  assert max(_between(one, s, FORWARD, "B") for s in range(n)) == n
  for s in range(n):
    assert _between(zb, s, FORWARD, WEIGHT) <= n
    assert _between(zb, s, FORWARD, INPUT) == min(n - s, m)


def test_zbh1_is_synchronous_and_applies_every_weight_gradient_once():
  zb = sc.zero_bubble_h1(3, 5)
  assert (zb.delay == 0).all()
  assert zb.step_groups == tuple(((0, 1, 2, 3, 4),) for _ in range(3))
  for s, acts in enumerate(zb.device_actions):
    kinds = [a.kind for a in acts]
    assert kinds.count(INPUT) == kinds.count(WEIGHT) == 5
    assert acts[-1] == Action(UPDATE, s, 4)
    for a in acts:  # W(s, b) after I(s, b) on its device.
      if a.kind == WEIGHT:
        assert acts.index(Action(INPUT, s, a.microbatch)) < acts.index(a)


def test_the_simulator_waits_for_the_next_stages_input_gradient():
  """I(s, b) starts once I(s + 1, b) has ended (not W(s + 1, b)); W
  waits for its own I."""
  zb = sc.zero_bubble_h1(2, 2)
  t = sc.simulate(zb, 1.0, 3.0, input_seconds=1.0, weight_seconds=2.0)
  for b in range(2):
    assert t.start[Action(INPUT, 0, b)] >= t.end[Action(INPUT, 1, b)]
    assert t.start[Action(WEIGHT, 1, b)] >= t.end[Action(INPUT, 1, b)]
  assert t.end[Action(WEIGHT, 1, 0)] - t.start[Action(WEIGHT, 1, 0)] == 2.0


def test_a_microbatch_without_its_weight_gradient_is_refused():
  lists = [[Action(FORWARD, 0, 0), Action(INPUT, 0, 0), Action(UPDATE, 0, 0)]]
  with pytest.raises(ValueError, match=r"F, B \(or I and W\)"):
    sc.make_schedule("mine", lists, [0], 1)


def test_eager_1f1b_runs_more_forwards_first_and_hides_transfers():
  """JaxPP's Eager1F1B: 2(n - 1 - s) + 1 forwards before stage s's first
  backward (1F1B: n - s), so a transfer overlaps the next forward; with
  slow links it finishes sooner, at 2(n - s) - 1 microbatches held."""
  n, m = 4, 8
  eager, one = sc.eager_1f1b(n, m), sc.one_f_one_b(n, m)
  for s in range(n):
    acts = eager.device_actions[s]
    first_b = next(i for i, a in enumerate(acts) if a.kind == "B")
    assert first_b == min(2 * (n - 1 - s) + 1, m)
    assert _between(eager, s, FORWARD, "B") == min(2 * (n - s) - 1, m)
  slow = {"comm_seconds": 0.5}
  assert (
    sc.simulate(eager, 1.0, 2.0, **slow).makespan
    < sc.simulate(one, 1.0, 2.0, **slow).makespan
  )
  assert (eager.delay == 0).all()


def test_looped_bfs_finishes_a_stage_before_the_next_on_its_device():
  built = sc.looped_bfs([0, 1, 0, 1], 3)
  kinds_and_stages = [(a.kind, a.stage) for a in built.device_actions[0]]
  # Forwards of stage 0, then of stage 2; backwards of 2, then of 0.
  assert kinds_and_stages[:12] == (
    [("F", 0)] * 3 + [("F", 2)] * 3 + [("B", 2)] * 3 + [("B", 0)] * 3
  )
  assert (
    sc.looped_bfs([0, 1], 4).device_actions == sc.gpipe(2, 4).device_actions
  )


def _device_peak(schedule):
  """Per device, the most microbatch-stages between F and their weight
  gradient (B or W)."""
  peaks = []
  for acts in schedule.device_actions:
    held = peak = 0
    for a in acts:
      held += (a.kind == FORWARD) - (a.kind in ("B", WEIGHT))
      peak = max(peak, held)
    peaks.append(peak)
  return peaks


V_BUILDERS = {"zbv": sc.zero_bubble_v, "dualpipev": sc.dual_pipe_v}


@pytest.mark.parametrize("name", V_BUILDERS)
@pytest.mark.parametrize("p", [1, 2, 3, 4, 8])
def test_v_schedules_reach_the_fill_bound(name, p):
  """With F = I = W = 1 per chunk, no schedule of 2p chunks on p devices
  ends before the last device's first input arrives (p - 1 forwards)
  plus its own work (6 per microbatch): ZB-V and DualPipeV end exactly
  then, at any m >= 2p (ZB-H1 on the same model, p stages of twice the
  cost, idles 2(p - 1); 1F1B 6(p - 1))."""
  for m in (2 * p, 3 * p, 8 * p):
    built = V_BUILDERS[name](sc.v_placement(p), m)
    t = sc.simulate(built, 1.0, 2.0, input_seconds=1.0)
    assert t.makespan == (p - 1) + 6 * m
    zb = sc.simulate(sc.zero_bubble_h1(p, m), 2.0, 4.0, input_seconds=2.0)
    assert zb.makespan - 6 * m == 2 * (p - 1)


@pytest.mark.parametrize("p", [1, 2, 3, 4])
def test_v_schedules_hold_1f1b_activation_memory(p):
  """Each device holds at most 2p chunk-microbatches between F and W --
  1F1B's first stage holds p of twice the size; DualPipeV one more."""
  for m in (2 * p, 5 * p):
    assert _device_peak(sc.zero_bubble_v(sc.v_placement(p), m)) == [2 * p] * p
    assert max(_device_peak(sc.dual_pipe_v(sc.v_placement(p), m))) <= 2 * p + 1


@pytest.mark.parametrize("name", V_BUILDERS)
def test_v_schedules_pass_the_validator_and_are_synchronous(name):
  for p in (1, 2, 3, 4, 5):
    for m in range(2 * p, 4 * p + 2):
      built = V_BUILDERS[name](sc.v_placement(p), m)
      sc.check_schedule(built)
      assert (built.delay == 0).all()
      assert built.stage_device == sc.v_placement(p)
  # ZB-V also runs fewer microbatches than chunks.
  for m in range(1, 8):
    sc.check_schedule(sc.zero_bubble_v(sc.v_placement(4), m))


def test_dualpipev_pairs_forwards_with_backwards_of_the_other_stage():
  """Its steady state: F of one chunk, then B of the device's other chunk
  for an earlier microbatch -- the pairs DualPipe overlaps."""
  p, m = 3, 12
  built = sc.dual_pipe_v(sc.v_placement(p), m)
  for d, acts in enumerate(built.device_actions):
    pairs = [
      (a, b)
      for a, b in zip(acts, acts[1:], strict=False)
      if a.kind == FORWARD and b.kind == "B"
    ]
    assert len(pairs) >= 2 * (m - 2 * p + d + 1)
    assert all(a.stage != b.stage for a, b in pairs)
    assert all(a.microbatch > b.microbatch for a, b in pairs)


def test_v_schedules_refuse_other_placements_and_too_few_microbatches():
  with pytest.raises(ValueError, match="two stages per device in a V"):
    sc.zero_bubble_v([0, 1, 2, 3], 8)
  with pytest.raises(ValueError, match="even stage count"):
    sc.build("zbv", 3, 8)
  with pytest.raises(ValueError, match=r"needs >= 6 microbatches"):
    sc.dual_pipe_v(sc.v_placement(3), 5)
  assert sc.build("dualpipev", 4, 4).stage_device == (0, 1, 1, 0)


@pytest.mark.parametrize("n", [2, 4, 8])
def test_the_async_stream_idles_only_in_its_drain_which_split_flush_shortens(n):
  """Between its warm-up and a flush every device of the async stream
  alternates F and B without idling -- no bubble for a deferred W to
  fill -- so split_flush splits only the drain: same delays, (n - 2) W
  shorter with F = I = W = 1."""
  calls = (16, 16)
  plain = sc.Stream("async", n).schedule(calls)
  split = sc.Stream("async", n, split_flush=True).schedule(calls)
  t = sc.simulate(plain, 1.0, 2.0)
  for acts in plain.device_actions:
    work = [a for a in acts if a.kind in (FORWARD, "B")]
    first_b = next(i for i, a in enumerate(work) if a.kind == "B")
    last_f = max(i for i, a in enumerate(work) if a.kind == FORWARD)
    for a, b in zip(
      work[first_b:last_f], work[first_b + 1 : last_f + 1], strict=True
    ):
      assert t.start[b] == t.end[a]
  assert (split.delay == plain.delay).all()
  shorter = (
    t.makespan - sc.simulate(split, 1.0, 2.0, input_seconds=1.0).makespan
  )
  assert shorter == max(n - 2, 0)


def _device_held(schedule, d):
  """Device d's most microbatch-stages between F and W (or B)."""
  live = peak = 0
  for a in schedule.device_actions[d]:
    live += (a.kind == FORWARD) - (a.kind in ("B", WEIGHT))
    peak = max(peak, live)
  return peak


def _shardy_h2_before(x, y, n):
  """Shardy MPMD's ``zero_bubble_h2_schedule_predicate`` (zero transfer
  latency), restated: whether action x must run before action y of the
  same stage s, with ``init = 2(n - s) - 1`` warm-up forwards and its
  complement ``2s + 1``."""
  s = x.stage
  init, complement = 2 * (n - s) - 1, 2 * s + 1
  i, j = x.microbatch, y.microbatch
  if x.kind == FORWARD and y.kind in (INPUT, WEIGHT) and i < init:
    return True  # Clause 1: the warm-up forwards before any backward.
  if x.kind == INPUT and y.kind == FORWARD and j >= init:
    return j - i == init  # Clause 2: I(i) < F(i + init).
  if x.kind == FORWARD and i >= init and y.kind == INPUT:
    return i - j == init - 1  # Clause 3: F(i + init - 1) < I(i).
  if x.kind == INPUT and y.kind == WEIGHT:
    return i - j == complement - 1  # Clause 4: I(i + c - 1) < W(i).
  if x.kind == WEIGHT and y.kind == INPUT:
    return j - i == complement  # Clause 5: W(i) < I(i + c).
  return False


def test_zbh2_by_hand():
  """3 stages, 6 microbatches: 5, 3 and 1 warm-up forwards; stage 0
  runs each W right after its I, stage 1 two I's later, stage 2 four."""
  lines = [
    "F0.0 F0.1 F0.2 F0.3 F0.4 I0.0 W0.0 F0.5 I0.1 W0.1 I0.2 W0.2 I0.3 "
    "W0.3 I0.4 W0.4 I0.5 W0.5 S0.5",
    "F1.0 F1.1 F1.2 I1.0 F1.3 I1.1 F1.4 I1.2 W1.0 F1.5 I1.3 W1.1 I1.4 "
    "W1.2 I1.5 W1.3 W1.4 W1.5 S1.5",
    "F2.0 I2.0 F2.1 I2.1 F2.2 I2.2 F2.3 I2.3 F2.4 I2.4 W2.0 F2.5 I2.5 "
    "W2.1 W2.2 W2.3 W2.4 W2.5 S2.5",
  ]
  zb = sc.zero_bubble_h2(3, 6)
  assert zb.format().splitlines() == [
    f"dev{d}: {line}" for d, line in enumerate(lines)
  ]


@pytest.mark.parametrize("n, m", [(2, 3), (3, 5), (4, 7), (4, 12), (6, 16)])
def test_zbh2_keeps_shardys_order(n, m):
  """m >= 2n - 1: every pair of a stage's actions in the order Shardy's
  ZB-H2 predicate asks for."""
  zb = sc.zero_bubble_h2(n, m)
  sc.check_schedule(zb)
  for s, acts in enumerate(zb.device_actions):
    work = [a for a in acts if a.kind != UPDATE]
    for a, x in enumerate(work):
      for y in work[:a]:  # y runs before x
        assert not _shardy_h2_before(x, y, n), (s, str(x), str(y))


@pytest.mark.parametrize("n, m", [(2, 4), (3, 3), (4, 4), (4, 8), (8, 8)])
@pytest.mark.parametrize("f, i, w", [(1, 1, 1), (1, 1, 0.5), (2, 1, 1)])
def test_zbh2_never_idles_after_its_first_forward(n, m, f, i, w):
  """The least a flushed step can take, m (F + I + W) + (n - 1) F (the
  last stage's first input comes after n - 1 forwards), at F = I = W
  for any m and for other costs where m >= 2n - 1; never longer than
  ZB-H1, at most 2(n - s) - 1 microbatches between F and I and 2n - 1
  between F and W (Qi et al.'s 2p - 1)."""
  zb, h1 = sc.zero_bubble_h2(n, m), sc.zero_bubble_h1(n, m)
  costs = dict(input_seconds=i, weight_seconds=w)
  t = sc.simulate(zb, f, i + w, **costs)
  if (f, i, w) == (1, 1, 1) or m >= 2 * n - 1:
    assert t.makespan == pytest.approx(m * (f + i + w) + (n - 1) * f)
  assert t.makespan <= sc.simulate(h1, f, i + w, **costs).makespan + 1e-9
  for s in range(n):
    assert _between(zb, s, FORWARD, INPUT) == min(2 * (n - s) - 1, m)
    assert _between(zb, s, FORWARD, WEIGHT) <= 2 * n - 1


@pytest.mark.parametrize("p", [2, 4, 8])
def test_interleaved_zb_beats_zbv_at_m_equal_p(p):
  """Issue 63: with several stages per device, zero bubble at m = p idles
  less than ZB-V, at the same 2p microbatch-stages per device; it never
  idles more than interleaved 1F1B; one stage per device is ZB-H1."""
  for m in (p, 2 * p):
    izb = sc.interleaved_zero_bubble(sc.loop_placement(2 * p, p), m)
    zbv = sc.zero_bubble_v(sc.v_placement(p), m)
    il = sc.interleaved(sc.loop_placement(2 * p, p), m)
    bubble = {
      k: sc.simulate(x, 0.5, 1.0).bubble
      for k, x in (("izb", izb), ("zbv", zbv), ("il", il))
    }
    assert bubble["izb"] <= bubble["zbv"] + 1e-9
    if m == p > 2:
      assert bubble["izb"] < bubble["zbv"] - 0.05
    assert bubble["izb"] < bubble["il"]
    for d in range(p):
      for x in (izb, zbv):
        assert _device_held(x, d) <= 2 * p
  assert (
    sc.interleaved_zero_bubble(range(p), 2 * p).device_actions
    == sc.zero_bubble_h1(p, 2 * p).device_actions
  )


def test_interleaved_zb_runs_other_counts_and_refuses_other_placements():
  for p, n, m in [(4, 8, 6), (4, 8, 9), (2, 3, 5), (4, 10, 3)]:
    s = sc.interleaved_zero_bubble(sc.loop_placement(n, p), m)
    sc.check_schedule(s)
    assert {a.kind for acts in s.device_actions for a in acts} == set("FIWS")
  with pytest.raises(
    ValueError, match=r"s % p \(the loop\); got .*\[0, 1, 1, 0\]"
  ):
    sc.interleaved_zero_bubble([0, 1, 1, 0], 4)


def test_timelines_of_the_new_zero_bubble_schedules_draw(tmp_path):
  for name, schedule in (
    ("zbh2", sc.zero_bubble_h2(3, 6)),
    (
      "interleaved_zb",
      sc.build("interleaved_zb", 4, 4, stage_device=[0, 1, 0, 1]),
    ),
  ):
    timeline = sc.simulate(schedule, 1.0, 2.0)
    png = tmp_path / f"{name}.png"
    sc.plot_timeline(timeline, str(png), title=name)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert {a.kind for a in timeline.start} == set("FIWS")


def test_zbv_takes_the_shorter_of_torchs_order_and_the_stopping_one():
  """From 2p - 1 microbatches on torch's padded construction and the one
  stopping each phase at the last microbatch are one order; below, ZB-V
  is whichever ends sooner with F = I = W."""
  z = sc._zero_bubble
  for p in range(1, 7):
    for m in range(1, 3 * p + 2):
      built = sc.zero_bubble_v(sc.v_placement(p), m)
      padded = z._zbv_lists(p, m, count_to=max(2 * p - 1, m))
      stopping = z._zbv_lists(p, m, count_to=m)
      if m >= 2 * p - 1:
        assert padded == stopping
      ends = [
        sc.simulate(sc.make_schedule("x", lists, built.stage_device, m), 1, 2)
        for lists in (padded, stopping)
      ]
      assert [list(a) for a in built.device_actions] in (padded, stopping)
      assert sc.simulate(built, 1, 2).makespan == min(t.makespan for t in ends)
