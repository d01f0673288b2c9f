"""Zero-bubble schedules: the backward split into I and W, W filling bubbles.

Qi et al., "Zero Bubble Pipeline Parallelism" (ICLR 2024): a stage's
backward is two computations, the input gradient I (which the previous
stage waits for: it is on the critical path) and the weight gradient W
(which nothing downstream waits for). Deferring W to where a device
would otherwise wait removes most of 1F1B's bubble.
"""

from jpipe.schedule._builders import loop_lists
from jpipe.schedule._schedule import (
  BACKWARD,
  FORWARD,
  INPUT,
  UPDATE,
  WEIGHT,
  Action,
  Schedule,
  make_schedule,
)
from jpipe.schedule._simulate import simulate


def zero_bubble_h1(num_stages: int, num_microbatches: int) -> Schedule:
  """ZB-H1 (the paper's handcrafted schedule at 1F1B's peak memory).

  Stage s runs 1F1B's order with each backward split into I then W, and
  keeps its last ``s`` weight gradients deferred: after I(i) it runs
  W(i - s). The later a stage, the longer its cool-down waits for the
  earlier stages' input gradients, and the deferred W's fill that wait.
  Stage s then holds at most ``n`` microbatches between F and W (1F1B:
  ``n - s``): every device at 1F1B's peak, stage 0's. With equal F, I
  and W costs the bubble is ``(n - 1)(F + I - W)``, a third of 1F1B's
  ``(n - 1)(F + I + W)``. Synchronous: one step per stage at the end.
  """
  if num_stages < 1 or num_microbatches < 1:
    raise ValueError(
      f"need >= 1 stage and microbatch, got {num_stages} stages and "
      f"{num_microbatches} microbatches"
    )
  n, m = num_stages, num_microbatches
  lists = []
  for s in range(n):
    warm = min(n - 1 - s, m)
    actions = [Action(FORWARD, s, b) for b in range(warm)]
    weights = iter(range(m))
    for i in range(m):
      if warm + i < m:
        actions.append(Action(FORWARD, s, warm + i))
      actions.append(Action(INPUT, s, i))
      if i >= s:  # Keep s weight gradients deferred.
        actions.append(Action(WEIGHT, s, next(weights)))
    actions += [Action(WEIGHT, s, b) for b in weights]
    actions.append(Action(UPDATE, s, m - 1))
    lists.append(actions)
  return make_schedule("zbh1", lists, list(range(n)), m)


def v_placement(num_devices: int) -> tuple[int, ...]:
  """The V: ``2 * num_devices`` stages, stage s on device ``min(s, 2p - 1
  - s)`` -- down the devices and back, so device 0 holds the first and
  the last stage and the loss is computed where the batch came in."""
  if num_devices < 1:
    raise ValueError(f"need >= 1 device, got {num_devices}")
  return tuple(range(num_devices)) + tuple(reversed(range(num_devices)))


def _v_devices(name, stage_device, num_microbatches, least_microbatches):
  """Devices of a V schedule's stages, checked: p, and the stages going
  down (``down[d]``) and coming back (``up[d]``) on device d."""
  stage_device = tuple(int(d) for d in stage_device)
  p = len(stage_device) // 2
  if len(stage_device) % 2 or stage_device != v_placement(max(p, 1)):
    raise ValueError(
      f"{name} runs two stages per device in a V (stage s on device "
      f"min(s, 2p - 1 - s)); got stages on devices {list(stage_device)}: "
      "use an even stage count, 2 per device"
    )
  if num_microbatches < least_microbatches(p):
    raise ValueError(
      f"{name} on {p} devices needs >= {least_microbatches(p)} "
      f"microbatches per step, got {num_microbatches}"
    )
  return p, list(range(p)), [2 * p - 1 - d for d in range(p)]


class _Emitter:
  """One device's list, written in order, with per-stage counters: the
  next microbatch whose F, whose input gradient (B or I) and whose
  deferred W each stage runs; none past the last microbatch."""

  def __init__(self, num_microbatches):
    self.m = num_microbatches
    self.actions: list[Action] = []
    self.next = {}  # (kind, stage) -> next microbatch
    self.deferred: list[tuple[int, int]] = []  # (stage, mb) awaiting W

  def _take(self, kind, stage):
    b = self.next.get((kind, stage), 0)
    if b >= self.m:
      return None
    self.next[(kind, stage)] = b + 1
    return b

  def count(self, kind, stage) -> int:
    return self.next.get((kind, stage), 0)

  def forward(self, stage):
    b = self._take(FORWARD, stage)
    if b is not None:
      self.actions.append(Action(FORWARD, stage, b))

  def backward(self, stage):
    """A whole backward B (both halves at once)."""
    b = self._take("grad", stage)
    if b is not None:
      self.actions.append(Action(BACKWARD, stage, b))

  def input_gradient(self, stage, weight_now=False):
    """I, its W queued (or run at once: ``weight_now``)."""
    b = self._take("grad", stage)
    if b is None:
      return
    self.actions.append(Action(INPUT, stage, b))
    self.deferred.append((stage, b))
    if weight_now:
      self.weight()

  def weight(self):
    """The oldest deferred W; none queued: no-op."""
    if self.deferred:
      s, b = self.deferred.pop(0)
      self.actions.append(Action(WEIGHT, s, b))

  def finish(self, stages):
    """Every backward and W not yet written, and the stages' steps."""
    for s in stages:
      while self.count("grad", s) < self.m:
        self.input_gradient(s)
    while self.deferred:
      self.weight()
    self.actions += [Action(UPDATE, s, self.m - 1) for s in sorted(stages)]
    return self.actions


def zero_bubble_v(stage_device, num_microbatches: int) -> Schedule:
  """ZB-V (Qi et al., "Pipeline Parallelism with Controllable Memory",
  2024): 2p stages in a V on p devices, each backward split into I and
  W; torch's ScheduleZBVZeroBubble's order, action for action, from
  ``2p - 1`` microbatches on.

  Device d holds stage d (going down) and stage 2p - 1 - d (coming back).
  It runs ``2(p - d) - 1`` forwards of its first stage; then ``d`` pairs
  of forwards, second stage then first; then ``p - d`` rounds of F, I, W
  of its second stage; then, while forwards remain, F, I, W of the first
  stage and F, I, W of the second. The cool-down: ``d`` rounds of I of
  both stages, ``p - d`` rounds of I and the oldest deferred W of the
  first stage, then the second stage's deferred W's, then the first's.

  Fewer microbatches than ``2p - 1``: torch builds the order for ``2p -
  1`` and drops the missing microbatches' actions; stopping each phase at
  the last microbatch instead idles less at most such m (at m = p = 4
  a bubble of 0.172 against 0.200), more at a few near ``2p - 1``. Of
  the two, the one that ends sooner with F = I = W (the paper's costs;
  torch's on a tie). With F = I = W the bubble is near zero at 1F1B's
  activation memory (each device holds at most 2p microbatch-stages
  between F and W). Synchronous.
  """
  p, _, _ = _v_devices("zbv", stage_device, num_microbatches, lambda p: 1)
  m = num_microbatches
  padded = _zbv_lists(p, m, count_to=max(2 * p - 1, m))
  if m >= 2 * p - 1:  # (Padded to m itself: the two are one order.)
    return make_schedule("zbv", padded, v_placement(p), m)
  built = [
    make_schedule("zbv", lists, v_placement(p), m)
    for lists in (padded, _zbv_lists(p, m, count_to=m))
  ]
  unit = [simulate(s, 1.0, 2.0).makespan for s in built]
  return built[1] if unit[1] < unit[0] else built[0]


def _zbv_lists(p: int, m: int, count_to: int) -> list[list[Action]]:
  """ZB-V's lists with each stage's F, I and W counted up to
  ``count_to`` microbatches, those of microbatch m on left out (torch
  counts to ``max(2p - 1, m)``; counting to m stops each phase at the
  last microbatch)."""
  lists = []
  for d in range(p):
    lo, hi = d, 2 * p - 1 - d
    ops = []
    count = {}

    def run(*actions, ops=ops, count=count):
      """(kind, stage) pairs, each of that stage's next microbatch."""
      for kind, stage in actions:
        b = count.get((kind, stage), 0)
        if b < count_to:
          count[(kind, stage)] = b + 1
          if b < m:
            ops.append(Action(kind, stage, b))

    def done(kind, stage, count=count):
      return count.get((kind, stage), 0)

    run(*[(FORWARD, lo)] * (2 * (p - d) - 1))
    run(*[(FORWARD, hi), (FORWARD, lo)] * d)
    run(*[(FORWARD, hi), (INPUT, hi), (WEIGHT, hi)] * (p - d))
    while done(FORWARD, hi) < done(FORWARD, lo) or (
      done(FORWARD, lo) < count_to
    ):
      run((FORWARD, lo), (INPUT, lo), (WEIGHT, lo))
      run((FORWARD, hi), (INPUT, hi), (WEIGHT, hi))
    run(*[(INPUT, lo), (INPUT, hi)] * d)  # Cool-down: their W's deferred.
    run(*[(INPUT, lo), (WEIGHT, lo)] * (p - d))
    run(*[(WEIGHT, hi)] * count_to, *[(WEIGHT, lo)] * count_to)
    lists.append(ops + [Action(UPDATE, s, m - 1) for s in (lo, hi)])
  return lists


def dual_pipe_v(stage_device, num_microbatches: int) -> Schedule:
  """DualPipeV (DeepSeek's DualPipe cut in half, "V" shape; Sea AI Lab's
  write-up; torch's ScheduleDualPipeV): 2p stages in a V on p devices;
  in steady state each device pairs the forward of one of its stages
  with the backward of its other stage for another microbatch -- the
  pairs DualPipe overlaps (F then B, adjacent in the list: one device
  runs one program at a time here, so the pair is run back to back and
  the gain is the ordering's); the warm-up and cool-down split
  backwards into I and W to fill bubbles. Needs >= 2p microbatches.

  Device d: ``2(p - d - 1)`` forwards of its first stage; ``d + 1``
  forwards of both; ``p - d - 1`` rounds of I and a deferred W of its
  second stage and its next forward; ``m - 2p + d + 1`` rounds of the
  pairs (F first stage, B second stage) and (F second, B first);
  ``p - d - 1`` rounds of B of the second stage and the pair (F second,
  B first); ``d + 1`` backwards of both stages, from the middle on as
  I's; then ``p - d - 1`` deferred W's each followed by an I of the first
  stage; then the remaining W's. Synchronous.
  """
  p, down, up = _v_devices(
    "dualpipev", stage_device, num_microbatches, lambda p: 2 * p
  )
  m = num_microbatches
  lists = []
  for d in range(p):
    lo, hi = down[d], up[d]
    e = _Emitter(m)
    for _ in range(2 * (p - d - 1)):
      e.forward(lo)
    for _ in range(d + 1):
      e.forward(lo)
      e.forward(hi)
    for _ in range(p - d - 1):
      e.input_gradient(hi)
      e.weight()
      e.forward(hi)
    for _ in range(m - 2 * p + d + 1):
      e.forward(lo)
      e.backward(hi)
      e.forward(hi)
      e.backward(lo)
    for _ in range(p - d - 1):
      e.backward(hi)
      e.forward(hi)
      e.backward(lo)
    split = False
    for i in range(d + 1):
      split = split or (i == (d + 1) // 2 and d % 2 == 1)
      (e.input_gradient if split else e.backward)(hi)
      split = split or (i == (d + 1) // 2 and d % 2 == 0)
      (e.input_gradient if split else e.backward)(lo)
    for _ in range(p - d - 1):
      e.weight()
      e.input_gradient(lo)
    lists.append(e.finish((lo, hi)))
  return make_schedule("dualpipev", lists, v_placement(p), m)


def zero_bubble_h2(num_stages: int, num_microbatches: int) -> Schedule:
  """ZB-H2 (Qi et al.'s handcrafted schedule at more memory; Shardy
  MPMD's ZeroBubbleH2ZeroTxLatency): stage s runs ``w = min(2(n - s) -
  1, m)`` warm-up forwards (1F1B: n - s), then for each microbatch i its
  input gradient I(i), the W of microbatch ``i - c + 1`` (if any), and,
  while forwards remain, F(i + w); ``c = min(2s + 1, m - w + 1)`` (the
  warm-up of stage n - 1 - s: "diagonally symmetric"); the remaining
  W's at the end. Every stage then runs without a gap from its first
  forward: with F = I = W the step takes ``m (F + I + W) + (n - 1) F``,
  the least a flushed step can (the last stage cannot start sooner),
  and with other costs too where m >= 2n - 1; with W < I that is less
  than ZB-H1's idle ``(n - 1)(F + I - W)``. Stage s holds up to ``2(n -
  s) - 1`` microbatches between F and I (1F1B: n - s) and every stage up
  to ``2n - 1`` between F and W (the paper's 2p - 1; ZB-H1: n).
  Synchronous: one step per stage at the end.
  """
  if num_stages < 1 or num_microbatches < 1:
    raise ValueError(
      f"need >= 1 stage and microbatch, got {num_stages} stages and "
      f"{num_microbatches} microbatches"
    )
  n, m = num_stages, num_microbatches
  lists = []
  for s in range(n):
    warm = min(2 * (n - s) - 1, m)
    lag = min(2 * s + 1, m - warm + 1) - 1  # W(j) after I(j + lag).
    actions = [Action(FORWARD, s, b) for b in range(warm)]
    for i in range(m):
      actions.append(Action(INPUT, s, i))
      if i >= lag:
        actions.append(Action(WEIGHT, s, i - lag))
      if warm + i < m:
        actions.append(Action(FORWARD, s, warm + i))
    actions += [Action(WEIGHT, s, b) for b in range(max(m - lag, 0), m)]
    actions.append(Action(UPDATE, s, m - 1))
    lists.append(actions)
  return make_schedule("zbh2", lists, list(range(n)), m)


def interleaved_zero_bubble(stage_device, num_microbatches: int) -> Schedule:
  """Interleaved zero bubble (torch's ScheduleInterleavedZeroBubble, Qi
  et al.'s ZB1P on Megatron's virtual stages): the loop placement (stage
  s on device s % p, v stages per device), interleaved 1F1B's order with
  each backward split into I and W, ``(v - 1) g + p - 1 - d`` warm-up
  forwards on device d (g: ``interleaved_rounds``), and d weight
  gradients kept deferred to fill the cool-down
  (``_builders.loop_lists``). One stage per device: ZB-H1. At m = p it
  idles less than ZB-V, at the same 2p microbatch-stages held per device.
  Synchronous: one step per stage at the end.
  """
  stage_device = [int(d) for d in stage_device]
  n = len(stage_device)
  if n < 1 or num_microbatches < 1:
    raise ValueError(
      f"need >= 1 stage and microbatch, got {n} stages and "
      f"{num_microbatches} microbatches"
    )
  p = max(stage_device) + 1
  if stage_device != [s % p for s in range(n)]:
    raise ValueError(
      f"interleaved_zb runs stage s on device s % p (the loop); got stages "
      f"on devices {stage_device}"
    )
  lists = loop_lists(n, p, num_microbatches, split=True)
  for d, actions in enumerate(lists):
    actions += [Action(UPDATE, s, num_microbatches - 1) for s in range(d, n, p)]
  return make_schedule("interleaved_zb", lists, stage_device, num_microbatches)
