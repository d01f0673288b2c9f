"""Free-running epochs of ``DataParallelPipelines`` (SD-Pipe's): every
pipeline in its own thread at its own pace until the policy ends the
epoch (``_epoch.py``) or a stop request cuts it short, then drained; the
epoch's ``EpochReport``, the same on every process."""

import dataclasses
import threading
import time
from collections.abc import Callable
from typing import Any

import jax
import numpy as np

from jpipe.runtime import PipelineState


@dataclasses.dataclass
class EpochReport:
  """What an epoch of free-running pipelines did (every pipeline's, also
  across processes).

  Attributes:
    batches: per pipeline, the batches (``step`` calls) it ran.
    steps: per pipeline, its last stage's optimizer steps so far.
    losses: per pipeline, each call's mean loss.
    aux: per pipeline, the mean over its calls of each aux output of the
      loss (``has_aux``), flat in ``jax.tree.leaves`` order (lists for
      arrays); empty lists without aux outputs.
    seconds: wall-clock seconds of the epoch (all pipelines drained).
    pipeline_seconds: per pipeline, seconds until it had drained.
    delayed_seconds: per pipeline, injected delay so far (all its stages).
    mean_group_size: per stage, the mean size of the averaging groups so
      far (P for allreduce, 2 for adpsgd, 1 for hetpipe's pushes).
    cut_short: a stop request ended the epoch (``run_epoch``'s
      ``stop_requested``, in some process), maybe before its end.
  """

  batches: list[int]
  steps: list[int]
  losses: list[list[float]]
  seconds: float
  pipeline_seconds: list[float]
  delayed_seconds: list[float]
  mean_group_size: list[float]
  aux: list[list] = dataclasses.field(default_factory=list)
  cut_short: bool = False


class _CutOnce:
  """Cuts the policy's epoch (``SyncPolicy.cut_epoch``) the first time
  ``stop_requested()`` is true in this process; ``asked``: whether it
  did."""

  def __init__(self, policy, stop_requested):
    self.policy, self.stop_requested = policy, stop_requested
    self.asked = False
    self._lock = threading.Lock()

  def check(self) -> None:
    if self.asked or self.stop_requested is None:
      return
    with self._lock:
      if not self.asked and self.stop_requested():
        self.asked = True
        self.policy.cut_epoch()


class _Tally:
  """What each of this process's pipelines did in the epoch so far."""

  def __init__(self, n: int):
    self.losses = [[] for _ in range(n)]
    self.auxes = [[] for _ in range(n)]  # Per pipeline, each call's aux.
    self.calls = [0] * n
    self.ended = [0.0] * n  # Seconds from the start until it drained.
    self.start = time.perf_counter()

  def take(self, i: int, taken) -> None:
    """A call's (loss, aux) as floats (waits for them)."""
    loss, aux = taken
    self.losses[i].append(float(loss))
    if aux is not None:
      leaves = jax.tree.leaves(aux)
      self.auxes[i].append([np.asarray(x, np.float64) for x in leaves])

  def aux_means(self) -> list:
    """Per pipeline, each flat aux leaf's mean over its calls (JSON-ready
    lists)."""
    return [_mean_leaves(calls) for calls in self.auxes]


class FreeRunningEpochs:
  """``DataParallelPipelines``' free-running epochs (a base class: uses
  its ``pipelines``, ``ranks``, ``policy``, ``hooks``, ``hub``,
  ``reporter``, ``stages_here``, ``_each``)."""

  def run_epoch(
    self,
    states,
    batch_at: Callable[[int, int], Any],
    *,
    max_batches: int | None = None,
    batches: int | None = None,
    stop_requested: Callable[[], Any] | None = None,
  ) -> tuple[list[PipelineState], EpochReport]:
    """Every pipeline trains at its own pace until the epoch ends.

    Args:
      states: the pipelines' states.
      batch_at: ``batch_at(pipeline, i)``: that pipeline's i-th batch of
        the epoch (a pipeline's own shard of the data).
      max_batches: a bound on any pipeline's batches (default 4x the
        epoch's; the epoch normally ends first).
      batches: the epoch's length where not ``batches_per_epoch`` (in its
        units: the rest of an epoch cut short).
      stop_requested: asked before each call; once true (in any
        process), the epoch ends early: every pipeline stops after its
        calls under way and drains (a preemption notice need not wait
        for the epoch's end).

    Returns:
      The drained states and an ``EpochReport``.
    """
    limit = max_batches or 4 * (batches or self.batches_per_epoch)
    # Every process has finished the last epoch before the owner of the
    # shared objects resets them, and before anyone starts.
    self.hub.barrier("epoch done")
    self.policy.new_epoch(batches)
    self.hub.barrier("epoch reset")
    cut = _CutOnce(self.policy, stop_requested)
    for hooks in self.hooks:
      hooks.draining = False
    tally = _Tally(len(self.pipelines))

    def train(i):
      return self._run_pipeline(i, states[i], batch_at, limit, cut, tally), None

    states, _ = self._each(train)
    return states, self._epoch_report(tally, cut.asked)

  def _run_pipeline(self, i, state, batch_at, limit, cut, tally):
    """This process's part of pipeline ``ranks[i]``'s epoch: its calls
    until the policy stops it, then its drain; its drained state."""
    p, pipe, pending = self.ranks[i], self.pipelines[i], []
    reports = self.reporter[p] == jax.process_index()
    while tally.calls[i] < limit:
      cut.check()
      if reports and self.policy.stop_of(p) is not None:
        self.policy.stop_feeding(p)
      if not self.policy.may_run(p, tally.calls[i]):
        break
      state, metrics = pipe.step(state, batch_at(p, tally.calls[i]))
      tally.calls[i] += 1
      if "loss" in metrics:
        pending.append((metrics["loss"], metrics.get("aux")))
      if len(pending) > 2:  # Stay at most two calls ahead of the devices.
        tally.take(i, pending.pop(0))
    self.hooks[i].draining = True
    self.policy.start_draining(p, self.stages_here[p])
    state, _ = pipe.flush(state)
    state = self._finish(pipe, p, state)
    jax.block_until_ready([x for x in state.stage_params if x is not None])
    for taken in pending:
      tally.take(i, taken)
    tally.ended[i] = time.perf_counter() - tally.start
    return state

  def _epoch_report(self, tally: _Tally, cut: bool) -> EpochReport:
    """The epoch's ``EpochReport``, on every process: each pipeline's
    figures from the process of its last stage (where it steps last),
    its injected delays summed over its processes."""
    me, aux = jax.process_index(), tally.aux_means()
    mine = {
      "reports": [
        [p, tally.calls[i], self.hooks[i].steps[-1], tally.losses[i]]
        + [tally.ended[i], aux[i]]
        for i, p in enumerate(self.ranks)
        if self.reporter[p] == me
      ],
      "delayed": [
        [p, h.delayed_seconds]
        for p, h in zip(self.ranks, self.hooks, strict=True)
      ],
      "sizes": self.policy.group_size_sums(),
      "seconds": time.perf_counter() - tally.start,
      "cut": cut,
    }
    everyone = self.hub.all_gather("epoch report", mine)
    reports = {r[0]: r[1:] for e in everyone for r in e["reports"]}
    delayed = [0.0] * self.num_pipelines
    for e in everyone:
      for p, d in e["delayed"]:
        delayed[p] += d
    sizes = [
      (
        sum(e["sizes"][s][0] for e in everyone),
        sum(e["sizes"][s][1] for e in everyone),
      )
      for s in range(self.num_stages)
    ]
    ranks = range(self.num_pipelines)
    return EpochReport(
      batches=[reports[p][0] for p in ranks],
      steps=[reports[p][1] for p in ranks],
      losses=[reports[p][2] for p in ranks],
      seconds=max(e["seconds"] for e in everyone),
      pipeline_seconds=[reports[p][3] for p in ranks],
      delayed_seconds=delayed,
      mean_group_size=[t / c if c else float("nan") for t, c in sizes],
      aux=[reports[p][4] for p in ranks],
      cut_short=any(e["cut"] for e in everyone),
    )

  def _finish(self, pipe, p, state):
    """The policy's end-of-epoch sync of pipeline p (HetPipe's last push),
    into its drained state (unchanged where the policy keeps the params)."""
    params = tuple(
      self.policy.finish(p, s, leaves) if s in self.stages_here[p] else leaves
      for s, leaves in enumerate(state.stage_params)
    )
    if all(a is b for a, b in zip(params, state.stage_params, strict=True)):
      return state
    return pipe.with_stage_params(state, params)


def _mean_leaves(calls: list) -> list:
  """Each flat aux leaf's mean over the calls (JSON-ready lists)."""
  if not calls:
    return []
  return [
    np.mean(np.stack(leaf), axis=0).tolist()
    for leaf in zip(*calls, strict=True)
  ]
