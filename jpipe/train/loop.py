"""The training loop, one for every kind of run.

``train`` owns what a run does the same way whatever trains it: resume
from the workdir's last checkpoint, advance the training state unit by
unit, log a window's mean loss and throughput, evaluate, checkpoint,
stop on request (SIGTERM / SIGINT, agreed across processes), stop a
non-finite or diverged run with a message naming the cause, a watchdog
against hangs, a progress bar, the closing summary. What differs between
kinds of run is a ``Mode``: one pipeline (``pipeline_mode.PipelineMode``),
one that re-partitions while training (``dynamic_mode.DynamicMode``) or
several pipelines in data parallel (``data_parallel_mode.
DataParallelMode``). A mode advances the state by one unit (a step; an
epoch of data-parallel batches) and says how its state is saved,
restored, evaluated and explained.

Across processes every process runs this loop with the same config and
issues its cross-process operations in one order (``jpipe.distributed``
states the rule): the unit's own (the step's transfers and its loss, or
the epoch's averaging); the stop agreement (a host exchange, every few
units: ``stopping.StopAgreement``); then, where a unit asks for them,
the flush and the gathers of evaluation and of the checkpoint (device
collectives, each behind a quiet point). No branch below on the process
index decides whether one of them runs: process 0 alone evaluates what
all gathered, prints and logs. The watchdog stops a run that hangs
anyway.
"""

import contextlib
import dataclasses
import importlib.util
import math
import os
import sys
import time
from collections.abc import Callable
from typing import Any

import jax
import numpy as np
import tqdm

from jpipe.train import checkpoint as checkpoint_lib
from jpipe.train import config_cli, stopping
from jpipe.train.compile_clock import CompileClock
from jpipe.train.errors import TrainingDiverged
from jpipe.train.metric_log import MetricLog
from jpipe.train.watchdog import Watchdog


@dataclasses.dataclass(frozen=True)
class Cadence:
  """Every how many steps the loop logs, evaluates and checkpoints (a
  unit that reaches a multiple does it; the last unit does all three)."""

  log: int
  evaluate: int
  checkpoint: int


@dataclasses.dataclass(frozen=True)
class Outcome:
  """What one unit of training did.

  Attributes:
    loss: its mean training loss.
    examples: the examples it trained on.
    metrics: the means of the loss's own metrics (``Task.has_aux``:
      ``{name: float}``), logged as ``train/<name>`` over a window.
    scalars: mode-specific scalars logged at the unit's step (full names,
      e.g. "sync/mean_group_size"), in one row with its training and
      evaluation scalars where it has them.
    events: ``{key: record}`` logged as events at the unit's step.
    lines: printed after the unit (e.g. a re-partition).
    note: what the mode adds to the unit's log line.
    skipped: its step changed nothing (a non-finite gradient, with
      ``config.optimizer.skip_nonfinite``): its loss is no divergence.
    steps: the steps it trained, where fewer than the unit's (an epoch a
      stop request cut short; the resumed run trains the rest first).
    stop_requested: a stop request ended it (the same in every process:
      the processes agree on the stop after it).
  """

  loss: float
  examples: int
  scalars: dict = dataclasses.field(default_factory=dict)
  events: dict = dataclasses.field(default_factory=dict)
  lines: tuple = ()
  note: str = ""
  metrics: dict = dataclasses.field(default_factory=dict)
  skipped: bool = False
  steps: int | None = None
  stop_requested: bool = False


def aux_floats(metrics) -> dict:
  """A step's ``metrics["aux"]`` (the loss's own metrics, ``{name:
  scalar}``) as floats (waits for them); empty without."""
  return {name: float(v) for name, v in metrics.get("aux", {}).items()}


class Mode:
  """One kind of run in the loop: the hooks ``train`` calls, in order.

  ``unit_steps`` steps make one unit (``advance``); ``cadence`` says when
  to log, evaluate and checkpoint. A hook a mode does not need keeps the
  default here.
  """

  unit_steps: int = 1

  def cadence(self, config) -> Cadence:
    t = config.train
    return Cadence(t.log_every, t.eval_every, t.checkpoint_every)

  def init(self, task) -> Any:
    """The initial training state."""
    raise NotImplementedError

  def restore(self, state, saved, meta, say) -> Any:
    """The state of checkpoint ``saved`` (``state_dict``'s layout) with
    its ``meta`` (``say``: what changes on the way). ``ValueError``: it
    does not fit."""
    raise NotImplementedError

  def announce(self, state, workdir: str, main: bool, say) -> None:
    """What the run is about to do (after any restore; every process)."""

  def watch_stop(self, stop) -> None:
    """``stop`` (a ``stopping.StopRequest``: ``stop.signal``) for a mode
    whose unit can end early on a stop request (``Outcome.steps``)."""

  def advance(self, state, unit: int) -> tuple[Any, Outcome]:
    """Trains unit ``unit`` (0-based)."""
    raise NotImplementedError

  def flush(self, state) -> Any:
    """The state with nothing in flight (before evaluation or a save)."""
    return state

  def in_flight(self, state) -> bool:
    """Whether microbatches are in flight (an asynchronous stream
    between its drains)."""
    return False

  def evaluation_inputs(self, state) -> tuple[Any, Any]:
    """(params, model state) to evaluate, on process 0 (every process
    calls it: it may gather)."""
    raise NotImplementedError

  def evaluate(self, state, task) -> dict | None:
    """``task``'s metrics at the flushed state, on process 0 (None on the
    others; every process calls it). Here: the params gathered
    (``evaluation_inputs``), then ``task.evaluate`` on process 0."""
    params, model_state = self.evaluation_inputs(state)
    if jax.process_index() != 0:
      return None
    return task.evaluate(params, model_state)

  def state_dict(self, state) -> Any:
    """The flushed state as a checkpoint holds it."""
    raise NotImplementedError

  def checkpoint_state(self, state) -> tuple[Any, bool]:
    """(What this process writes of the flushed state's checkpoint,
    whether each process writes only its own part: its leaves as arrays,
    the others' as ``jax.ShapeDtypeStruct``). Here: the state dict,
    gathered (every process calls it), written whole."""
    return jax.tree.map(np.asarray, self.state_dict(state)), False

  def checkpoint_layout(self, state) -> tuple[Any, Any]:
    """(A restore's template, in its structure whether this process needs
    each leaf; None: every leaf, the template's host arrays)."""
    return jax.tree.map(np.asarray, self.state_dict(state)), None

  def checkpoint_meta(self, done: int) -> dict:
    """What a checkpoint after ``done`` steps records beyond its step."""
    return {}

  def resumed_at(self, step: int) -> str:
    """Where a run resumed from checkpoint ``step``, for its message."""
    return self.where(step)

  def where(self, done: int) -> str:
    """The run's position after ``done`` steps, for messages."""
    return f"step {done}"

  def progress(self, done: int, steps: int) -> str:
    """The head of a log line after ``done`` of ``steps`` steps."""
    return f"step {done}/{steps}"

  def nonfinite_cause(self, state, outcome: Outcome) -> str:
    """Where a non-finite loss comes from (every process calls it)."""
    return "the loss is not a number"

  # Whether a fresh run's first unit's loss is wholly the initial
  # params' (one synchronous step), so no update can have made it.
  first_loss_at_init = False

  def nonfinite_batch(self, unit: int) -> str | None:
    """Where unit ``unit``'s data holds non-finite inputs, which (e.g.
    "step 5's batch: non-finite values in ['x']"); None: it does not, or
    the mode cannot tell."""
    return None

  def param_norms(self, state) -> list[float] | None:
    """Each stage's parameter norm, to name the stage that grew most in
    a divergence (None: not known; every process calls it)."""
    return None

  def finish(self, workdir: str) -> tuple[dict, list[str]]:
    """Entries for the closing summary and lines to print (process 0)."""
    return {}, []

  def close(self) -> None:
    """Frees what the mode holds (threads, device programs)."""


def train(
  mode: Mode,
  task,
  run,
  checkpoints,
  *,
  config,
  workdir: str,
  lr,
  fine_tune: bool,
  say: Callable,
) -> dict:
  """Trains ``task`` in ``mode`` to ``run.steps`` steps, resuming from
  ``checkpoints``' latest if there is one (``lr``: the learning rate,
  logged where it is a schedule; ``fine_tune``: a new run evaluates the
  initial params first). Returns the closing summary (process 0's; the
  others' holds their throughput only)."""
  state = mode.init(task)
  start, meta = 0, None
  if checkpoints.latest_step() is not None:
    state, start, meta = restore(mode, state, checkpoints, run.fingerprint, say)
  loop = _Loop(mode, task, config, run, checkpoints, lr, say, start, meta)
  if not start and loop.main:
    # A run starting over: an earlier config.json is of a run that left
    # no checkpoint, not an earlier state of this one (no "Resumed with
    # changed fields" against it).
    with contextlib.suppress(FileNotFoundError):
      os.remove(os.path.join(workdir, "config.json"))
  mode.announce(state, workdir, loop.main, say)
  loop.log = MetricLog(workdir, resume_step=start) if loop.main else _NoLog()
  if fine_tune and start == 0:  # Where fine-tuning starts: pretrained.
    evaluation = mode.evaluate(state, task)
    if loop.main:
      loop.log.write(0, **{f"eval/{k}": v for k, v in evaluation.items()})
      say(f"step 0: {format_evaluation(evaluation)}")
  with (
    stopping.StopRequest() as loop.stop,
    Watchdog(config.train.hang_timeout) as loop.watchdog,
    CompileClock() as loop.compiling,
  ):
    mode.watch_stop(loop.stop)
    loop.train_units(state)
  loop.close()
  return loop.summary(workdir)


class _Loop:
  """The state of a run of ``train`` between its units: the metric log,
  the throughput so far, the log window, the divergence reference, the
  last evaluation."""

  def __init__(
    self, mode, task, config, run, checkpoints, lr, say, start, resumed=None
  ):
    self.mode, self.task, self.config, self.run = mode, task, config, run
    self.checkpoints, self.lr, self.say = checkpoints, lr, say
    self.main = jax.process_index() == 0
    self.config_written = False  # (This attempt's config.json: ``_save``.)
    self.cadence = mode.cadence(config)
    self.start = start
    self.evaluation = None
    # Throughput leaves out the run's first unit (it compiles every
    # program).
    self.seconds, self.examples = 0.0, 0
    # A resumed run goes on with the checkpoint's log window (a stop
    # between two log lines: the next line's mean covers the steps before
    # it too) and its divergence reference (the run's first loss, not the
    # resumed one's: late in training that is far lower).
    resumed = resumed if isinstance(resumed, dict) else {}
    self.window = _Window.resumed(resumed.get("log_window"), start + 1)
    self.divergence = _DivergenceCheck(
      config.train.divergence_factor, resumed.get("divergence_start")
    )
    self.agree = stopping.StopAgreement()
    # Set by ``train``.
    self.log = self.stop = self.watchdog = self.compiling = None

  def train_units(self, state) -> None:
    """Every unit from the one after ``start``, to the end."""
    per_unit, steps = self.mode.unit_steps, self.run.steps
    # A bar on a terminal; in a log file (no terminal) plain lines instead.
    interactive = self.main and sys.stderr.isatty()
    self.bar = tqdm.tqdm(
      total=steps,
      initial=self.start,
      unit="step",
      dynamic_ncols=True,
      mininterval=1.0,
      disable=not interactive,
    )
    self.write = self.bar.write if interactive else self.say
    first, units = self.start // per_unit, math.ceil(steps / per_unit)
    # Steps trained before and after the unit under way (a resumed run's
    # first unit may be the rest of one cut short: ``Outcome.steps``).
    self.begin = self.done = self.start
    for unit in range(first, units):
      self.begin = self.done
      state, timed, row, outcome = self._train(state, unit, first)
      state = self._evaluate_and_save(state, unit, units, timed, row, outcome)
    self.bar.close()

  def _train(self, state, unit, first):
    """Trains ``unit``; checks its loss; logs where due. Returns (state,
    its seconds or None where it compiled, its metrics row, its
    ``Outcome``)."""
    mode = self.mode
    t0 = time.perf_counter()
    state, outcome = self._advance(state, unit)
    t1 = time.perf_counter()
    whole = outcome.steps is None
    done = self.done = (
      (unit + 1) * mode.unit_steps if whole else self.begin + outcome.steps
    )
    # Compilation left out: all of the first unit (it compiles every
    # program), a later one's where a program is first used there (a
    # stream's fused steps, a flush's).
    took = t1 - t0 - self.compiling.within(t0, t1)
    timed = took if unit > first else None
    self.watchdog.beat(f"after {mode.where(done)}", timed)
    if timed is not None:
      self.seconds += took
      self.examples += outcome.examples
    self.window.add(
      outcome.loss, outcome.examples, timed, outcome.metrics, outcome.skipped
    )
    self.bar.set_postfix(loss=f"{outcome.loss:.4f}", refresh=False)
    self.bar.update(done - self.begin)
    for key, record in outcome.events.items():
      self.log.write_event(done, key, record)
    for line in outcome.lines:
      self.write(line)
    if not np.isfinite(outcome.loss) and not outcome.skipped:
      raise TrainingDiverged(self._nonfinite(state, unit, outcome, done))
    if self.divergence.norms is None and not outcome.skipped:
      # The reference a diverged loss is measured by: the first unit's
      # (the first that stepped).
      self.divergence.begin(outcome.loss, done, mode, state)
    row = dict(outcome.scalars)  # The unit's metrics row.
    if self._due(done, self.cadence.log) or done >= self.run.steps:
      scalars = self.window.means()
      if callable(self.lr):
        scalars["learning_rate"] = self.lr(done * self.run.steps_per_call)
      row |= {f"train/{k}": v for k, v in scalars.items()}
      head = mode.progress(done, self.run.steps)
      self.write(_log_line(head, scalars, outcome.note, self.window.metrics))
      if "loss" in scalars:  # (Not where every unit skipped.)
        self.divergence.check(
          scalars["loss"],
          done,
          self.window.first_step,
          self.config,
          mode,
          state,
        )
      self.window = _Window(first_step=done + 1)
    return state, timed, row, outcome

  def _advance(self, state, unit):
    """``mode.advance``; where it fails (e.g. a bad batch, found only at
    its step), in one process the state before it is saved first: the
    steps since the last checkpoint are not lost with the traceback.
    (Across processes the others may be inside a collective: no save.)"""
    try:
      return self.mode.advance(state, unit)
    except Exception:
      begin = self.begin
      if jax.process_count() == 1 and begin > (
        self.checkpoints.latest_step() or 0
      ):
        try:
          self._save(self.mode.flush(state), begin)
          saved = f"saved step {begin} (the last good state)"
        except Exception as e:  # (Its buffers may be gone with it.)
          saved = f"could not save step {begin} ({type(e).__name__})"
        self.write(
          f"Training after step {begin} failed: {saved}; fix the error "
          "below and run the same command to resume."
        )
      raise

  def _nonfinite(self, state, unit, outcome, done) -> str:
    """What stops a run whose loss went non-finite: bad data where the
    unit's batch holds non-finite inputs, else the cause in the state."""
    where = self.mode.where(done)
    data = self.mode.nonfinite_batch(unit)
    if data:
      return (
        f"loss is non-finite at {where}: {data}; fix the data (or the "
        "task's batch_at): training did not diverge"
      )
    cause = self.mode.nonfinite_cause(state, outcome)
    if unit == 0 and self.start == 0 and self.mode.first_loss_at_init:
      # No learning rate made it.
      return (
        f"loss is non-finite at {where}, the run's first: {cause}. The "
        "model at its initialisation gives it: look at what the loss "
        "reads (labels within the model's classes, no log or division of "
        "zero) and at the initialisation"
      )
    return (
      f"loss is non-finite at {where}: {cause}. Lower "
      f"config.optimizer.learning_rate (now "
      f"{self.config.optimizer.learning_rate:g}), or resume from an "
      "earlier checkpoint"
    )

  def _evaluate_and_save(self, state, unit, units, timed, row, outcome):
    """Evaluates, checkpoints and stops where due after ``unit``."""
    mode, done = self.mode, self.done
    last = unit == units - 1 and outcome.steps is None
    evaluate = self._due(done, self.cadence.evaluate) or last
    checkpoint = self._due(done, self.cadence.checkpoint) or last
    requested = self.agree(
      done, self.stop.signal, timed, now=outcome.stop_requested
    )
    since = time.perf_counter()  # (Evaluation and checkpoint times.)
    if requested and not (evaluate or checkpoint) and mode.in_flight(state):
      self.write(
        f"note: {requested} between checkpoints drains the asynchronous "
        f"stream at step {done} (its in-flight microbatches applied), where "
        "an uninterrupted run drains at its evaluations and checkpoints "
        "only: the resumed run follows another trajectory from here. For "
        "the same one, stop at a checkpoint step, or kill the run and "
        "resume from the checkpoint before."
      )
    if evaluate or checkpoint or requested:
      # An asynchronous stream drains first (every in-flight microbatch
      # applied): what a checkpoint holds and an evaluation reads. Where
      # it drains is part of a stream's trajectory (the evaluation and
      # checkpoint steps), which a resumed run repeats.
      state = mode.flush(state)
    if evaluate:
      evaluation = self._evaluate_or_save(state, done, row)
      if self.main:
        self.evaluation = evaluation
        row |= {f"eval/{k}": v for k, v in self.evaluation.items()}
        self.write(f"step {done}: {format_evaluation(self.evaluation)}")
      self.watchdog.beat(
        f"after the evaluation at step {done}",
        other_seconds=time.perf_counter() - since,
      )
    self._write_row(done, row)
    if checkpoint or requested:
      self._save(state, done)
      self.watchdog.beat(
        f"after the checkpoint of step {done}",
        other_seconds=time.perf_counter() - since,
      )
    if requested and not last:
      self._exit(requested, done)
    return state

  def _evaluate_or_save(self, state, done, row):
    """The mode's evaluation of ``state``; where it fails (a task's or a
    config's error, found only now), the work since the last checkpoint
    is saved first, the step's row logged, then the error raised."""
    try:
      return self.mode.evaluate(state, self.task)
    except Exception:
      self._write_row(done, row)
      self._save(state, done)
      self.write(
        f"The evaluation at step {done} failed: saved step {done} to "
        f"{self.checkpoints.directory} first (fix the error below and run "
        "the same command to resume)."
      )
      raise

  def _write_row(self, done, row) -> None:
    """The step's metrics row, where it has one."""
    if row:
      # Training time so far, on from where a resumed run's logs left it
      # (evaluations, checkpoints and each start's first, compiling unit
      # left out): time to a target, on a clock.
      row["time/train_seconds"] = self.log.train_seconds + self.seconds
      self.log.write(done, **row)

  def _save(self, state, done) -> None:
    """Checkpoints ``state`` (flushed) at step ``done`` with the loop's
    and the mode's metadata; the attempt's first also writes its config
    (``config.json``: the config of the latest checkpointed state)."""
    written, per_process = self.mode.checkpoint_state(state)
    self.checkpoints.save(
      done,
      written,
      {
        "step": done,
        "fingerprint": self.run.fingerprint,
        "data_order": self.run.data_order,
      }
      | self._loop_meta()
      | self.mode.checkpoint_meta(done),
      per_process=per_process,
    )
    if self.main and not self.config_written:
      workdir = os.path.dirname(self.checkpoints.directory)
      config_cli.write_config_json(workdir, self.config)
      self.config_written = True

  def _loop_meta(self) -> dict:
    """What a resumed loop takes over: its log window so far and its
    divergence reference."""
    meta = {"log_window": self.window.to_meta()}
    if self.divergence.start is not None:
      meta["divergence_start"] = list(self.divergence.start)
    return meta

  def _due(self, done: int, every: int) -> bool:
    """Whether the unit that ended at ``done`` steps reached a multiple
    of ``every``."""
    return done // every > self.begin // every

  def _exit(self, requested, done):
    """Ends a run stopped by ``requested`` after its checkpoint."""
    self.bar.close()
    code = stopping.exit_code(requested)
    self.say(
      f"{requested}: saved {self.mode.where(done)} to "
      f"{self.checkpoints.directory}; exiting with status {code} (not "
      "finished: run the same command to resume)."
    )
    self.close()
    raise SystemExit(code)

  def close(self) -> None:
    self.log.close()
    self.checkpoints.close()
    self.mode.close()

  def summary(self, workdir) -> dict:
    """The closing summary; process 0 prints it."""
    seconds = self.seconds
    per_second = self.examples / seconds if seconds else float("nan")
    if not self.main:
      return {"examples_per_second": per_second}
    unit = "step" if self.mode.unit_steps == 1 else "epoch"
    speed = (
      f"throughput {per_second:.1f} examples/s (this run, its first "
      f"{unit} and later compilations left out)"
      if seconds
      else f"no throughput (one {unit}: compilation only)"
    )
    more, lines = self.mode.finish(workdir)
    evaluation = format_evaluation(self.evaluation)
    head = f"Done: {self.run.steps} steps; {evaluation}; {speed}."
    print("\n".join([head, _workdir_files(workdir), *lines]))
    return {"examples_per_second": per_second, "eval": self.evaluation} | more


def _workdir_files(workdir) -> str:
  """The line naming what the run keeps in its workdir (the timeline's
  files are named on their own line after it)."""
  names = [
    n + ("/" if os.path.isdir(os.path.join(workdir, n)) else "")
    for n in sorted(os.listdir(workdir))
    if not n.startswith((".", "timeline."))
  ]
  line = f"In {workdir}: {', '.join(names)}"
  if "tensorboard/" in names:
    # (The event files need no TensorBoard; viewing them does.)
    view = f"tensorboard --logdir {os.path.join(workdir, 'tensorboard')}"
    if importlib.util.find_spec("tensorboard") is None:
      view = f"pip install tensorboard; {view}"
    line += f" ({view})"
  return line + "."


def format_evaluation(evaluation: dict | None) -> str:
  if evaluation is None:
    return "no evaluation"
  return ", ".join(
    f"eval {k} {v}" if isinstance(v, int) else f"eval {k} {v:.4f}"
    for k, v in evaluation.items()
  )


def restore(mode, state, checkpoints, fingerprint, say):
  """(state, step, metadata) of the latest checkpoint."""
  template, needed = mode.checkpoint_layout(state)
  try:
    saved, meta = checkpoints.restore(
      template, fingerprint, needed=needed, say=say
    )
  except checkpoint_lib.CheckpointLayoutError as e:
    from jpipe.train import config_cli  # (Only on this error.)

    workdir = os.path.dirname(checkpoints.directory)
    path = os.path.join(workdir, "config.json")
    changed = config_cli.changed_fields(path, mode.config)
    if not changed:
      raise
    raise checkpoint_lib.CheckpointLayoutError(
      f"{e}. Changed since (config.json -> now): {changed}"
    ) from e
  try:
    state = mode.restore(state, saved, meta, say)
  except ValueError as e:
    raise checkpoint_lib.CheckpointError(
      f"checkpoint in {checkpoints.directory} does not fit this model: "
      f"{e}; delete it or use another --workdir"
    ) from e
  step = meta.get("step") if isinstance(meta, dict) else None
  if type(step) is not int or step < 0:
    raise checkpoint_lib.CheckpointError(
      f"the latest checkpoint in {checkpoints.directory} has no step count "
      f"in its metadata (step {step!r}): it was edited or damaged; delete "
      "it or use another --workdir"
    )
  say(f"Resuming from {mode.resumed_at(step)} ({checkpoints.directory}).")
  return state, step, meta


def _log_line(head: str, scalars: dict, note: str, metrics=()) -> str:
  line = f"{head}: train loss {scalars.get('loss', float('nan')):.4f}"
  for name in metrics:  # The loss's own (Task.has_aux).
    line += f", train {name} {scalars[name]:.4f}"
  if scalars.get("skipped_steps"):
    line += f", {scalars['skipped_steps']:.0f} skipped (non-finite)"
  if "examples_per_second" in scalars:
    line += f", {scalars['examples_per_second']:.0f} examples/s"
  return line + (f", {note}" if note else "")


class _Window:
  """What happened since the last log line: per-unit losses, examples
  and seconds (a compiling first unit has no seconds)."""

  def __init__(self, first_step: int = 1):
    self.first_step = first_step
    self.losses, self.examples, self.seconds = [], 0, 0.0
    self.metrics = {}  # name -> per-unit values (Task.has_aux)
    self.skipped = 0  # units whose step changed nothing

  @classmethod
  def resumed(cls, saved, first_step: int) -> "_Window":
    """The window a checkpoint saved (``to_meta``), or a new one from
    ``first_step`` (none saved, or an unreadable one)."""
    window = cls(first_step)
    try:
      window.first_step = int(saved["first_step"])
      window.losses = [float(x) for x in saved["losses"]]
      window.examples = int(saved["examples"])
      window.seconds = float(saved["seconds"])
      window.metrics = {
        str(k): [float(x) for x in v] for k, v in saved["metrics"].items()
      }
      window.skipped = int(saved.get("skipped", 0))
    except (TypeError, KeyError, ValueError, AttributeError):
      return cls(first_step)
    return window

  def to_meta(self) -> dict:
    """The window as JSON, for a checkpoint's metadata."""
    return {
      "first_step": self.first_step,
      "losses": [float(x) for x in self.losses],
      "examples": int(self.examples),
      "seconds": float(self.seconds),
      "metrics": {k: [float(x) for x in v] for k, v in self.metrics.items()},
      "skipped": self.skipped,
    }

  def add(self, loss, examples, seconds, metrics=None, skipped=False):
    if skipped:  # (Its loss is not finite: no mean of the window's.)
      self.skipped += 1
    else:
      self.losses.append(loss)
      for name, value in (metrics or {}).items():
        self.metrics.setdefault(name, []).append(value)
    if seconds is not None:
      self.examples += examples
      self.seconds += seconds

  def means(self) -> dict:
    """``loss``: the window's mean (left out where every unit skipped);
    ``examples_per_second``: the window's (left out when its only unit
    compiled); ``skipped_steps``: units that skipped, where any did."""
    out = {"loss": float(np.mean(self.losses))} if self.losses else {}
    out |= {name: float(np.mean(v)) for name, v in self.metrics.items()}
    if self.skipped:
      out["skipped_steps"] = float(self.skipped)
    if self.seconds:
      out["examples_per_second"] = self.examples / self.seconds
    return out


class _DivergenceCheck:
  """Stops a run whose mean loss rose far above its start: ``factor``
  times the loss of the run's first unit (0 turns the check off; a
  resumed run keeps its first run's, ``start``: ``(loss, step)``). Names
  the stage whose params grew most since this process's first unit,
  where the mode knows."""

  def __init__(self, factor: float, start=None):
    self.factor = factor
    self.start = None
    if factor and start is not None:
      loss, step = start
      self.start = (float(loss), int(step))
    self.norms = None  # (step, each stage's param norm) at this start

  def begin(self, loss, step, mode, state):
    if self.factor:
      if self.start is None:
        self.start = (loss, step)
      self.norms = (step, mode.param_norms(state))

  def check(self, loss, step, first_step, config, mode, state):
    if self.start is None:
      return
    start, at = self.start
    if start <= 0 or loss <= self.factor * start:
      return
    grew = ""
    norms_at, norms = self.norms or (None, None)
    now = mode.param_norms(state) if norms is not None else None
    if now is not None and len(now) == len(norms):
      growth = [n / max(b, 1e-30) for n, b in zip(now, norms, strict=True)]
      stage = int(np.argmax(growth))
      grew = (
        f"; stage {stage}'s params grew most since step {norms_at} "
        f"({growth[stage]:.3g}x in norm)"
      )
    raise TrainingDiverged(
      f"training diverged at step {step}: the mean loss of steps "
      f"{first_step}-{step} is {loss:.4g}, over "
      f"config.train.divergence_factor={self.factor:g} times its start "
      f"({start:.4g} at step {at}){grew}. Lower "
      f"config.optimizer.learning_rate (now "
      f"{config.optimizer.learning_rate:g}) or set "
      f"config.train.divergence_factor=0 to train on regardless"
    )


class _NoLog:
  """The metric log of processes other than 0."""

  train_seconds = 0.0

  def write(self, step, **scalars):
    pass

  def write_event(self, step, key, value):
    pass

  def close(self):
    pass
