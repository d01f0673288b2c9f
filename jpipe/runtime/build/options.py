"""The staleness options of a pipeline, as one validated value.

``Staleness`` holds what decides how an asynchronous pipeline treats
stale weights (PipeDream's weight stashing, FTPipe's weight prediction and
Gap-Aware, ``step_every``) and whether backwards recompute their forward;
``check`` refuses the combinations the semantics do not define, with one
clear line each.
"""

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

import jax
import optax

from jpipe import schedule as schedule_lib
from jpipe import staleness as staleness_lib

PREDICTIONS = (None, "msnag", "aggmsnag")
GAP_AWARE = (None, "ga", "ga_jfl", "ga_from_grad")
PARTIAL_WINDOWS = ("mean", "ftpipe")
# FTPipe's stage policies for Gap-Aware, by stage depth (n - 1 - s).
GAP_AWARE_POLICIES = {
  "all_except_last": lambda depth: depth != 0,
  "almost_last_partition": lambda depth: depth == 1,
  "all_except_last_two": lambda depth: depth >= 2,
}


def _check_values(
  prediction, gap_aware, gap_aware_policy, step_every, partial_window
):
  """Each option alone: a known name, a positive count."""
  if partial_window not in PARTIAL_WINDOWS:
    raise ValueError(
      f"unknown partial_window {partial_window!r}: one of {PARTIAL_WINDOWS}"
    )
  if prediction not in PREDICTIONS:
    raise ValueError(f"unknown prediction {prediction!r}: one of {PREDICTIONS}")
  if gap_aware not in GAP_AWARE:
    raise ValueError(f"unknown gap_aware {gap_aware!r}: one of {GAP_AWARE}")
  if gap_aware_policy not in GAP_AWARE_POLICIES:
    raise ValueError(
      f"unknown gap_aware_policy {gap_aware_policy!r}: one of "
      f"{tuple(GAP_AWARE_POLICIES)}"
    )
  if step_every < 1:
    raise ValueError(f"step_every must be >= 1, got {step_every}")


def _check_gap_aware(gap_aware, gap_aware_options, step_every, recompute):
  """Gap-Aware's own needs: its optimizer named, one microbatch a step,
  and (``ga_jfl``) recomputation."""
  if not gap_aware_options or "optimizer" not in gap_aware_options:
    raise ValueError(
      "gap_aware needs gap_aware_options with at least 'optimizer' "
      "('sgd', 'adam' or 'adamw') and the learning rate, e.g. "
      "{'optimizer': 'sgd', 'learning_rate': 0.1}"
    )
  if step_every != 1:
    raise ValueError(
      f"gap_aware needs step_every=1 (FTPipe), got {step_every}: a step "
      "then applies one microbatch whose forward params define the gap"
    )
  if gap_aware == "ga_jfl" and not recompute:
    raise ValueError(
      "gap_aware='ga_jfl' recomputes the backward at the current params; "
      "without recomputation the saved residuals pin the forward's params: "
      "use recompute=True or gap_aware='ga'"
    )


def _check_delay_corrections(
  pipemare_anneal_steps, stage_optimizer, last_stage_optimizer, prediction
):
  """PipeMare's rescheduling and per-stage optimizers: a positive K, one
  source of the last stage's optimizer, no prediction (it replays
  ``optimizer``, not the stage's own)."""
  if pipemare_anneal_steps is not None and not (
    isinstance(pipemare_anneal_steps, int) and pipemare_anneal_steps >= 2
  ):
    raise ValueError(
      f"pipemare_anneal_steps must be an int >= 2 (optimizer steps over "
      f"which a stage's rate returns from 1/delay to 1; 1 would reschedule "
      f"nothing), got {pipemare_anneal_steps!r}"
    )
  if stage_optimizer is not None and not callable(stage_optimizer):
    raise ValueError(
      "stage_optimizer must be a function (delay, num_stages) -> optax "
      f"optimizer, got {type(stage_optimizer).__name__}"
    )
  if stage_optimizer is not None and last_stage_optimizer is not None:
    raise ValueError(
      "stage_optimizer already gives the last stage its optimizer: drop "
      "last_stage_optimizer (or return it from stage_optimizer for "
      "delay 0)"
    )
  corrected = pipemare_anneal_steps is not None or stage_optimizer is not None
  if corrected and prediction is not None:
    raise ValueError(
      "prediction replays the pipeline's optimizer, not a stage's own "
      "(stage_optimizer) or rescheduled one (pipemare_anneal_steps): use "
      "one of them, or prediction alone"
    )


def check_staleness_options(schedule, **options) -> None:
  """Clear errors for option combinations the semantics do not define:
  ``options`` are ``Staleness``' fields by name (the ones not given take
  its defaults); ``schedule`` a name or ``ScheduleKind``."""
  _check_combinations(schedule_lib.lookup(schedule), Staleness(**options))


def _check_combinations(kind, st: "Staleness") -> None:
  """``st``'s options against each other and the schedule ``kind``."""
  _check_values(
    st.prediction,
    st.gap_aware,
    st.gap_aware_policy,
    st.step_every,
    st.partial_window,
  )
  if st.nag_with_predictor and st.prediction is None:
    raise ValueError(
      "nag_with_predictor predicts a delay-0 forward one step ahead: it "
      "needs prediction='msnag' or 'aggmsnag'"
    )
  _check_ftpipe_stale(kind, st)
  _check_flush(kind, st)
  _check_delay_corrections(
    st.pipemare_anneal_steps,
    st.stage_optimizer,
    st.last_stage_optimizer,
    st.prediction,
  )
  _check_mitigations_and_window(kind, st)
  if st.gap_aware is not None:
    _check_gap_aware(
      st.gap_aware, st.gap_aware_options, st.step_every, st.recompute
    )
  if st.gap_aware == "ga_from_grad":
    _check_gap_from_grad(st.gap_aware_options, st.weight_stashing)


def _check_gap_from_grad(options, weight_stashing) -> None:
  """FTPipe's estimate from the gradient: SGD's or Adam's, without a
  stash (a stash gives the exact gap at no cost)."""
  if weight_stashing:
    raise ValueError(
      "gap_aware='ga_from_grad' estimates the gap where no stash is kept; "
      "with weight stashing the stash gives the exact gap: use "
      "gap_aware='ga'"
    )
  if options["optimizer"] == "adamw":
    raise ValueError(
      "gap_aware='ga_from_grad' has estimates for 'sgd' and 'adam' (FTPipe "
      "has none for AdamW): use gap_aware='ga' (the exact gap)"
    )


def _check_ftpipe_stale(kind, st: "Staleness") -> None:
  """FTPipe's last-stage optimizer and virtual stages: for a stale
  schedule (``ScheduleKind.stale``) only."""
  stale = " or ".join(repr(n) for n in schedule_lib.STALE)
  if st.last_stage_optimizer is not None and not kind.stale:
    raise ValueError(
      f"last_stage_optimizer (FTPipe's nesterov_set_for_last_partition) is "
      f"for the asynchronous schedule {stale}, not {kind.name!r}"
    )
  supremum = st.supremum_staleness
  if supremum is not None:
    if not kind.stale:
      raise ValueError(
        f"supremum_staleness caps the delays of the asynchronous schedule "
        f"{stale} (FTPipe's virtual_stages_1f1b), not {kind.name!r}"
      )
    if supremum != "auto" and not (isinstance(supremum, int) and supremum >= 1):
      raise ValueError(
        f"supremum_staleness must be 'auto' (the devices) or an int >= 1, "
        f"got {supremum!r}"
      )


def _check_flush(kind, st: "Staleness") -> None:
  """How a streaming schedule (``ScheduleKind.asynchronous``) flushes:
  its short window's step, its split backward."""
  streams = " and ".join(repr(n) for n in schedule_lib.STREAMS)
  if st.partial_window != "mean" and not kind.asynchronous:
    raise ValueError(
      f"partial_window is how {streams} step a short step_every "
      f"window at a flush; {kind.name!r} steps once per call"
    )
  if st.split_flush and not kind.asynchronous:
    raise ValueError(
      f"split_flush splits the flush of a streaming schedule "
      f"{schedule_lib.STREAMS}; {kind.name!r} flushes every call: for its "
      "backward split use schedule 'zbh1', 'zbh2', 'zbv', 'dualpipev' or "
      "'interleaved_zb'"
    )


def _check_mitigations_and_window(kind, st: "Staleness") -> None:
  """The mitigations (a stale schedule only), then the step window (a
  streaming schedule only; 2BW's a whole minibatch)."""
  stale = " or ".join(repr(n) for n in schedule_lib.STALE)
  streams = " and ".join(repr(n) for n in schedule_lib.STREAMS)
  mitigations = {
    "weight_stashing": st.weight_stashing,
    "prediction": st.prediction,
    "gap_aware": st.gap_aware,
    "last_stage_optimizer": st.last_stage_optimizer,
    "pipemare_anneal_steps": st.pipemare_anneal_steps,
    "stage_optimizer": st.stage_optimizer,
  }
  used = [k for k, v in mitigations.items() if v]
  if used and not kind.stale:
    raise ValueError(
      f"{used} apply to the asynchronous schedule {stale}; {kind.name!r} "
      f"has no stale gradients to mitigate"
    )
  if st.step_every != 1 and not kind.asynchronous:
    raise ValueError(
      f"step_every applies to {streams} (got schedule {kind.name!r}); "
      "synchronous schedules step once per call"
    )
  if kind.two_versions and st.step_every == 1:
    raise ValueError(
      f"{kind.name} needs step_every = microbatches per minibatch "
      "(>= num_stages)"
    )


@dataclasses.dataclass(frozen=True)
class Staleness:
  """How a pipeline handles stale weights: ``jpipe.Pipeline``'s
  staleness options, each also its keyword argument of the same name.

  Attributes:
    recompute: backward recomputes the forward (True) or keeps residuals
      (FTPipe's ``nr``). ``async`` without weight stashing and without
      recomputation: the backward reads the forward's activations (every
      intermediate saved) with the current params -- weight gradients
      from forward-time activations, input gradients at the current
      weights (PipeDream without stashing).
    step_every: ``async``: a stage steps after every ``step_every``
      backwards, on their mean gradient (a flush steps on a partial
      window's mean); ``2bw``: microbatches per minibatch (>= num_stages).
    weight_stashing: ``async``: the backward recomputes at the params its
      forward used (PipeDream). Costs up to d + 1 param versions per stage.
    prediction: ``async``: None, "msnag" (predict the params ``delay``
      steps ahead with zero future gradients) or "aggmsnag" (the first
      future step uses the gradient accumulated so far).
    predictor: the ``staleness.Predictor`` to use; default
      ``staleness.replay_predictor(optimizer)`` (any optax optimizer,
      scheduler-aware by itself). Pass ``staleness.weight_predictor(...)``
      for FTPipe's closed forms.
    learning_rate_schedule: with a closed-form ``predictor``, the schedule
      that makes prediction scheduler-aware (future learning rates).
    gap_aware: ``async``: None, "ga" (FTPipe's Gap-Aware; the gap is
      between the params the forward used and those the step updates) or
      "ga_jfl" (the same gap, but the backward recomputes at the current
      params: only the loss signal is stale; needs recompute) or
      "ga_from_grad" (FTPipe's estimate of a one-step-late stage's gap from
      its gradient, no forward params kept: SGD, Adam -- give Adam's
      ``adam_betas`` in ``gap_aware_options`` -- on stages of delay 1).
    gap_aware_options: keyword arguments of ``staleness.gap_aware``
      (``optimizer`` "sgd" | "adam" | "adamw", ``learning_rate``,
      ``weight_decay``, ``beta``...); required with ``gap_aware``.
    gap_aware_policy: which stages apply it, by depth (FTPipe):
      "all_except_last" (default), "almost_last_partition",
      "all_except_last_two".
    nag_with_predictor: ``async`` with prediction: FTPipe's option -- a
      forward of delay 0 (the last stage's, warm-up forwards) is
      predicted one step ahead (a NAG look-ahead) instead of not at all.
    last_stage_optimizer: ``async``: the last stage's own optimizer, and
      no prediction there. FTPipe's ``nesterov_set_for_last_partition``
      is ``optax.sgd(lr, momentum, nesterov=True)`` beside a momentum-SGD
      ``optimizer``. Its state must be shaped like the optimizer's (one
      checkpoint holds every stage's).
    partial_window: how ``async`` / ``2bw`` step a ``step_every`` window
      cut short by a flush (r of ``step_every`` microbatches): "mean"
      (default: on the mean of its r gradients) or "ftpipe" (FTPipe's: on
      their sum over ``step_every``, the update scaled by r /
      ``step_every`` -- its learning rate times r / se).
    supremum_staleness: ``async``: FTPipe's ``virtual_stages_1f1b`` for
      a mixed pipe (more stages than devices): stage s's warm-up and
      delay is its virtual depth ``max(0, min(n, S - 1) - 1 - s)``
      (``jpipe.schedule.virtual_stage_warmups``) instead of ``n - 1 - s``;
      a stage of depth 0 runs each backward right after its forward. S:
      an int, or "auto" (the pipeline's devices, FTPipe's default). None:
      1F1B's delays.
    split_flush: ``async``, ``2bw``: a flush's pending backwards run as
      the input gradient I, then the weight gradient W (zero-bubble's
      split): the stage before waits for I only. Same steps, same delays
      (``jpipe.schedule.Stream``); the drain, the stream's only bubble,
      is shorter by about ``n - 2`` W's. Compiles the I and W programs.
    pipemare_anneal_steps: ``async``: PipeMare's learning-rate
      rescheduling (``staleness.pipemare_learning_rate``): a stage whose
      gradients are d steps late scales the update after k earlier steps
      by ``d ** -(1 - min((k + 1) / K, 1))`` (1 for d <= 1), K this many
      steps. None: off.
    stage_optimizer: ``async``: ``(delay, num_stages) -> optax optimizer``,
      each stage's own optimizer from its steady-state delay (in steps)
      instead of ``optimizer`` -- e.g. the delay-aware Nesterov method
      with adaptive momentum, ``lambda d, n:
      staleness.delay_aware_nesterov(lr, delay=d, num_stages=n,
      adaptive=True)``. It must build one state layout for every delay
      (one checkpoint holds every stage's; checked against delay 0's).
  """

  recompute: bool = True
  step_every: int = 1
  weight_stashing: bool = False
  prediction: str | None = None
  predictor: staleness_lib.Predictor | None = None
  learning_rate_schedule: Callable[[Any], Any] | None = None
  gap_aware: str | None = None
  gap_aware_options: Mapping[str, Any] | None = None
  gap_aware_policy: str = "all_except_last"
  split_flush: bool = False
  nag_with_predictor: bool = False
  last_stage_optimizer: optax.GradientTransformation | None = None
  partial_window: str = "mean"
  supremum_staleness: int | str | None = None
  pipemare_anneal_steps: int | None = None
  stage_optimizer: Callable[[int, int], optax.GradientTransformation] | None = (
    None
  )

  def check(self, schedule, optimizer=None, params=None) -> None:
    """Raises ValueError for options ``schedule`` does not define, and
    (given the optimizer and params) for Gap-Aware told another optimizer
    than the one the pipeline runs: it would read its statistics by the
    wrong name, silently."""
    # (Any predictor suits any combination the checks allow.)
    _check_combinations(schedule_lib.lookup(schedule), self)
    if self.last_stage_optimizer is not None and optimizer is not None:
      want = jax.tree.structure(jax.eval_shape(optimizer.init, params))
      got = jax.tree.structure(
        jax.eval_shape(self.last_stage_optimizer.init, params)
      )
      if want != got:
        raise ValueError(
          "last_stage_optimizer's state is not shaped like the optimizer's "
          "(one checkpoint holds every stage's state): use the same "
          "optimizer family, e.g. optax.sgd(lr, momentum, nesterov=True) "
          "beside optax.sgd(lr, momentum)"
        )
    if self.gap_aware is not None and optimizer is not None:
      staleness_lib.check_state_matches(
        jax.eval_shape(optimizer.init, params),
        self.gap_aware_options["optimizer"],
        "Pipeline(gap_aware_options={'optimizer': ...})",
      )

  @property
  def stashes(self) -> bool:
    """Whether backwards differentiate at their forward's params (weight
    stashing keeps their versions)."""
    return self.weight_stashing

  def residuals_from_current_params(self, schedule) -> bool:
    """Whether backwards read saved residuals with newer params than the
    forward's (a stale schedule, ``ScheduleKind.stale``, with no
    recomputation and no stashing): then every intermediate is saved,
    so all activations are the forward's."""
    stale = schedule_lib.lookup(schedule).stale
    return stale and not self.recompute and not self.stashes

  def stage_predictor(self, optimizer) -> staleness_lib.Predictor | None:
    """The predictor forwards use, or None without prediction."""
    if self.prediction is None:
      return None
    return self.predictor or staleness_lib.replay_predictor(optimizer)

  def stage_transform(
    self,
    optimizer: optax.GradientTransformation,
    delay: int,
    num_stages: int,
  ) -> optax.GradientTransformation:
    """The optimizer of a stage whose steady-state delay is ``delay``
    steps: ``stage_optimizer``'s (else ``optimizer``), rescheduled by
    PipeMare where ``pipemare_anneal_steps`` is set."""
    tx = optimizer
    if self.stage_optimizer is not None:
      tx = self.stage_optimizer(delay, num_stages)
      if not isinstance(tx, optax.GradientTransformation):
        raise ValueError(
          f"stage_optimizer({delay}, {num_stages}) returned "
          f"{type(tx).__name__}, not an optax GradientTransformation"
        )
    if self.pipemare_anneal_steps is not None:
      tx = optax.chain(
        tx,
        staleness_lib.pipemare_learning_rate(delay, self.pipemare_anneal_steps),
      )
    return tx

  def stream_warmups(self, num_stages: int, num_devices: int):
    """Per stage, the stream's warm-up forwards under
    ``supremum_staleness`` (None: 1F1B's)."""
    if self.supremum_staleness is None:
      return None
    cap = self.supremum_staleness
    return schedule_lib.virtual_stage_warmups(
      num_stages, num_devices if cap == "auto" else cap
    )

  def gap_aware_at(self, delay: int) -> dict[str, Any] | None:
    """Gap-Aware's options for a stage whose steady-state delay is
    ``delay``, or None where the policy leaves it out."""
    if self.gap_aware is None:
      return None
    if not GAP_AWARE_POLICIES[self.gap_aware_policy](delay):
      return None
    if self.gap_aware != "ga_from_grad":
      return dict(self.gap_aware_options)
    if delay > 1:
      raise ValueError(
        f"gap_aware='ga_from_grad' estimates one step's gap (FTPipe's "
        f"apply_from_grad), but gap_aware_policy={self.gap_aware_policy!r} "
        f"puts it on a stage {delay} steps late: use "
        "gap_aware_policy='almost_last_partition' (the stage 1 step late), "
        "or gap_aware='ga' (the exact gap)"
      )
    return dict(self.gap_aware_options, gap_from_grad=True)


def staleness_from_keywords(
  staleness: Staleness | None, **keywords
) -> Staleness:
  """``staleness``, or one made from ``Pipeline``'s keyword spelling of
  the same options; both at once is refused (which would win?)."""
  if staleness is None:
    return Staleness(**keywords)
  defaults = Staleness()
  given = [k for k, v in keywords.items() if v != getattr(defaults, k)]
  if given:
    raise ValueError(
      f"staleness options given twice: staleness=Staleness(...) and "
      f"{given}; put them all in the Staleness value"
    )
  return staleness
