"""Config -> data -> Pipeline -> loop, evaluation, checkpoints, logs.

Small top-level functions (build the model, the optimizer, the pipeline)
and ``train_and_evaluate``, the imperative shell that runs them.
"""

import dataclasses
import os
import sys
import tempfile
import time

import jax
import ml_collections
import numpy as np
import optax
import tqdm

import jpipe
from jpipe import schedule as schedule_lib
from jpipe.dynamic import describe
from jpipe.runtime import format_bytes
from jpipe.train import checkpoint as checkpoint_lib
from jpipe.train import (
  config_check,
  data_parallel_lib,
  dynamic_lib,
  pretrained,
  stopping,
)
from jpipe.train import run as run_lib
from jpipe.train.errors import TrainingDiverged, UsageError
from jpipe.train.metric_log import MetricLog, read_metrics
from jpipe.train.tasks import Task, build_task
from jpipe.train.watchdog import Watchdog


def learning_rate(config):
  """A constant or warm-up + cosine schedule (per optimizer step)."""
  opt = config.optimizer
  if opt.schedule == "constant":
    return opt.learning_rate
  steps = config.train.steps * run_lib.steps_per_call(config)
  warmup = max(opt.warmup_steps, 1)
  # A run shorter than its warm-up (a quick try of a config) decays over
  # one step after it rather than failing.
  return optax.warmup_cosine_decay_schedule(
    0.0, opt.learning_rate, warmup, max(steps, warmup + 1)
  )


def build_optimizer(config, lr):
  opt = config.optimizer
  if opt.name == "sgd":
    tx = optax.sgd(lr, momentum=opt.momentum or None)
    if opt.weight_decay:
      tx = optax.chain(optax.add_decayed_weights(opt.weight_decay), tx)
    return tx
  if opt.name == "adam":
    tx = optax.adam(lr)
    if opt.weight_decay:
      tx = optax.chain(optax.add_decayed_weights(opt.weight_decay), tx)
    return tx
  return optax.adamw(lr, weight_decay=opt.weight_decay)


def pipeline_options(config, task: Task, lr) -> dict:
  """``jpipe.Pipeline``'s keyword arguments beyond the model and batch,
  as the config says (but ``devices`` and ``optimizer``)."""
  kwargs = {}
  if task.model_state is not None:
    kwargs["model_state"] = task.model_state
  return dict(
    num_stages=config.pipeline.num_stages,
    schedule=config.schedule.name,
    num_microbatches=config.pipeline.num_microbatches,
    partition=config.pipeline.partition,
    depth=config.pipeline.depth or None,  # 0: automatic
    bandwidth=config.pipeline.bandwidth or None,
    cost_model=config.pipeline.cost_model,
    staleness=config_check.staleness(config, lr),
    fuse_last_stage=config.pipeline.fuse_last_stage,
    transport=config.pipeline.transport,
    memory_limit=config_check.memory_limit(config.pipeline.memory_limit),
    **kwargs,
  )


def build_pipeline(config, task: Task, example_batch, tx, lr):
  options = pipeline_options(config, task, lr)
  try:
    return jpipe.Pipeline(
      task.loss_fn,
      task.params,
      example_batch,
      devices=jax.devices(),
      optimizer=tx,
      **options,
    )
  except ValueError as e:
    if "memory_limit" not in str(e):
      raise
    # The prediction, or no split fitting: both name their fixes.
    raise UsageError(f"config.pipeline.memory_limit: {e}") from e


def train_and_evaluate(config: ml_collections.ConfigDict, workdir: str) -> dict:
  """Trains as the config says, resuming from ``workdir`` if it has a
  checkpoint. Returns the closing summary (also printed).

  What can be checked cheaply is checked before the data, the trace and
  the partition: the config, the workdir (writable), the checkpoint
  (written for this model; a finished run says so and stops). A SIGTERM
  or SIGINT finishes the step, checkpoints and exits with 128 + the
  signal's number (143, 130): the run did not finish.

  Across processes (``jpipe.distributed.initialize`` first; every process
  calls this with the same config and workdir, which several hosts must
  share): each process runs its stages; process 0 alone prints, logs,
  evaluates and draws; checkpoints are written by all together (the
  partition-independent state dict, so another process count resumes
  it).
  """
  run = run_lib.describe(config)
  config_check.check_devices(config, jax.devices())
  main = jax.process_index() == 0
  say = print if main else _quiet
  _check_workdir(workdir)
  checkpoints = checkpoint_lib.Checkpoints(
    workdir, config.train.keep_checkpoints
  )
  saved_step = checkpoints.latest_step()
  checkpoints.check_fingerprint(run.fingerprint)
  steps = config.train.steps
  if saved_step is not None and saved_step >= steps:
    checkpoints.close()
    return _already_done(config, workdir, saved_step, say)
  fine_tune = bool(config.init_from) and saved_step is None
  if fine_tune:
    pretrained.check_source(config.init_from)
  bs = config.data.batch_size
  task = build_task(config)
  if fine_tune:
    task = _from_pretrained(config, task, say)
  example = task.batch_at(0)
  lr = learning_rate(config)
  tx = _frozen(config, task.params, build_optimizer(config, lr), say)
  if run.data_parallel:
    options = pipeline_options(config, task, lr) | {"optimizer": tx}
    dp = data_parallel_lib.build(
      config, task, example, options, run.steps_per_call
    )
    return data_parallel_lib.train(
      config,
      workdir,
      task,
      dp,
      checkpoints,
      saved_step,
      run.fingerprint,
      say,
    )
  if run.dynamic:
    pipe = dynamic_lib.build(
      config, task, example, tx, pipeline_options(config, task, lr)
    )
  else:
    pipe = build_pipeline(config, task, example, tx, lr)
  state = pipe.init(task.params, task.model_state)
  start = 0
  if saved_step is not None:
    template = jax.tree.map(np.asarray, pipe.state_dict(state))
    saved, meta = checkpoints.restore(template, run.fingerprint)
    try:
      state = pipe.load_state_dict(saved)
      if run.dynamic:
        pipe.start_at(int(meta["step"]))
      if run.dynamic and "plan" in meta:  # The split in force.
        state = pipe.move_to(state, meta["plan"])
        say(f"Resuming on the split in force: {describe(meta['plan'])}")
    except ValueError as e:
      raise checkpoint_lib.CheckpointError(
        f"checkpoint in {checkpoints.directory} does not fit this model: "
        f"{e}; delete it or use another --workdir"
      ) from e
    start = int(meta["step"])
    say(f"Resuming from step {start} ({checkpoints.directory}).")
  if main:
    _print_plan(pipe)
    _write_run_files(workdir, config, pipe)
  log = MetricLog(workdir, resume_step=start) if main else _NoLog()
  if fine_tune and main:  # Where fine-tuning starts: the pretrained loss.
    evaluation = task.evaluate(task.params, task.model_state)
    log.write(0, **{f"eval/{k}": v for k, v in evaluation.items()})
    say(f"step 0: {_format(evaluation)}")
  profile_last = config.train.profile_last_step
  if profile_last and pipe.transport.multiprocess:
    say(
      "train.profile_last_step: no timeline across processes (each sees "
      "only its own stages); profile a one-process run of this config"
    )
    profile_last = False

  def save(step, state):
    checkpoints.save(
      step,
      jax.tree.map(np.asarray, pipe.state_dict(state)),
      {"step": step, "fingerprint": run.fingerprint}
      | ({"plan": list(pipe.boundaries)} if run.dynamic else {}),
    )

  evaluation = timeline = None
  # Throughput leaves out the run's first step (it compiles every program).
  seconds, examples = 0.0, 0
  window = _Window()
  divergence = _DivergenceCheck(config.train.divergence_factor)
  # A bar on a terminal; in a log file (no terminal) plain lines instead.
  interactive = main and sys.stderr.isatty()
  # Across processes, every process issues the loop's cross-process
  # operations in one order (jpipe.distributed states the rule): the
  # step's transfers (and the loss, shared with every process); the stop
  # agreement (a host exchange, every few steps: StopAgreement); then,
  # where a step asks for them, the flush's transfers and the gathers of
  # evaluation and of the checkpoint (device collectives, each behind a
  # quiet point). No branch below on the process index decides whether
  # one of them runs: process 0 alone evaluates what all gathered (on its
  # own devices), prints and logs. The watchdog stops a run that hangs
  # anyway.
  agree = stopping.StopAgreement()
  with (
    stopping.StopRequest() as stop,
    Watchdog(config.train.hang_timeout) as watchdog,
  ):
    bar = tqdm.tqdm(
      total=steps,
      initial=start,
      unit="step",
      dynamic_ncols=True,
      mininterval=1.0,
      disable=not interactive,
    )
    write = bar.write if interactive else say
    # Across processes, one whose stages read no batch leaf reads no data.
    shapes = jax.tree.map(
      lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), example
    )
    for step in range(start, steps):
      batch = task.batch_at(step) if pipe.reads_batch else shapes
      # The last step is profiled: its programs are compiled by then.
      profile = profile_last and step == steps - 1
      t0 = time.perf_counter()
      state, metrics = pipe.step(state, batch, profile=profile)
      loss = float(metrics["loss"])  # Blocks: the step's losses are in.
      took = time.perf_counter() - t0
      watchdog.beat(f"after step {step + 1}", took if step > start else None)
      if step > start:
        seconds += took
        examples += bs
      window.add(loss, bs, took if step > start else None)
      if profile:
        timeline = (step + 1, metrics["timeline"])
      done = step + 1
      bar.set_postfix(loss=f"{loss:.4f}", refresh=False)
      bar.update(1)
      if run.dynamic:
        dynamic_lib.report(metrics, done, log, write)
      if not np.isfinite(loss):
        raise TrainingDiverged(_nonfinite_message(config, pipe, state, done))
      if step == start:  # The reference a diverged loss is measured by.
        divergence.begin(loss, done, pipe, state)
      if done % config.train.log_every == 0 or done == steps:
        scalars = window.means()
        if callable(lr):
          scalars["learning_rate"] = lr(done * run.steps_per_call)
        log.write(done, **{f"train/{k}": v for k, v in scalars.items()})
        write(_log_line(done, steps, scalars))
        divergence.check(
          scalars["loss"], done, window.first_step, config, pipe, state
        )
        window = _Window(first_step=done + 1)
      evaluate = done % config.train.eval_every == 0 or done == steps
      checkpoint = done % config.train.checkpoint_every == 0 or done == steps
      requested = agree(done, stop.signal, took if step > start else None)
      since = time.perf_counter()  # (Evaluation and checkpoint times.)
      if evaluate or checkpoint or requested:
        # An asynchronous stream drains first (every in-flight microbatch
        # applied), so a resumed run continues as an uninterrupted one.
        state, _ = pipe.flush(state)
      if evaluate:
        # Every process gathers (a collective); process 0 evaluates.
        params = pipe.gather_params(state)
        model_state = pipe.gather_model_state(state)
        if main:
          evaluation = task.evaluate(params, model_state)
          log.write(done, **{f"eval/{k}": v for k, v in evaluation.items()})
          write(f"step {done}: {_format(evaluation)}")
        watchdog.beat(
          f"after the evaluation at step {done}",
          other_seconds=time.perf_counter() - since,
        )
      if checkpoint or requested:
        save(done, state)
        watchdog.beat(
          f"after the checkpoint of step {done}",
          other_seconds=time.perf_counter() - since,
        )
      if requested:
        bar.close()
        code = stopping.exit_code(requested)
        say(
          f"{requested}: saved step {done} to {checkpoints.directory}; "
          f"exiting with status {code} (not finished: run the same command "
          f"to resume)."
        )
        log.close()
        checkpoints.close()
        raise SystemExit(code)
    bar.close()
  log.close()
  checkpoints.close()
  if not main:
    return {"examples_per_second": _per_second(examples, seconds)}
  summary = _summary(
    config, pipe, workdir, examples, seconds, evaluation, timeline
  )
  if run.dynamic:
    summary["repartitions"] = list(pipe.history)
    if pipe.windows:
      summary["dynamic_png"] = dynamic_lib.draw(pipe, workdir)
      say(f"Re-partitioning: {summary['dynamic_png']}")
  return summary


def _from_pretrained(config, task: Task, say) -> Task:
  """The task with ``config.init_from``'s params (checked against the
  model's; ``config.init_keep`` leaves keep the random init)."""
  keep = pretrained.matching(config.init_keep, task.params)
  if config.init_keep and not keep:
    raise UsageError(
      f"config.init_keep={config.init_keep!r} matches no param path; "
      f"paths look like {next(iter(pretrained.flat_paths(task.params)))!r}"
    )
  params = pretrained.load_params(
    config.init_from, task.params, keep_init=config.init_keep
  )
  n = len(jax.tree.leaves(params))
  kept = f", {len(keep)} kept from the random init" if keep else ""
  say(
    f"Initialised from {config.init_from}: {n - len(keep)} of {n} leaves{kept}."
  )
  return dataclasses.replace(task, params=params)


def _frozen(config, params, tx, say):
  """``tx`` with ``config.optimizer.freeze``'s leaves frozen."""
  patterns = config.optimizer.freeze
  if not patterns:
    return tx
  frozen, n = (
    pretrained.matching(patterns, params),
    len(jax.tree.leaves(params)),
  )
  if not frozen or len(frozen) == n:
    raise UsageError(
      f"config.optimizer.freeze={patterns!r} matches {len(frozen)} of the "
      f"{n} param paths (paths look like "
      f"{next(iter(pretrained.flat_paths(params)))!r}); freeze some, not "
      "none or all"
    )
  say(f"Frozen: {len(frozen)} of {n} param leaves ({patterns}).")
  return pretrained.freeze(tx, patterns)


def _check_workdir(workdir: str) -> None:
  """The workdir exists (or is made) and this process may write in it."""
  try:
    os.makedirs(workdir, exist_ok=True)
    with tempfile.TemporaryFile(dir=workdir):
      pass
  except OSError as e:
    raise UsageError(
      f"--workdir {workdir}: cannot write there ({e.strerror}); choose a "
      f"directory you may write to"
    ) from e


def _already_done(config, workdir, saved_step, say) -> dict:
  """A workdir whose checkpoint is at or past ``train.steps``: nothing
  to train; report its last evaluation (from its metrics)."""
  rows = read_metrics(workdir)
  evals = [r for r in rows if any(k.startswith("eval/") for k in r)]
  evaluation = None
  line = "no evaluation logged"
  if evals:
    last = evals[-1]
    evaluation = {
      k.removeprefix("eval/"): v for k, v in last.items() if k != "step"
    }
    line = f"step {last['step']}: {_format(evaluation)}"
  say(
    f"Nothing to train: {workdir} holds the checkpoint of step "
    f"{saved_step} and config.train.steps is {config.train.steps}. Last "
    f"evaluation: {line}. To train longer, raise --config.train.steps; "
    f"to start over, use another --workdir."
  )
  return {"eval": evaluation, "examples_per_second": None, "finished": True}


def _write_run_files(workdir, config, pipe) -> None:
  """The resolved config and the plan, beside the checkpoints (as Flax
  examples and big_vision users expect to find them)."""
  with open(os.path.join(workdir, "config.json"), "w") as f:
    f.write(config.to_json_best_effort(indent=2, sort_keys=True) + "\n")
  with open(os.path.join(workdir, "plan.json"), "w") as f:
    f.write(pipe.plan.to_json() + "\n")


class _Window:
  """What happened since the last log line: per-step losses, examples
  and seconds (a compiling first step has no seconds)."""

  def __init__(self, first_step: int = 1):
    self.first_step = first_step
    self.losses, self.examples, self.seconds = [], 0, 0.0

  def add(self, loss, examples, seconds):
    self.losses.append(loss)
    if seconds is not None:
      self.examples += examples
      self.seconds += seconds

  def means(self) -> dict:
    """``loss``: the window's mean; ``examples_per_second``: the window's
    (left out when its only step compiled)."""
    out = {"loss": float(np.mean(self.losses))}
    if self.seconds:
      out["examples_per_second"] = self.examples / self.seconds
    return out


class _DivergenceCheck:
  """Stops a run whose mean loss rose far above its start: ``factor``
  times the loss of the run's first step (0 turns the check off). Names
  the stage whose params grew most since then."""

  def __init__(self, factor: float):
    self.factor = factor
    self.start = None

  def begin(self, loss, step, pipe, state):
    if self.factor:
      self.start = (loss, step, pipe.param_norms(state))

  def check(self, loss, step, first_step, config, pipe, state):
    if self.start is None:
      return
    start, at, norms = self.start
    if start <= 0 or loss <= self.factor * start:
      return
    growth = [
      now / max(before, 1e-30)
      for now, before in zip(pipe.param_norms(state), norms, strict=True)
    ]
    stage = int(np.argmax(growth))
    raise TrainingDiverged(
      f"training diverged at step {step}: the mean loss of steps "
      f"{first_step}-{step} is {loss:.4g}, over "
      f"config.train.divergence_factor={self.factor:g} times its start "
      f"({start:.4g} at step {at}); stage {stage}'s params grew most since "
      f"then ({growth[stage]:.3g}x in norm). Lower "
      f"config.optimizer.learning_rate (now "
      f"{config.optimizer.learning_rate:g}) or set "
      f"config.train.divergence_factor=0 to train on regardless"
    )


def _nonfinite_message(config, pipe, state, step) -> str:
  """Where a non-finite loss comes from: the stages whose params hold
  NaN or inf (the first such leaf), or the forward when none does."""
  bad = pipe.nonfinite_params(state)
  if bad:
    where = "; ".join(
      f"stage {s}'s params (first: {path})" for s, path in bad.items()
    )
    where = f"non-finite values in {where}"
  else:
    where = (
      "every stage's params are finite: the forward made it (an input or "
      "an activation overflowed)"
    )
  return (
    f"loss is non-finite at step {step}: {where}. Lower "
    f"config.optimizer.learning_rate (now {config.optimizer.learning_rate:g})"
    f", or resume from an earlier checkpoint"
  )


def _log_line(step, steps, scalars) -> str:
  line = f"step {step}/{steps}: train loss {scalars['loss']:.4f}"
  if "examples_per_second" in scalars:
    line += f", {scalars['examples_per_second']:.0f} examples/s"
  return line


def _quiet(*args, **kwargs):
  """``print`` on processes other than 0."""


class _NoLog:
  """The metric log of processes other than 0."""

  def write(self, step, **scalars):
    pass

  def write_event(self, step, key, value):
    pass

  def close(self):
    pass


def _per_second(examples, seconds):
  return examples / seconds if seconds else float("nan")


def _format(evaluation: dict | None) -> str:
  if evaluation is None:
    return "no evaluation"
  return ", ".join(f"eval {k} {v:.4f}" for k, v in evaluation.items())


def _print_plan(pipe) -> None:
  plan = pipe.plan
  print(
    f"{plan.num_stages} stages on devices "
    f"{_device_groups(plan.stage_devices)}, schedule "
    f"{pipe.schedule_name}, {pipe.num_microbatches} microbatches; "
    f"predicted speed-up {plan.predicted_speedup:.2f}"
  )
  if pipe.granularity is not None:
    print(f"Nodes: {pipe.granularity.reason}.")
  limit = pipe.memory_limit
  print(
    "Predicted peak memory per stage: "
    + ", ".join(format_bytes(m.total) for m in pipe.memory)
    + (f" (limit {format_bytes(limit)})" if limit else "")
    + "."
  )


def _device_groups(stage_devices) -> list:
  """[0, 1, [2, 3]]: a stage's device, or its replica group."""
  return [ds[0] if len(ds) == 1 else list(ds) for ds in stage_devices]


def _throughput(examples, seconds) -> dict:
  """Examples per second, once a step after the first has run."""
  return {"examples_per_second": examples / seconds} if seconds else {}


def _summary(config, pipe, workdir, examples, seconds, evaluation, timeline):
  summary = {
    "examples_per_second": examples / seconds if seconds else float("nan"),
    "eval": evaluation,
  }
  speed = (
    f"throughput {summary['examples_per_second']:.1f} examples/s (this "
    "run, its first step -- compilation -- left out)"
    if seconds
    else "no throughput (one step: compilation only)"
  )
  lines = [f"Done: {config.train.steps} steps; {_format(evaluation)}; {speed}."]
  if timeline is not None:
    step, timeline = timeline
    busy = {}
    for action, start in timeline.start.items():
      busy[action.stage] = busy.get(action.stage, 0.0) + (
        timeline.end[action] - start
      )
    total = sum(busy.values())
    split = {s: busy[s] / total for s in sorted(busy)}
    summary["stage_time_split"] = split
    png = os.path.join(workdir, "timeline.png")
    trace = os.path.join(workdir, "timeline.json")
    names = pipe.device_names
    title = (
      f"step {step} of {config.train.steps} ({pipe.schedule_name}, "
      f"{pipe.num_microbatches} microbatches; compiled, measured on the "
      f"devices)"
    )
    schedule_lib.plot_timeline(timeline, png, title=title, device_names=names)
    schedule_lib.write_chrome_trace(timeline, trace, names)
    summary["timeline_png"] = png
    lines.append(
      f"Per-stage share of device time (step {step}): "
      + ", ".join(f"stage {s} {100 * f:.0f}%" for s, f in split.items())
    )
    lines.append(f"Timeline: {png} (Perfetto trace: {trace})")
  print("\n".join(lines))
  return summary
