"""Interleaved 1F1B (Megatron-LM's virtual pipeline, torch's
ScheduleInterleaved1F1B), held to a hand-written order, to a plain
restatement of Megatron's loop and to torch's bubbles."""

import pytest

from jpipe import schedule as sc
from jpipe.schedule import BACKWARD, FORWARD, UPDATE, Action


def _parse(line):
  """``"F0.1 B2.0"`` -> actions."""
  return [
    Action(sc.ActionKind(t[0]), *map(int, t[1:].split(".")))
    for t in line.split()
  ]


def test_two_devices_two_chunks_four_microbatches_by_hand():
  """p = 2, v = 2 (stages 0, 2 on device 0; 1, 3 on device 1), m = 4:
  device 0 warms up with 2 (p - 1) + (v - 1) p = 4 forwards (microbatches
  0, 1 of chunk 0, then of chunk 1), device 1 with 2; then 1F1B, the
  backwards taken in the same rounds, last chunk first."""
  s = sc.interleaved([0, 1, 0, 1], 4)
  assert s.device_actions == (
    tuple(
      _parse(
        "F0.0 F0.1 F2.0 F2.1 "
        "F0.2 B2.0 F0.3 B2.1 F2.2 B0.0 F2.3 B0.1 "
        "B2.2 B2.3 B0.2 B0.3 S0.3 S2.3"
      )
    ),
    tuple(
      _parse(
        "F1.0 F1.1 "
        "F3.0 B3.0 F3.1 B3.1 F1.2 B1.0 F1.3 B1.1 F3.2 B3.2 F3.3 B3.3 "
        "B1.2 B1.3 S1.3 S3.3"
      )
    ),
  )


def _megatron(p, v, m):
  """Megatron-LM's ``forward_backward_pipelining_with_interleaving`` (m a
  multiple of p), restated: per device, ``num_warmup`` forwards, then
  forward k + num_warmup and backward k, then the remaining backwards.
  Virtual microbatch k runs on chunk ``get_model_chunk_id(k)``; each
  chunk takes its microbatches in order (its data iterator forward, the
  oldest stored activation backward)."""

  def get_model_chunk_id(k, forward):
    chunk = (k // p) % v
    return chunk if forward else v - 1 - chunk

  lists = []
  for d in range(p):
    total = m * v
    num_warmup = min((p - d - 1) * 2 + (v - 1) * p, total)
    next_mb = {(kind, c): 0 for kind in (FORWARD, BACKWARD) for c in range(v)}

    def action(kind, k, d=d, next_mb=next_mb):
      c = get_model_chunk_id(k, kind == FORWARD)
      mb = next_mb[(kind, c)]
      next_mb[(kind, c)] += 1
      return Action(kind, c * p + d, mb)

    acts = [action(FORWARD, k) for k in range(num_warmup)]
    for k in range(total - num_warmup):
      acts.append(action(FORWARD, k + num_warmup))
      acts.append(action(BACKWARD, k))
    acts += [action(BACKWARD, k) for k in range(total - num_warmup, total)]
    acts += [Action(UPDATE, c * p + d, m - 1) for c in range(v)]
    lists.append(tuple(acts))
  return tuple(lists)


@pytest.mark.parametrize(
  "p, v, m",
  [(2, 2, 2), (2, 2, 6), (2, 3, 4), (3, 2, 3), (3, 2, 9), (4, 2, 8)]
  + [(4, 3, 4), (4, 4, 12), (8, 2, 16)],
)
def test_the_order_is_megatrons(p, v, m):
  s = sc.interleaved(sc.loop_placement(v * p, p), m)
  assert s.device_actions == _megatron(p, v, m)
  sc.check_schedule(s)


# torch.distributed.pipelining 2.13's ScheduleInterleaved1F1B, 2 stages
# per rank, F = 1, B = 2, free transfers: its bubble (issue 63).
TORCH = {
  (2, 2): 0.200,
  (2, 4): 0.111,
  (2, 8): 0.059,
  (8, 8): 0.304,
  (8, 16): 0.179,
  (8, 32): 0.099,
}


@pytest.mark.parametrize("p, m", TORCH)
def test_bubble_at_most_torchs_and_narayanans(p, m):
  """Narayanan et al.'s (p - 1) / (v m + p - 1) for v = 2, 3, 4 chunks;
  at v = 2 at most torch's; every device holds at most its Megatron
  warm-up + 1 microbatches between F and B (torch's peak)."""
  for v in (2, 3, 4):
    s = sc.interleaved(sc.loop_placement(v * p, p), m)
    bubble = sc.simulate(s, 1.0, 2.0).bubble
    assert bubble == pytest.approx((p - 1) / (v * m + p - 1))
    if v == 2:
      assert bubble <= TORCH[(p, m)] + 5e-4
    for d, acts in enumerate(s.device_actions):
      live = peak = 0
      for a in acts:
        live += (a.kind == FORWARD) - (a.kind == BACKWARD)
        peak = max(peak, live)
      assert peak == min(2 * (p - 1 - d) + (v - 1) * p + 1, v * m)


def test_beats_1f1b_on_the_same_devices():
  """The point of virtual stages: the same model on p devices, cut into
  v chunks per device (each 1 / v of a device's work), idles 1 / v of
  1F1B's time."""
  p, m, work = 4, 8, 3.0 * 8
  one = sc.simulate(sc.one_f_one_b(p, m), 1.0, 2.0)
  for v in (2, 4):
    many = sc.interleaved(sc.loop_placement(v * p, p), m)
    t = sc.simulate(many, 1.0 / v, 2.0 / v)
    assert t.makespan - work == pytest.approx((one.makespan - work) / v)


def test_one_chunk_per_device_is_1f1b():
  assert sc.interleaved([0, 1, 2], 5).device_actions == (
    sc.one_f_one_b(3, 5).device_actions
  )


@pytest.mark.parametrize(
  "p, n, m",
  # m below p (rounds of m, torch's), m // p dividing m (rounds of
  # m / (m // p), torch's), other m (the order for the next multiple of p,
  # the extra microbatches left out); a short last round of chunks.
  [(4, 8, 2), (4, 8, 6), (4, 8, 9), (3, 9, 7), (2, 3, 6), (4, 7, 5)]
  + [(4, 10, 13)],
)
def test_other_microbatch_counts_and_stage_counts_run(p, n, m):
  s = sc.interleaved(sc.loop_placement(n, p), m)
  sc.check_schedule(s)  # Every F and B once; no deadlock.
  assert s.num_devices == p and (s.delay == 0).all()
  for stage in range(n):
    assert s.step_groups[stage] == (tuple(range(m)),)
  # Never worse than placing the same stages by list scheduling (the
  # order of other placements).
  listed = sc.make_schedule(
    "listed",
    [
      acts + [Action(UPDATE, st, m - 1) for st in range(d, n, p)]
      for d, acts in enumerate(
        sc._builders._list_scheduled(list(sc.loop_placement(n, p)), p, m)
      )
    ],
    sc.loop_placement(n, p),
    m,
  )
  assert (
    sc.simulate(s, 1.0, 2.0).makespan <= sc.simulate(listed, 1.0, 2.0).makespan
  )


def test_other_placements_are_list_scheduled():
  """A V (stages 0, 3 on device 0): not a loop, so 1F1B's priorities by
  list scheduling, as FTPipe's mixed pipe places stages."""
  s = sc.interleaved([0, 1, 1, 0], 4)
  sc.check_schedule(s)
  assert s.device_actions[0][:3] == tuple(_parse("F0.0 F0.1 F0.2"))


def test_interleaved_rounds_are_torchs():
  assert [sc.interleaved_rounds(4, m) for m in (1, 3, 4, 6, 8, 9, 12)] == [
    1,
    3,
    4,
    6,
    4,
    None,
    4,
  ]
  with pytest.raises(ValueError, match="2 stages on 3 devices"):
    sc.loop_placement(2, 3)
