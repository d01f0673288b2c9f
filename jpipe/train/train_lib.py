"""Config -> task -> optimizer -> pipeline(s) -> the training loop.

Small top-level functions (the learning rate, the optimizer, the
pipeline's options, the loop's mode) and ``train_and_evaluate``, the
entry point that checks what it can before any work, builds them and
hands over to ``jpipe.train.loop``.
"""

import dataclasses
import os
import tempfile

import jax
import jax.numpy as jnp
import ml_collections
import optax

import jpipe
from jpipe import partition as partition_lib
from jpipe import schedule as schedule_lib
from jpipe.train import checkpoint as checkpoint_lib
from jpipe.train import (
  config_check,
  config_options,
  data_parallel_mode,
  dynamic_mode,
  evaluate_only,
  hf_checkpoint,
  loop,
  optimizers,
  pretrained,
  process_agreement,
  tasks,
  workdir_lock,
)
from jpipe.train import run as run_lib

# Raised by the loop; callers of train_and_evaluate catch it from here.
from jpipe.train.errors import TrainingDiverged as TrainingDiverged
from jpipe.train.errors import UsageError
from jpipe.train.metric_log import read_metrics
from jpipe.train.pipeline_mode import PipelineMode
from jpipe.train.tasks import Task, build_task


def learning_rate(config):
  """The config's learning rate per optimizer step: a number (constant)
  or an optax schedule (``config_check.LR_SCHEDULES``)."""
  opt = config.optimizer
  if opt.schedule == "constant":
    return opt.learning_rate
  steps = config_options.schedule_steps(config) * run_lib.steps_per_call(config)
  peak, warmup = opt.learning_rate, max(opt.warmup_steps, 1)
  # A run shorter than its warm-up (a quick try of a config) decays over
  # one step after it rather than failing.
  steps = max(steps, warmup + 1)
  if opt.schedule == "warmup_constant":  # FTPipe's T5: up, then flat.
    return optax.warmup_constant_schedule(0.0, peak, warmup)
  if opt.schedule == "warmup_cosine":
    return optax.warmup_cosine_decay_schedule(0.0, peak, warmup, steps)
  if opt.schedule == "warmup_linear":  # BERT: up to the peak, down to 0.
    return optax.join_schedules(
      [
        optax.linear_schedule(0.0, peak, warmup),
        optax.linear_schedule(peak, 0.0, steps - warmup),
      ],
      [warmup],
    )
  if opt.schedule == "rsqrt":  # T5: the peak, then 1 / sqrt(step).
    return lambda step: peak * jnp.sqrt(warmup / jnp.maximum(step, warmup))
  # multistep (WRN, ResNet): times decay_factor at each boundary, after
  # a linear warm-up where warmup_steps > 0 (Goyal et al.'s gradual one).
  boundaries = [int(b) for b in opt.decay_steps.split(",")]
  if not opt.warmup_steps:
    return optax.piecewise_constant_schedule(
      peak, {b: opt.decay_factor for b in boundaries}
    )
  # join_schedules counts the second schedule's steps from the warm-up's
  # end: its boundaries move back by it.
  return optax.join_schedules(
    [
      optax.linear_schedule(0.0, peak, warmup),
      optax.piecewise_constant_schedule(
        peak, {b - warmup: opt.decay_factor for b in boundaries}
      ),
    ],
    [warmup],
  )


def build_optimizer(config, lr):
  """The config's optax optimizer (``jpipe.train.optimizers``)."""
  return optimizers.build(config, lr)


def pipeline_options(config, task: Task, lr) -> dict:
  """``jpipe.Pipeline``'s keyword arguments beyond the model and batch,
  as the config says (but ``devices`` and ``optimizer``)."""
  kwargs = {}
  if task.model_state is not None:
    kwargs["model_state"] = task.model_state
  if task.has_aux:
    kwargs["has_aux"] = True
  if config.optimizer.freeze:  # (No gradients: held as model state.)
    kwargs["frozen"] = config.optimizer.freeze
  return dict(
    num_stages=config.pipeline.num_stages,
    schedule=config_options.written_schedule(config) or config.schedule.name,
    num_microbatches=config.pipeline.num_microbatches,
    partition=config_options.partition(config),
    depth=config.pipeline.depth or None,  # 0: automatic
    bandwidth=config.pipeline.bandwidth or None,
    cost_model=config.pipeline.cost_model,
    staleness=config_options.staleness(config, lr),
    fuse_last_stage=config.pipeline.fuse_last_stage,
    fuse_step=config.pipeline.fuse_step,
    gpu_command_buffers=config_options.command_buffers(
      config.pipeline.gpu_command_buffers
    ),
    transport=config.pipeline.transport,
    replica_routing=config.pipeline.replica_routing,
    mixed_blocks=config_options.mixed_blocks(config),
    memory_limit=config_options.memory_limit(config.pipeline.memory_limit),
    clip_global_norm=config.optimizer.clip_norm or None,
    grad_accum_dtype=config.optimizer.grad_accum_dtype or None,
    skip_nonfinite_steps=config.optimizer.skip_nonfinite,
    loss_scale=config_options.loss_scale(config),
    **kwargs,
  )


def build_pipeline(config, task: Task, example_batch, tx, lr):
  options = pipeline_options(config, task, lr)
  try:
    return jpipe.Pipeline(
      task.loss_fn,
      task.params,
      example_batch,
      devices=config_options.pipeline_devices(config, jax.devices()),
      optimizer=tx,
      **options,
    )
  except schedule_lib.NoScheduleFits as e:  # schedule "auto"
    raise UsageError(f"config.pipeline.memory_limit: {e}") from e
  except jpipe.OptimizerError as e:
    hint = ""
    if config.optimizer.name == "adafactor" and "mixes the rows" in str(e):
      hint = (
        " (here: --config.optimizer.args='clipping_threshold=None,"
        "multiply_by_parameter_scale=False')"
      )
    raise UsageError(
      f"config.optimizer.name={config.optimizer.name!r}: {e}{hint}"
    ) from e
  except ValueError as e:
    if "memory_limit" not in str(e):
      raise
    # The prediction, or no split fitting: both name their fixes.
    raise UsageError(f"config.pipeline.memory_limit: {e}") from e


def train_and_evaluate(config: ml_collections.ConfigDict, workdir: str) -> dict:
  """Trains as the config says, resuming from ``workdir`` if it has a
  checkpoint. Returns the closing summary (also printed).

  What can be checked cheaply is checked before the data, the trace and
  the partition: the config, the workdir (writable, and no other live
  run's: this run holds it until it returns, ``workdir_lock``), the
  checkpoint (written for this model; a finished run says so and
  stops). A SIGTERM or SIGINT finishes the step, checkpoints and exits
  with 128 + the signal's number (143, 130): the run did not finish.

  Across processes (``jpipe.distributed.initialize`` first; every process
  calls this with the same config and workdir, which several hosts must
  share): each process runs its stages; process 0 alone prints, logs,
  evaluates and draws; checkpoints are written by all together (the
  partition-independent state dict, so another process count resumes
  it).
  """
  run = run_lib.describe(config)
  process_agreement.check_same_run(config)
  config_check.check_devices(config, jax.devices())
  say = print if jax.process_index() == 0 else _quiet
  _check_workdir(workdir)
  with workdir_lock.held(workdir, say):
    process_agreement.check_shared_workdir(workdir)
    return _train(run, config, workdir, say)


def _train(run: run_lib.Run, config, workdir: str, say) -> dict:
  """``train_and_evaluate`` in a workdir this run holds."""
  checkpoints = checkpoint_lib.Checkpoints(
    workdir, config.train.keep_checkpoints
  )
  saved_step = checkpoints.latest_step()
  meta = checkpoints.check_fingerprint(run.fingerprint)
  if saved_step is not None and saved_step < run.steps:
    run_lib.check_data_order(meta, run, workdir)
  if saved_step is not None and saved_step >= run.steps and run.steps:
    checkpoints.close()
    return _already_done(config, workdir, saved_step, say)
  fine_tune = bool(config.init_from) and saved_step is None
  if fine_tune:
    pretrained.check_source(config.init_from)
  task = build_task(config)
  process_agreement.check_same_batches(task)
  if fine_tune:
    task = _from_pretrained(config, task, say)
  lr = learning_rate(config)
  _say_no_decay(config, task.params, say)
  _say_frozen(config, task.params, say)
  tx = build_optimizer(config, lr)
  mode = build_mode(run, config, task, tx, lr, say)
  if not run.steps:  # Evaluation only.
    source = (
      f"init_from {config.init_from}" if fine_tune else "the initial params"
    )
    return evaluate_only.evaluate(
      mode, task, run, checkpoints, workdir=workdir, source=source, say=say
    )
  return loop.train(
    mode,
    task,
    run,
    checkpoints,
    config=config,
    workdir=workdir,
    lr=lr,
    fine_tune=fine_tune,
    say=say,
  )


def build_mode(run, config, task: Task, tx, lr, say) -> loop.Mode:
  """The loop's mode of ``run``: its pipeline(s) built. More stages than
  the model has nodes is a UsageError, the line ``python -m
  jpipe.train.plan`` prints (found by the trace, before any compile)."""
  try:
    return _modes(run, config, task, tx, lr, say)
  except partition_lib.TooFewNodes as e:
    raise UsageError(tasks.too_few_nodes(config, e)) from e
  except partition_lib.SplitMismatch as e:
    raise UsageError(f"config.pipeline.split: {e}") from e


def _modes(run, config, task: Task, tx, lr, say) -> loop.Mode:
  example = task.batch_at(0)
  options = pipeline_options(config, task, lr)
  if run.data_parallel:
    dp = data_parallel_mode.build(
      config, task, example, options | {"optimizer": tx}, run.steps_per_call
    )
    return data_parallel_mode.DataParallelMode(dp, task, config)
  if run.dynamic:
    pipe = dynamic_mode.build(config, task, example, tx, options)
    return dynamic_mode.DynamicMode(pipe, task, config, say, example)
  pipe = build_pipeline(config, task, example, tx, lr)
  return PipelineMode(pipe, task, config, say, example)


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
    config.init_from,
    task.params,
    keep_init=config.init_keep,
    hf_names=(
      tasks.hf_names(config) if hf_checkpoint.is_hf(config.init_from) else None
    ),
    lazy=True,  # Each leaf read as it is placed on its stage.
  )
  n = len(jax.tree.leaves(params))
  kept = f", {len(keep)} kept from the random init" if keep else ""
  say(
    f"Initialised from {config.init_from}: {n - len(keep)} of {n} leaves{kept}."
  )
  unused = hf_checkpoint.unused_names(jax.tree.leaves(params))
  if unused:  # (HuggingFace warns so too: a bigger model, another head.)
    say(
      f"Warning: {len(unused)} tensors of {config.init_from} are not read "
      f"by this model (e.g. {', '.join(unused[:3])}): is it a checkpoint "
      "of a bigger model (more layers), or of another head?"
    )
  return dataclasses.replace(task, params=params)


def _some_leaves(name: str, patterns: str, params, fix: str) -> tuple[int, int]:
  """(leaves the path ``patterns`` of ``config.optimizer.<name>`` match,
  all leaves); a UsageError where they match none or all (``fix``: what
  to write instead)."""
  matched = pretrained.matching(patterns, params)
  n = len(jax.tree.leaves(params))
  if not matched or len(matched) == n:
    raise UsageError(
      f"config.optimizer.{name}={patterns!r} matches {len(matched)} of the "
      f"{n} param paths (paths look like "
      f"{next(iter(pretrained.flat_paths(params)))!r}); {fix}, not none or "
      "all"
    )
  return len(matched), n


def _say_no_decay(config, params, say) -> None:
  """How many leaves ``config.optimizer.no_decay`` keeps from weight
  decay; a UsageError where it matches none or all."""
  patterns = config.optimizer.no_decay
  if patterns:
    k, n = _some_leaves(
      "no_decay",
      patterns,
      params,
      "name the leaves weight decay skips (e.g. 'bias$,scale$')",
    )
    say(f"No weight decay: {k} of {n} param leaves ({patterns}).")


def _say_frozen(config, params, say) -> None:
  """How many leaves ``config.optimizer.freeze`` freezes (the pipeline
  holds them as model state: ``jpipe.Pipeline(frozen=)``); a UsageError
  where it matches none or all."""
  patterns = config.optimizer.freeze
  if patterns:
    k, n = _some_leaves("freeze", patterns, params, "freeze some")
    say(f"Frozen: {k} of {n} param leaves ({patterns}), no gradients.")


# What the run writes in its workdir: folders, and files.
_WORKDIR_FOLDERS = ("checkpoints", "tensorboard")
_WORKDIR_FILES = ("metrics.jsonl", "config.json", "plan.json")


def _check_workdir(workdir: str) -> None:
  """The workdir exists (or is made), this process may write in it, and
  what the run writes there is of the right kind (a file named
  ``checkpoints`` trained until the first save, then failed)."""
  try:
    os.makedirs(workdir, exist_ok=True)
    with tempfile.TemporaryFile(dir=workdir):
      pass
  except OSError as e:
    raise UsageError(
      f"--workdir {workdir}: cannot write there ({e.strerror}); choose a "
      f"directory you may write to"
    ) from e
  for name, folder in [
    *((n, True) for n in _WORKDIR_FOLDERS),
    *((n, False) for n in _WORKDIR_FILES),
  ]:
    path = os.path.join(workdir, name)
    if os.path.exists(path) and os.path.isdir(path) != folder:
      kind = "a file" if folder else "a folder"
      raise UsageError(
        f"--workdir {workdir}: {name} is {kind}, where the run keeps its "
        f"{name} {'folder' if folder else 'file'}: move it away, or use "
        "another --workdir"
      )


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
      k.removeprefix("eval/"): v
      for k, v in last.items()
      if k.startswith("eval/")
    }
    line = f"step {last['step']}: {loop.format_evaluation(evaluation)}"
  say(
    f"Nothing to train: {workdir} holds the checkpoint of step "
    f"{saved_step} and config.train.steps is {config.train.steps}. Last "
    f"evaluation: {line}. To train longer, raise --config.train.steps; "
    f"to start over, use another --workdir."
  )
  return {"eval": evaluation, "examples_per_second": None, "finished": True}


def _quiet(*args, **kwargs):
  """``print`` on processes other than 0."""
