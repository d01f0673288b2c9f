"""Checks a training config before any work: each problem names its key."""

import difflib
import re

import ml_collections

from jpipe import partition
from jpipe import schedule as schedule_lib
from jpipe.runtime import REPLICA_ROUTINGS, check_grad_accum_dtype
from jpipe.train import (
  config_options,
  data_parallel_mode,
  dynamic_mode,
  host_devices,
  input_pipeline,
  optimizers,
  tasks,
  user_code,
)
from jpipe.train.errors import UsageError

LR_SCHEDULES = (
  "constant",
  "warmup_constant",
  "warmup_cosine",
  "warmup_linear",
  "rsqrt",
  "multistep",
)
PARTITIONS = partition.METHODS
COST_MODELS = ("analytic", "xla", "measured")


def check(config: ml_collections.ConfigDict) -> None:
  """Raises UsageError (a ValueError) listing every invalid field and how to fix it."""
  _check_sections(config)
  # Its own one-line error: the file's problem.
  config_options.written_schedule(config)
  problems = []
  need = _Needs(config, problems)

  _check_names(config, need)
  _check_pipeline(config, need)
  _check_loop(config, need)
  _check_staleness(config, need, problems)
  _check_runtime(config, need, problems)
  _check_loss_scale(config, need, problems)
  data_parallel_mode.check_config(config, need, problems)
  dynamic_mode.check_config(config, need, problems)
  if problems:
    if len(problems) == 1:  # One line: the key and its fix.
      raise UsageError(f"invalid config: {problems[0]}")
    raise UsageError("invalid config:\n  " + "\n  ".join(problems))


# Free-form: any keys (a model's own keyword arguments).
_FREE_FIELDS = ("model.kwargs",)


def _check_sections(config) -> None:
  """The config has base_config's sections and a data section, and none
  of those sections holds a field base_config does not (a misspelled name
  set in a config file would otherwise be ignored)."""
  from jpipe.train.base_config import base_config

  base = base_config()
  missing = [k for k in (*base.keys(), "data") if k not in config]
  if missing:
    raise UsageError(
      f"the config has no {', '.join(missing)}: start it from "
      "jpipe.train.base_config.base_config() and give it a data section "
      "(c.data = image_data(), text_data(), ... of that module), as "
      "configs/default.py does"
    )
  unknown = []
  for key, value in base.items():
    if isinstance(value, ml_collections.ConfigDict):
      unknown += _unknown_fields(config[key], value, f"{key}.")
  if unknown:
    raise UsageError(
      "the config has fields jpipe does not know: " + "; ".join(unknown)
    )


def _unknown_fields(section, known, prefix) -> list[str]:
  """``section``'s keys that ``known`` lacks, each with the nearest name."""
  out = []
  if not isinstance(section, ml_collections.ConfigDict):
    return out  # (A wrong type: the field's own check names it.)
  for key in section.keys():
    if key not in known:
      near = difflib.get_close_matches(key, list(known.keys()), n=1)
      hint = f" (did you mean {prefix}{near[0]}?)" if near else ""
      out.append(f"{prefix}{key}{hint}")
    elif (
      isinstance(known[key], ml_collections.ConfigDict)
      and f"{prefix}{key}" not in _FREE_FIELDS
    ):
      out += _unknown_fields(section[key], known[key], f"{prefix}{key}.")
  return out


class _Needs:
  """``need(ok, key, message)`` records ``config.KEY: message`` among
  ``problems`` unless ``ok``; ``need.one_of(key, choices)``: the key's
  value is one of ``choices``."""

  def __init__(self, config, problems: list[str]):
    self.config, self.problems = config, problems

  def __call__(self, ok, key: str, message: str) -> None:
    if not ok:
      self.problems.append(f"config.{key}: {message}")

  def one_of(self, key: str, choices) -> None:
    section, name = key.split(".")
    value = self.config[section][name]
    self(value in choices, key, f"{value!r} is not one of {tuple(choices)}")


def _check_names(config, need) -> None:
  """Names the config chooses from a list, and the learning rate."""
  need.one_of("schedule.name", (*schedule_lib.SCHEDULES, schedule_lib.AUTO))
  _check_v_placement(config, need)
  _check_user_code(config, need)
  if config.data.get("tokenizer"):  # Read now: a bad file stops here.
    input_pipeline.tokenizer(config)
  need(
    0 <= config.train.label_smoothing < 1,
    "train.label_smoothing",
    "must be in [0, 1)",
  )
  optimizers.check(config)
  need(
    config.optimizer.clip_norm >= 0,
    "optimizer.clip_norm",
    "must be >= 0 (0: no clipping)",
  )
  try:
    check_grad_accum_dtype(config.optimizer.grad_accum_dtype)
  except ValueError as e:
    need(False, "optimizer.grad_accum_dtype", str(e))
  try:
    check_grad_accum_dtype(config.model.get("param_dtype", ""))
  except ValueError as e:
    need(
      False,
      "model.param_dtype",
      str(e).replace("grad_accum_dtype=", "").split(": use")[0]
      + ": use 'bfloat16', 'float16', 'float32' or '' (the model's own)",
    )
  need(
    not (
      config.optimizer.skip_nonfinite
      and config.schedule.name in schedule_lib.STREAMS
    ),
    "optimizer.skip_nonfinite",
    f"needs a synchronous schedule, not {config.schedule.name!r} (a "
    "stream's stages step apart)",
  )
  need.one_of("optimizer.schedule", LR_SCHEDULES)
  need(
    config.optimizer.learning_rate > 0,
    "optimizer.learning_rate",
    "must be > 0",
  )


def _check_user_code(config, need) -> None:
  """The task or model the config names: jpipe's, or the user's by
  import path (imported now, so a wrong path stops before any work)."""
  if config.task:
    user_code.load(
      config.task, "task", want="a function config -> jpipe.train.tasks.Task"
    )
    return  # The task builds its own model.
  if user_code.is_import_path(config.model.name):
    tasks.flax_module(config.model.name)
    tasks.task_of_data(config.data)
    return
  need(
    config.model.name in tasks.TASK_OF_MODEL,
    "model.name",
    f"{config.model.name!r} is not one of jpipe.models' "
    f"{tuple(tasks.TASK_OF_MODEL)} nor package.module:Module",
  )
  if config.data.get("format"):  # A name not in the list stops here.
    tasks.task_of_data(config.data)
  if config.model.name in tasks.TASK_OF_MODEL:
    tasks.model_kwargs(config)  # An unknown model.size stops here.


def _check_split(config, need) -> None:
  """``pipeline.split`` / ``pipeline.replicas``: counts per stage, as
  many as ``num_stages``, in place of the partitioner."""
  p = config.pipeline
  try:
    split = config_options.partition(config)
  except ValueError as e:  # A count that is no number, or a bad Split.
    need(False, "pipeline.split", f"{p.split!r} / replicas {p.replicas!r}: {e}")
    return
  if isinstance(split, str):
    return
  need(
    split.num_stages == p.num_stages,
    "pipeline.num_stages",
    f"{p.num_stages}, but the split {split.describe()} has "
    f"{split.num_stages} stages: set --config.pipeline.num_stages="
    f"{split.num_stages}",
  )
  need(
    p.partition == "contiguous",
    "pipeline.partition",
    f"{p.partition!r} with pipeline.split / replicas, which give the plan "
    f"themselves: drop one",
  )
  need(
    not config_options.v_shaped(config) and not config.dynamic.enabled,
    "pipeline.split",
    f"{split.describe()} cannot hold under schedule "
    f"{config.schedule.name!r} or dynamic.enabled (they place or move "
    f"stages themselves): drop it",
  )


def _check_mixed_blocks(config, need) -> None:
  """``pipeline.mixed_blocks``: block counts >= 1, for the mixed pipe."""
  p = config.pipeline
  try:
    blocks = config_options.mixed_blocks(config)
  except ValueError:
    blocks = (0,)
  if blocks is None:
    return
  need(
    min(blocks) >= 1,
    "pipeline.mixed_blocks",
    f"{p.mixed_blocks!r}: give block counts >= 1, e.g. '32' or '16,32'",
  )
  need(
    p.partition == "mixed",
    "pipeline.mixed_blocks",
    f"{p.mixed_blocks!r} is for pipeline.partition 'mixed', not "
    f"{p.partition!r}: drop it",
  )


def _check_pipeline(config, need) -> None:
  """The pipeline's partition, costs, stages and microbatches."""
  need.one_of("pipeline.partition", PARTITIONS)
  _check_split(config, need)
  _check_mixed_blocks(config, need)
  need(
    config.pipeline.bandwidth >= 0,
    "pipeline.bandwidth",
    "must be >= 0 bytes/s (0: plan on compute alone)",
  )
  need.one_of("pipeline.cost_model", COST_MODELS)
  need(config.pipeline.num_stages >= 1, "pipeline.num_stages", "must be >= 1")
  _check_loop_placement(config, need)
  need(
    config.pipeline.depth >= 0,
    "pipeline.depth",
    "must be >= 0 (0 chooses it; 1 cuts at the root's children)",
  )
  if "eval_sequences" in config.data:
    masked = "mask_rate" in config.data  # (It draws its pairs.)
    need(
      config.data.eval_sequences >= (1 if masked else 0),
      "data.eval_sequences",
      "must be >= 1 (the held-out pairs drawn)"
      if masked
      else "must be >= 0 (0: every held-out window)",
    )
  m = config.pipeline.num_microbatches
  need(m >= 1, "pipeline.num_microbatches", "must be >= 1")
  need(config.data.batch_size >= 1, "data.batch_size", "must be >= 1")
  if m >= 1:
    need(
      config.data.batch_size % m == 0,
      "pipeline.num_microbatches",
      f"{m} does not divide data.batch_size={config.data.batch_size}: use "
      f"a divisor of it",
    )


# The Pipeline's staleness options as the config names them.
_CONFIG_KEYS = {
  "weight_stashing": "staleness.stashing",
  "prediction": "staleness.prediction",
  "gap_aware": "staleness.gap_aware",
  "last_stage_optimizer": "staleness.nesterov_last_stage",
  "pipemare_anneal_steps": "staleness.pipemare_anneal_steps",
  "stage_optimizer": "staleness.delay_nesterov",
  "step_every": "schedule.step_every",
  "recompute": "pipeline.recompute",
  "partial_window": "staleness.partial_window",
  "nag_with_predictor": "staleness.nag_with_predictor",
  "supremum_staleness": "schedule.supremum_staleness",
  "split_flush": "schedule.split_flush",
}


def _as_keys(error: ValueError) -> str:
  """The Pipeline's message on its staleness options with their config
  keys in place of its own names."""
  text = str(error)
  for name, key in _CONFIG_KEYS.items():
    text = re.sub(rf"(?<![\w.]){name}(?![\w])", key, text)
  return text


def _check_loop_placement(config, need) -> None:
  """pipeline.stages_per_device: a loop schedule, contiguous stages, a
  divisor of the stage count."""
  k, p = config.pipeline.stages_per_device, config.pipeline
  need(k >= 1, "pipeline.stages_per_device", "must be >= 1")
  kind = config_options.schedule_kind(config)
  if k <= 1:
    loop = kind is not None and kind.loops and p.partition != "mixed"
    need(
      not loop,
      "pipeline.stages_per_device",
      f"schedule {config.schedule.name!r} loops stages over devices: set "
      f"it >= 2 (one stage a device runs "
      f"{kind.unlooped if loop else ''!r}'s order; or use that schedule)",
    )
    return
  need(
    (kind is not None and kind.loops) or config.schedule.name == "auto",
    "pipeline.stages_per_device",
    f"{k} stages per device need a loop schedule (interleaved, "
    f"interleaved_zb or looped_bfs) or auto, not {config.schedule.name!r}",
  )
  need(
    p.num_stages % k == 0 and p.num_stages > k,
    "pipeline.stages_per_device",
    f"{k} must divide pipeline.num_stages={p.num_stages} and leave >= 2 "
    f"devices (stage s on device s mod num_stages / {k})",
  )
  need(
    p.partition == "contiguous" and not p.split and not p.replicas,
    "pipeline.stages_per_device",
    f"{k} loops contiguous stages: use pipeline.partition='contiguous' "
    "without pipeline.split / replicas",
  )
  need(
    not data_parallel_mode.uses_data_parallel(config)
    and not config.dynamic.enabled,
    "pipeline.stages_per_device",
    f"{k} stages per device run in one pipeline: not with data_parallel "
    "pipelines or dynamic.enabled (use 1)",
  )


def _check_loop(config, need) -> None:
  """The learning-rate warm-up, the loop's counts and the init."""
  # Counts and their least values.
  # train.steps 0: evaluation only (jpipe.train.evaluate_only).
  counts = {
    "optimizer.warmup_steps": 0,
    "optimizer.schedule_steps": 0,
    "train.steps": 0,
  }
  for key in (
    "keep_checkpoints",
    "log_every",
    "eval_every",
    "checkpoint_every",
  ):
    counts[f"train.{key}"] = 1
  for path, least in counts.items():
    section, key = path.split(".")
    need(config[section][key] >= least, path, f"must be >= {least}")
  opt = config.optimizer
  need(
    opt.warmup_steps == 0 or opt.schedule != "constant",
    "optimizer.warmup_steps",
    f"{opt.warmup_steps} has no effect with optimizer.schedule="
    f"{opt.schedule!r}: set --config.optimizer.schedule=warmup_constant "
    f"(or warmup_cosine, warmup_linear, rsqrt, multistep), or "
    f"warmup_steps=0",
  )
  need(
    not opt.schedule_steps or opt.schedule in config_options.DECAYING_SCHEDULES,
    "optimizer.schedule_steps",
    f"applies to warmup_cosine and warmup_linear, not {opt.schedule!r}",
  )
  decay = [s.strip() for s in opt.decay_steps.split(",") if s.strip()]
  if opt.schedule != "multistep":
    need(
      not decay,
      "optimizer.decay_steps",
      f"applies to optimizer.schedule='multistep', not {opt.schedule!r}",
    )
  else:
    steps = [int(s) for s in decay if s.isdigit()]
    need(
      len(steps) == len(decay) > 0 and steps == sorted(set(steps)),
      "optimizer.decay_steps",
      f"{opt.decay_steps!r}: multistep needs rising optimizer steps, "
      'e.g. "3000,6000,8000"',
    )
    need(
      not steps or steps[0] > opt.warmup_steps,
      "optimizer.decay_steps",
      f"{opt.decay_steps!r}: a decay inside the warm-up "
      f"(optimizer.warmup_steps={opt.warmup_steps}); decay after it",
    )
  need(
    bool(config.init_from) or not config.init_keep,
    "init_keep",
    "keeps leaves of the random init instead of pretrained ones: set "
    "config.init_from too",
  )
  need(
    config.train.divergence_factor >= 0,
    "train.divergence_factor",
    "must be >= 0 (0 turns the divergence check off)",
  )
  need(
    config.train.hang_timeout >= 0,
    "train.hang_timeout",
    "must be >= 0 seconds (0: automatic, max(300, 20x the median step, 3x "
    "the longest evaluation or checkpoint))",
  )


def _check_staleness(config, need, problems) -> None:
  """What only the config knows of the staleness options (its optimizer
  by name, its own encodings); then the runtime's own check of the
  ``Staleness`` the config converts to (``Staleness.check``: the rules'
  one source)."""
  st, opt = config.staleness, config.optimizer
  before = len(problems)
  need(
    config.schedule.step_every >= 1,
    "schedule.step_every",
    f"{config.schedule.step_every}: must be >= 1 (backwards per step of "
    "async; microbatches per minibatch of 2bw)",
  )
  need(
    config.schedule.step_every <= 1 or config_options.streams(config),
    "schedule.step_every",
    f"{config.schedule.step_every} applies to schedule.name "
    f"{' or '.join(map(repr, schedule_lib.STREAMS))} only "
    f"({config.schedule.name!r} steps once per call): set it to 1",
  )
  # Weight prediction replays any optimizer (staleness.replay_predictor:
  # Adafactor's too, FTPipe's T5); Gap-Aware reads its state.
  need(
    not st.gap_aware or opt.name in optimizers.STALENESS_AWARE,
    "optimizer.name",
    f"Gap-Aware reads the state of {optimizers.STALENESS_AWARE}, not "
    f"{opt.name!r}: use one of them, or weight prediction (any optimizer) "
    f"or stashing",
  )
  # (Stage s of n is n - 1 - s steps late; the estimate is one step's.)
  late = {
    "all_except_last": config.pipeline.num_stages > 2,
    "all_except_last_two": True,
  }.get(st.gap_aware_policy, False)
  need(
    st.gap_aware != "ga_from_grad" or not late,
    "staleness.gap_aware_policy",
    f"{st.gap_aware_policy!r} puts gap_aware='ga_from_grad' on stages 2 or "
    "more steps late, but it estimates one step's gap (FTPipe's "
    "apply_from_grad): use almost_last_partition, or gap_aware='ga'",
  )
  need(
    not st.nesterov_last_stage or (opt.name == "sgd" and opt.momentum > 0),
    "staleness.nesterov_last_stage",
    "FTPipe's Nesterov last stage is momentum SGD's: set "
    "--config.optimizer.name=sgd and a momentum > 0, or drop it",
  )
  _check_delay_nesterov(config, need)
  need(
    isinstance(st.pipemare_anneal_steps, int)
    and st.pipemare_anneal_steps >= -1,
    "staleness.pipemare_anneal_steps",
    f"{st.pipemare_anneal_steps!r}: optimizer steps (0 = off, -1 = a "
    "quarter of the run)",
  )
  if len(problems) == before and config_options.schedule_kind(config):
    try:  # What the Pipeline itself would refuse, before work.
      config_options.staleness(config).check(config.schedule.name)
    except ValueError as e:
      problems.append(f"config.staleness / config.schedule: {_as_keys(e)}")
  elif len(problems) == before and config.schedule.name == schedule_lib.AUTO:
    try:  # Auto chooses among synchronous schedules: 1f1b's rules.
      config_options.staleness(config).check("1f1b")
    except ValueError as e:
      problems.append(
        "config.schedule.name: 'auto' chooses among the synchronous "
        f"schedules, which do not take these staleness options ({e}): "
        "name a schedule to use them"
      )


def _check_delay_nesterov(config, need) -> None:
  """``staleness.delay_nesterov``: a mode, an optimizer it has a Nesterov
  form of, and 'fixed' for Adam's family only."""
  mode, name = config.staleness.delay_nesterov, config.optimizer.name
  need.one_of("staleness.delay_nesterov", ("", "adaptive", "fixed"))
  need(
    not mode or name in optimizers.STALENESS_AWARE,
    "staleness.delay_nesterov",
    f"the delay-aware Nesterov method replaces sgd, adam or adamw with "
    f"their Nesterov forms, not {name!r}: set --config.optimizer.name to "
    f"one of {optimizers.STALENESS_AWARE}",
  )
  need(
    not (mode == "fixed" and name == "sgd"),
    "staleness.delay_nesterov",
    "'fixed' (beta1 0.99 on every stage) is the authors' NAdamW for adam "
    "/ adamw; SGD's rate would act ten times larger: use 'adaptive'",
  )


def _check_loss_scale(config, need, problems) -> None:
  """The loss scale: a number, 'dynamic' (synchronous schedules) or ''.
  (Its text alone: a bad window is the window's own problem below.)"""
  try:
    config_options.loss_scale_value(config.optimizer.loss_scale)
  except ValueError as e:
    problems.append(f"config.optimizer.loss_scale: {e}")
  dynamic = config.optimizer.loss_scale == "dynamic"
  window = config.optimizer.loss_scale_window
  need(
    not dynamic or (isinstance(window, int) and window >= 1),
    "optimizer.loss_scale_window",
    f"must be an int >= 1 (finite steps before the scale doubles), got "
    f"{window!r}",
  )
  kind = config_options.schedule_kind(config)
  need(
    not (dynamic and kind is not None and kind.asynchronous),
    "optimizer.loss_scale",
    f"'dynamic' needs a synchronous schedule, not "
    f"{config.schedule.name!r} (its overflowing steps are skipped, which a "
    "stream's stages cannot do together): give a number, a static scale",
  )


def _check_runtime(config, need, problems) -> None:
  """The memory limit, the transport, CUDA graphs and 2BW's minibatch."""
  try:
    config_options.memory_limit(config.pipeline.memory_limit)
  except ValueError as e:
    problems.append(f"config.pipeline.memory_limit: {e}")
  try:
    config_options.command_buffers(config.pipeline.gpu_command_buffers)
  except ValueError as e:
    problems.append(f"config.pipeline.gpu_command_buffers: {e}")
  need.one_of("pipeline.transport", ("pull", "collective"))
  need.one_of("pipeline.replica_routing", REPLICA_ROUTINGS)
  routing = config.pipeline.replica_routing
  kind = config_options.schedule_kind(config)
  if routing == "round_robin" and kind is not None and kind.asynchronous:
    need(
      kind.stale and config.schedule.step_every == 1,
      "pipeline.replica_routing",
      "round_robin (PipeDream's 1F1B-RR) streams as "
      f"{' or '.join(map(repr, schedule_lib.STALE))} with "
      "schedule.step_every 1: a replicated stage steps once per round of "
      "its replicas",
    )
  # (A step_every of 1 the runtime's own check names: Staleness.check.)
  if kind is not None and kind.two_versions and config.schedule.step_every > 1:
    need(
      config.schedule.step_every >= config.pipeline.num_stages,
      "schedule.step_every",
      f"{config.schedule.name} needs microbatches per minibatch >= "
      f"pipeline.num_stages "
      f"({config.pipeline.num_stages}), got {config.schedule.step_every}",
    )


def _check_v_placement(config, need) -> None:
  """zbv and dualpipev: an even stage count, contiguous stages, and
  DualPipeV's 2p microbatches."""
  if not config_options.v_shaped(config):
    return
  name, stages = config.schedule.name, config.pipeline.num_stages
  need(
    stages % 2 == 0,
    "pipeline.num_stages",
    f"{name} places 2 stages per device in a V: use an even count "
    f"(got {stages}; on p devices, 2p)",
  )
  need(
    config.pipeline.partition == "contiguous",
    "pipeline.partition",
    f"{name} places its stages itself: use 'contiguous', not "
    f"{config.pipeline.partition!r}",
  )
  need(
    name != "dualpipev" or config.pipeline.num_microbatches >= stages,
    "pipeline.num_microbatches",
    f"dualpipev needs >= num_stages ({stages}) microbatches, got "
    f"{config.pipeline.num_microbatches}",
  )


def check_devices(config, devices) -> None:
  """Raises UsageError when the run's devices cannot hold the config's
  stages (one device per stage, except FTPipe's mixed pipe and the V
  schedules' two), or gradient clipping on a stream spans processes."""
  processes = {getattr(d, "process_index", 0) for d in devices}
  if (
    config.optimizer.clip_norm
    and config.schedule.name in schedule_lib.STREAMS
    and len(processes) > 1
  ):
    raise UsageError(
      f"config.optimizer.clip_norm with schedule.name="
      f"{config.schedule.name!r} needs one process (a streaming step "
      "reads every stage's latest gradient norm): use a synchronous "
      "schedule, or clip_norm=0"
    )
  if config.pipeline.partition == "mixed":
    return
  n, stages = len(devices), config_options.stage_devices_needed(config)
  kind = devices[0].platform if devices else "no"
  p = (
    config.data_parallel.pipelines
    if data_parallel_mode.uses_data_parallel(config)
    else 1
  )
  if stages * p <= n:
    return
  more = host_devices.cpu_count_hint(kind, n)
  if p > n:
    raise UsageError(
      f"config.data_parallel.pipelines: {p} pipelines need at least {p} "
      f"devices, this run has {n} (jax.devices(): {n} {kind}); use at most "
      f"{n} pipelines{more}"
    )
  have = f"this run has {n} (jax.devices(): {n} {kind})"
  if config.pipeline.replicas:  # The replicas, not the stages, add up.
    raise UsageError(
      f"config.pipeline.replicas: {config.pipeline.num_stages} stages with "
      f"replicas {config.pipeline.replicas!r} need {stages * p} devices, "
      f"{have}; give replicas adding up to at most {n // p}{more}"
    )
  what = f"{p} pipelines x {stages} stages" if p > 1 else f"{stages} stages"
  most = max(n // p, 1)
  raise UsageError(
    f"config.pipeline.num_stages: {what} need {stages * p} devices, {have}; "
    f"use at most {most} stages"
    + (
      f" per pipeline, or at most {max(n // stages, 1)} pipelines "
      "(--config.data_parallel.pipelines)"
      if p > 1
      else ""
    )
    + ", or --config.pipeline.partition=mixed (several stages per device)"
    + more
  )
