"""Asynchronous schedules as unbounded streams (1F1B without flushes).

PipeDream's asynchronous 1F1B never drains: stage s of n runs
``w = n - 1 - s`` warm-up forwards once, then alternates the forward of
microbatch ``w + i`` with the backward of microbatch ``i`` for as long as
microbatches arrive, stepping after every ``step_every``-th backward. A
``step`` call of the pipeline feeds the next microbatches into this stream
and runs, per stage, the actions they make possible; in-flight microbatches
finish in later calls. A flush drains the stream (every pending backward,
and a step for a partial window) and the next call starts a new stream,
with a new warm-up. Microbatch indices count from the stream's start.

Per stage s, with k = ``step_every`` (``2bw``: microbatches per minibatch):

- F(s, b) runs after the backwards of microbatches ``< b - w``: the stage
  has taken ``max(b - w, 0) // k`` steps of the stream;
- the step applying b's gradient is the stream's step ``b // k`` of s;
- so F(s, b) runs ``delay = b // k - max(b - w, 0) // k`` steps before
  that step: ``min(b, n - 1 - s)`` with k = 1, whatever the call
  boundaries;
- ``2bw`` pins F(s, b) (and its backward) to the version after
  ``max(t - 1, 0)`` steps, t = b // k: W(t+1) = W(t) - lr grad f(W(t-1)).

PipeDream's round-robin replicas (1F1B-RR, ``replicas``): stage s with
r_s replicas deals whole microbatches to them, microbatch b to replica
``b mod r_s``; each replica runs ``w_s = (R - 1 - sum_{i<s} r_i) // r_s``
warm-up forwards (R = sum r_i, PipeDream's NOAM per stage) and then 1F1B
on its own microbatches, and the replicas step together (PipeDream's
all-reduce on every backward) after each round of r_s backwards, one from
each. In the stage's merged stream that is a warm-up of ``w_s r_s``
forwards and a step window of r_s: replica j's k-th forward
(b = j + k r_s) follows ``max(k - w_s, 0)`` steps, as in PipeDream.
"""

import dataclasses

import numpy as np

from jpipe.partition import steady_state_delay
from jpipe.schedule import _schedule
from jpipe.schedule._schedule import (
  BACKWARD,
  FORWARD,
  INPUT,
  UPDATE,
  WEIGHT,
  Action,
)


@dataclasses.dataclass(frozen=True)
class Stream:
  """The unbounded per-stage action streams of ``async`` or ``2bw``.

  Attributes:
    name: "async" (a step every ``step_every`` backwards) or "2bw"
      (PipeDream-2BW: a step every ``step_every`` microbatches, forwards
      and backwards at the version before the last).
    num_stages: pipeline stages.
    step_every: backwards per step; for 2bw at least ``num_stages`` (the
      version W(t-1) must exist when minibatch t's first forward runs).
    split_flush: a flush's pending backwards run as I then W (the
      zero-bubble split): stage s - 1 waits for I only, and W runs while
      it does. The drain is the stream's only bubble -- between its
      warm-up and a flush every device alternates F and B, no idle time
      for a deferred W to fill -- so only the drain splits; each W (and
      the step after it) stays where its B was: every delay is the
      same. With F = I = W the drain is ``(n - 2) W`` shorter.
    warmups: per stage, its warm-up forwards (and so its delay), instead
      of ``n - 1 - s``: each at most that, none below the next stage's (a
      stage of 0 runs each forward's backward next: FTPipe's
      ``virtual_stages_1f1b``, ``virtual_stage_warmups``). None: 1F1B's.
    replicas: per stage, its round-robin replicas (PipeDream's 1F1B-RR,
      module docstring; ``async`` with step_every 1 only). None: every
      stage one (or its replicas split each microbatch, which the stream
      does not see).
  """

  name: str
  num_stages: int
  step_every: int = 1
  split_flush: bool = False
  warmups: tuple[int, ...] | None = None
  replicas: tuple[int, ...] | None = None

  def __post_init__(self):
    from jpipe.schedule._registry import STREAMS  # It imports this module.

    if self.name not in STREAMS:
      raise ValueError(f"unknown stream {self.name!r}: one of {STREAMS}")
    if self.num_stages < 1:
      raise ValueError(f"need >= 1 stage, got {self.num_stages}")
    if self.step_every < 1:
      raise ValueError(f"step_every must be >= 1, got {self.step_every}")
    if self.name == "2bw" and self.step_every < self.num_stages:
      raise ValueError(
        f"2bw needs step_every (microbatches per minibatch) >= num_stages "
        f"({self.num_stages}), got {self.step_every}: stage 0 runs "
        f"{self.num_stages - 1} forwards ahead of its backwards, so a "
        "shorter minibatch would need a third weight version"
      )

    if self.warmups is not None:
      w, n = tuple(int(x) for x in self.warmups), self.num_stages
      object.__setattr__(self, "warmups", w)
      if len(w) != n:
        raise ValueError(f"warmups needs {n} entries (one per stage), got {w}")
      for s in range(n):
        if not 0 <= w[s] <= n - 1 - s:
          raise ValueError(
            f"stage {s}'s warm-up {w[s]} must lie in [0, {n - 1 - s}] "
            "(more than 1F1B's n - 1 - s would wait for nothing)"
          )
        if s + 1 < n and w[s] < w[s + 1]:
          raise ValueError(
            f"warmups {w} rise from stage {s} to {s + 1}: a stage may not "
            "run further ahead than the one before it (it would wait on "
            "backwards that never come)"
          )
      if self.name == "2bw" and w != tuple(n - 1 - s for s in range(n)):
        raise ValueError(
          "2bw keeps 1F1B's warm-ups (its versions rely on them)"
        )
    if self.replicas is not None:
      self._check_replicas()

  def _check_replicas(self):
    r = tuple(int(x) for x in self.replicas)
    object.__setattr__(self, "replicas", r)
    if len(r) != self.num_stages or min(r) < 1:
      raise ValueError(
        f"replicas needs {self.num_stages} counts >= 1 (one per stage), got {r}"
      )
    if self.name != "async" or self.step_every != 1 or self.warmups:
      raise ValueError(
        "round-robin replicas (PipeDream's 1F1B-RR) run the 'async' "
        "stream with step_every 1 and PipeDream's own warm-ups: a "
        "replicated stage already steps once per round of its replicas' "
        f"microbatches (got {self.name!r}, step_every {self.step_every}, "
        f"warmups {self.warmups})"
      )

  @property
  def backward_uses_stash(self) -> bool:
    """Whether B(s, b) runs at F(s, b)'s version whatever the options."""
    return self.name == "2bw"

  def warmup(self, s: int) -> int:
    """Forwards stage s runs before its first backward (with replicas:
    all of its replicas' warm-ups together)."""
    if self.warmups is not None:
      return self.warmups[s]
    if self.replicas is not None:
      r = self.replicas
      per_replica = (sum(r) - 1 - sum(r[:s])) // r[s]
      return per_replica * r[s]
    return steady_state_delay(self.num_stages, s)

  def num_replicas(self, s: int) -> int:
    """Stage s's round-robin replicas (1 without)."""
    return 1 if self.replicas is None else self.replicas[s]

  def replica(self, s: int, b: int) -> int:
    """The replica of stage s that runs microbatch b (``b mod r_s``)."""
    return b % self.num_replicas(s)

  def window(self, s: int) -> int:
    """Backwards per step of stage s: ``step_every``, or its replicas'
    round."""
    return self.step_every * self.num_replicas(s)

  def settled(self) -> int:
    """Microbatches fed after which every stage has run its warm-up and
    two whole step windows (a bound on the steady state)."""
    stages = range(self.num_stages)
    return (
      max(self.warmup(s) for s in stages)
      + 1
      + 2 * max(self.window(s) for s in stages)
    )

  def steady_start(self, fed: int) -> int:
    """The smallest count of microbatches fed after which the stream's
    next segments repeat those after ``fed`` (every stage past its
    warm-up, the same position in every step window); ``fed`` itself
    before that."""
    warm = max(self.warmup(s) for s in range(self.num_stages))
    if fed < warm:
      return fed
    period = int(
      np.lcm.reduce([self.window(s) for s in range(self.num_stages)])
    )
    return fed - (fed - warm) // period * period

  def stage_actions(
    self, s: int, fed_before: int, fed: int
  ) -> tuple[Action, ...]:
    """Stage s's actions while microbatches ``[fed_before, fed)`` enter
    the stream: their forwards, each followed (after the warm-up) by the
    backward 1F1B pairs with it and any step that closes a window."""
    w = self.warmup(s)
    out = []
    for b in range(fed_before, fed):
      out.append(Action(FORWARD, s, b))
      if b >= w:
        out += self._backward(s, b - w)
    return tuple(out)

  def drain_actions(self, s: int, fed: int) -> tuple[Action, ...]:
    """Stage s's actions of a flush after ``fed`` microbatches: its
    pending backwards, then a step for a partial window."""
    out = []
    for i in range(max(fed - self.warmup(s), 0), fed):
      out += self._backward(s, i, split=self.split_flush)
    if fed % self.window(s):
      out.append(Action(UPDATE, s, fed - 1))
    return tuple(out)

  def _backward(self, s, i, split=False):
    grads = [Action(BACKWARD, s, i)]
    if split:
      grads = [Action(INPUT, s, i), Action(WEIGHT, s, i)]
    if (i + 1) % self.window(s):
      return grads
    return [*grads, Action(UPDATE, s, i)]

  def steps_before_forward(self, s: int, b: int) -> int:
    """Steps of the stream stage s has taken when F(s, b) runs."""
    return max(b - self.warmup(s), 0) // self.window(s)

  def delay(self, s: int, b: int) -> int:
    """Steps between F(s, b) and the step applying b (no flush between)."""
    return b // self.window(s) - self.steps_before_forward(s, b)

  def max_delay(self, s: int) -> int:
    """The largest delay stage s sees (steady state)."""
    span = self.warmup(s) + 2 * self.window(s)
    return max(self.delay(s, b) for b in range(span))

  def forward_version(self, s: int, b: int) -> int:
    """Steps of the stream whose params F(s, b) uses."""
    if self.name == "2bw":
      return max(b // self.step_every - 1, 0)
    return self.steps_before_forward(s, b)

  def schedule(self, calls: tuple[int, ...]) -> _schedule.Schedule:
    """The actions of ``step`` calls feeding ``calls[i]`` microbatches
    each (stage s on device s), then a flush: a finite Schedule to
    simulate or inspect."""
    if any(m < 1 for m in calls):
      raise ValueError(f"every call needs >= 1 microbatch, got {calls}")
    fed = int(sum(calls))
    stages = []
    for s in range(self.num_stages):
      acts, start = [], 0
      for m in calls:
        acts += self.stage_actions(s, start, start + m)
        start += m
      acts += self.drain_actions(s, fed)
      stages.append(acts)
    version = None  # async: the steps taken, as make_schedule counts them
    if self.name == "2bw":  # 2BW pins each forward to W(t-1).
      version = np.array(
        [
          [self.forward_version(s, b) for b in range(fed)]
          for s in range(self.num_stages)
        ],
        np.int64,
      )
    return _schedule.make_schedule(
      self.name,
      stages,
      list(range(self.num_stages)),
      fed,
      forward_version=version,
      backward_uses_stash=self.backward_uses_stash,
    )


def virtual_stage_warmups(num_stages: int, supremum: int) -> tuple[int, ...]:
  """FTPipe's ``virtual_stages_1f1b``: each stage's virtual depth, its
  warm-up forwards (and steady-state delay) in a mixed pipe of
  ``num_stages`` stages whose staleness is capped by ``supremum`` (FTPipe's
  ``supremum_staleness``; "auto" there: the number of devices).

  With depth d = n - 1 - s, ``vd(n) = min(n, S - 1)`` and ``vd(d) =
  max(0, vd(d + 1) - 1)``, i.e. ``max(0, min(n, S - 1) - 1 - s)``: 16
  stages under S = 8 give 6, 5, 4, 3, 2, 1, 0, ..., 0. FTPipe's formula as
  its code has it: the largest delay is S - 2, not S - 1 (pass S + 1 for a
  cap of S - 1).
  """
  if num_stages < 1 or supremum < 1:
    raise ValueError(
      f"need >= 1 stage and supremum >= 1, got {num_stages}, {supremum}"
    )
  top = min(num_stages, supremum - 1)
  return tuple(max(0, top - 1 - s) for s in range(num_stages))
