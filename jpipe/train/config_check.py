"""Checks a training config before any work: each problem names its key."""

import os

import ml_collections

from jpipe import dynamic, parallel, partition
from jpipe import schedule as schedule_lib
from jpipe import staleness as staleness_lib
from jpipe.runtime import GAP_AWARE_POLICIES, REPLICA_ROUTINGS, Staleness
from jpipe.train import input_pipeline, optimizers, tasks, user_code
from jpipe.train.data_parallel_mode import uses_data_parallel
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


_UNITS = {"": 1, "B": 1, "KB": 1e3, "MB": 1e6, "GB": 1e9, "TB": 1e12}
_UNITS |= {"KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}


def staleness(config, learning_rate=None) -> Staleness:
  """The config's staleness options as ``jpipe.Pipeline`` takes them (one
  value; ``learning_rate`` is Gap-Aware's, None where only checked)."""
  st = config.staleness
  options = None
  if st.gap_aware:
    options = {
      "optimizer": config.optimizer.name,
      "learning_rate": learning_rate,
      "weight_decay": config.optimizer.weight_decay,
    }
  return Staleness(
    recompute=config.pipeline.recompute,
    step_every=config.schedule.step_every if _streams(config) else 1,
    weight_stashing=bool(st.stashing),
    prediction=st.prediction or None,
    gap_aware=st.gap_aware or None,
    gap_aware_options=options,
    gap_aware_policy=st.gap_aware_policy,
    split_flush=config.schedule.split_flush,
    nag_with_predictor=bool(st.nag_with_predictor),
    # (A placeholder rate where only checked.)
    last_stage_optimizer=optimizers.build(
      config, 0.0 if learning_rate is None else learning_rate, nesterov=True
    )
    if st.nesterov_last_stage
    else None,
    partial_window=st.partial_window,
    supremum_staleness=supremum_staleness(config.schedule.supremum_staleness),
    pipemare_anneal_steps=pipemare_anneal_steps(config),
    stage_optimizer=delay_nesterov(config, learning_rate),
  )


def schedule_kind(config):
  """The registered ``ScheduleKind`` of ``config.schedule.name``, or None
  (a name no schedule has: refused by the checks)."""
  return schedule_lib.REGISTRY.get(config.schedule.name)


def _streams(config) -> bool:
  kind = schedule_kind(config)
  return kind is not None and kind.asynchronous


def _stale(config) -> bool:
  kind = schedule_kind(config)
  return kind is not None and kind.stale


def _two_versions(config) -> bool:
  kind = schedule_kind(config)
  return kind is not None and kind.two_versions


def steps_per_call(config) -> int:
  """Optimizer steps one pipeline step takes."""
  kind, m = schedule_kind(config), config.pipeline.num_microbatches
  if kind is None or not kind.asynchronous:
    return 1
  if kind.two_versions:  # A whole minibatch a step.
    return m // config.schedule.step_every
  return -(-m // config.schedule.step_every)


def pipemare_anneal_steps(config) -> int | None:
  """``staleness.pipemare_anneal_steps`` as ``jpipe.Pipeline`` takes it:
  0 -> None (off), -1 -> a quarter of the run's optimizer steps."""
  k = config.staleness.pipemare_anneal_steps
  if k == -1:
    return max(1, config.train.steps * steps_per_call(config) // 4)
  return k or None


def delay_nesterov(config, learning_rate=None):
  """``staleness.delay_nesterov`` as ``jpipe.Pipeline``'s
  ``stage_optimizer``: ``(delay, num_stages) -> optimizer``, or None."""
  mode = config.staleness.delay_nesterov
  if not mode:
    return None
  opt = config.optimizer
  args = optimizers.parse_args(opt.args)
  base = opt.momentum if opt.name == "sgd" else args.get("b1", 0.9)
  lr = 0.0 if learning_rate is None else learning_rate

  def stage_optimizer(delay, num_stages):
    return staleness_lib.delay_aware_nesterov(
      lr,
      delay=delay,
      num_stages=num_stages,
      optimizer=opt.name,
      momentum=staleness_lib.NESTEROV_MOMENTUM if mode == "fixed" else base,
      adaptive=mode == "adaptive",
      b2=args.get("b2", 0.999),
      eps=args.get("eps", 1e-8),
      weight_decay=opt.weight_decay,
    )

  return stage_optimizer


def supremum_staleness(text: str) -> int | str | None:
  """``config.schedule.supremum_staleness`` as ``jpipe.Pipeline`` takes
  it: "" -> None, "auto", or a number -> int."""
  text = str(text).strip()
  if not text or text == "auto":
    return text or None
  try:
    return int(text)
  except ValueError:
    raise ValueError(
      f"schedule.supremum_staleness {text!r}: use '' (no cap), 'auto' (the "
      "devices) or a number of stages"
    ) from None


def memory_limit(text: str) -> float | str | None:
  """``config.pipeline.memory_limit`` as ``jpipe.Pipeline`` takes it: ""
  -> None, "device", or a size ("16GiB", "512MB", "2e9") -> bytes."""
  text = text.strip()
  if not text:
    return None
  if text == "device":
    return text
  number = text.rstrip("KMGTkmgtIiBb").strip()
  unit = text[len(number) :].strip().upper()
  try:
    value = float(number) * _UNITS[unit]
  except (KeyError, ValueError):
    raise ValueError(
      f"{text!r} is not a size: use bytes ('2e9'), a unit ('16GiB', "
      "'512MB'), 'device' or '' (no limit)"
    ) from None
  if not value > 0:
    raise ValueError(f"{text!r}: a memory limit must be > 0")
  return value


COMMAND_BUFFERS = {"auto": None, "on": True, "off": False}


def command_buffers(text: str) -> bool | None:
  """``config.pipeline.gpu_command_buffers`` as ``jpipe.Pipeline`` takes
  it: "auto" -> None (the schedule decides), "on" -> True, "off" ->
  False."""
  if text not in COMMAND_BUFFERS:
    raise ValueError(
      f"{text!r} is not one of {tuple(COMMAND_BUFFERS)} (auto: CUDA graphs "
      "for synchronous schedules, not for streams)"
    )
  return COMMAND_BUFFERS[text]


def written_schedule(config) -> schedule_lib.ScheduleKind | None:
  """The schedule ``config.schedule.file`` writes (None: none), checked
  against the config's stages and microbatches (UsageError naming the
  problem)."""
  path = config.schedule.get("file", "")
  if not path:
    return None
  try:
    with open(path) as f:
      text = f.read()
    name = os.path.splitext(os.path.basename(path))[0]
    kind = schedule_lib.custom_schedule(f"file:{name}", text)
  except (OSError, ValueError) as e:
    raise UsageError(f"config.schedule.file: {path}: {e}") from None
  want = (config.pipeline.num_stages, config.pipeline.num_microbatches)
  have = (kind.written.num_stages, kind.written.num_microbatches)
  if have != want:
    raise UsageError(
      f"config.schedule.file: {path} is written for {have[0]} stages and "
      f"{have[1]} microbatches; the config has pipeline.num_stages="
      f"{want[0]} and pipeline.num_microbatches={want[1]}"
    )
  if config.schedule.name != "1f1b":
    raise UsageError(
      f"config.schedule.name={config.schedule.name!r} and "
      "config.schedule.file are both set: the file's schedule runs; "
      "leave schedule.name at its default"
    )
  return kind


def check(config: ml_collections.ConfigDict) -> None:
  """Raises UsageError (a ValueError) listing every invalid field and how to fix it."""
  written_schedule(config)  # Its own one-line error: the file's problem.
  problems = []

  def need(ok, key, message):
    if not ok:
      problems.append(f"config.{key}: {message}")

  _check_names(config, need)
  _check_pipeline(config, need)
  _check_loop(config, need)
  _check_staleness(config, need, problems)
  _check_runtime(config, need, problems)
  _check_data_parallel(config, need, problems)
  _check_dynamic(config, need, problems)
  if problems:
    if len(problems) == 1:  # One line: the key and its fix.
      raise UsageError(f"invalid config: {problems[0]}")
    raise UsageError("invalid config:\n  " + "\n  ".join(problems))


def _check_names(config, need) -> None:
  """Names the config chooses from a list, and the learning rate."""
  need(
    config.schedule.name in schedule_lib.SCHEDULES,
    "schedule.name",
    f"{config.schedule.name!r} is not one of {schedule_lib.SCHEDULES}",
  )
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
  need(
    config.optimizer.schedule in LR_SCHEDULES,
    "optimizer.schedule",
    f"{config.optimizer.schedule!r} is not one of {LR_SCHEDULES}",
  )
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


def _check_pipeline(config, need) -> None:
  """The pipeline's partition, costs, stages and microbatches."""
  need(
    config.pipeline.partition in PARTITIONS,
    "pipeline.partition",
    f"{config.pipeline.partition!r} is not one of {PARTITIONS}",
  )
  need(
    config.pipeline.bandwidth >= 0,
    "pipeline.bandwidth",
    "must be >= 0 bytes/s (0: plan on compute alone)",
  )
  need(
    config.pipeline.cost_model in COST_MODELS,
    "pipeline.cost_model",
    f"{config.pipeline.cost_model!r} is not one of {COST_MODELS}",
  )
  need(config.pipeline.num_stages >= 1, "pipeline.num_stages", "must be >= 1")
  need(
    config.pipeline.depth >= 0,
    "pipeline.depth",
    "must be >= 0 (0 chooses it; 1 cuts at the root's children)",
  )
  m = config.pipeline.num_microbatches
  need(m >= 1, "pipeline.num_microbatches", "must be >= 1")
  if m >= 1:
    need(
      config.data.batch_size % m == 0,
      "pipeline.num_microbatches",
      f"{m} does not divide data.batch_size={config.data.batch_size}: use "
      f"a divisor of it",
    )


def _check_loop(config, need) -> None:
  """The learning-rate warm-up, the loop's counts and the init."""
  # Counts and their least values.
  counts = {"optimizer.warmup_steps": 0, "train.steps": 1}
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
    opt.warmup_steps == 0 or opt.schedule not in ("constant", "multistep"),
    "optimizer.warmup_steps",
    f"{opt.warmup_steps} has no effect with optimizer.schedule="
    f"{opt.schedule!r}: set --config.optimizer.schedule=warmup_cosine "
    f"(or warmup_linear, rsqrt), or warmup_steps=0",
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
  """The staleness options, and what the Pipeline itself would refuse."""
  st = config.staleness
  need(
    st.prediction in ("", "msnag", "aggmsnag"),
    "staleness.prediction",
    f"{st.prediction!r} is not one of '', 'msnag', 'aggmsnag'",
  )
  need(
    st.gap_aware in ("", "ga", "ga_jfl"),
    "staleness.gap_aware",
    f"{st.gap_aware!r} is not one of '', 'ga', 'ga_jfl'",
  )
  need(
    st.gap_aware_policy in GAP_AWARE_POLICIES,
    "staleness.gap_aware_policy",
    f"{st.gap_aware_policy!r} is not one of {tuple(GAP_AWARE_POLICIES)}",
  )
  need(
    config.schedule.step_every == 1 or _streams(config),
    "schedule.step_every",
    f"{config.schedule.step_every} applies to schedule.name "
    f"{' or '.join(map(repr, schedule_lib.STREAMS))} only "
    f"({config.schedule.name!r} steps once per call): set it to 1",
  )
  need(
    not (st.prediction or st.gap_aware)
    or config.optimizer.name in optimizers.STALENESS_AWARE,
    "optimizer.name",
    f"weight prediction and Gap-Aware read the state of "
    f"{optimizers.STALENESS_AWARE}, not {config.optimizer.name!r}: use one "
    f"of them or weight stashing alone",
  )
  need(
    not st.nesterov_last_stage
    or (config.optimizer.name == "sgd" and config.optimizer.momentum > 0),
    "staleness.nesterov_last_stage",
    "FTPipe's Nesterov last stage is momentum SGD's: set "
    "--config.optimizer.name=sgd and a momentum > 0, or drop it",
  )
  need(
    st.delay_nesterov in ("", "adaptive", "fixed"),
    "staleness.delay_nesterov",
    f"{st.delay_nesterov!r} is not one of '', 'adaptive', 'fixed'",
  )
  need(
    not st.delay_nesterov
    or config.optimizer.name in optimizers.STALENESS_AWARE,
    "staleness.delay_nesterov",
    f"the delay-aware Nesterov method replaces sgd, adam or adamw with "
    f"their Nesterov forms, not {config.optimizer.name!r}: set "
    f"--config.optimizer.name to one of {optimizers.STALENESS_AWARE}",
  )
  need(
    not (st.delay_nesterov == "fixed" and config.optimizer.name == "sgd"),
    "staleness.delay_nesterov",
    "'fixed' (beta1 0.99 on every stage) is the authors' NAdamW for adam "
    "/ adamw; SGD's rate would act ten times larger: use 'adaptive'",
  )
  need(
    isinstance(st.pipemare_anneal_steps, int)
    and st.pipemare_anneal_steps >= -1,
    "staleness.pipemare_anneal_steps",
    f"{st.pipemare_anneal_steps!r}: optimizer steps (0 = off, -1 = a "
    "quarter of the run)",
  )
  need(
    not ((st.pipemare_anneal_steps or st.delay_nesterov) and st.prediction),
    "staleness.prediction",
    "prediction replays the configured optimizer, not a stage's own "
    "(delay_nesterov) or rescheduled one (pipemare_anneal_steps): drop one",
  )
  uses = (
    st.stashing
    or st.prediction
    or st.gap_aware
    or st.pipemare_anneal_steps
    or st.delay_nesterov
  )
  need(
    not uses or _stale(config),
    "staleness",
    "weight stashing, prediction, gap-aware and the delay corrections "
    f"apply to schedule.name={' or '.join(map(repr, schedule_lib.STALE))} "
    "only",
  )
  need(
    not st.gap_aware or config.schedule.step_every == 1,
    "schedule.step_every",
    f"staleness.gap_aware needs step_every=1 (FTPipe: each optimizer step "
    f"applies one microbatch, whose forward's params define the gap), got "
    f"{config.schedule.step_every}: set --config.schedule.step_every=1 or "
    f"drop staleness.gap_aware",
  )
  if not problems:  # What the Pipeline itself would refuse, before work.
    try:
      staleness(config).check(config.schedule.name)
    except ValueError as e:
      problems.append(f"config.staleness / config.schedule: {e}")


def _check_runtime(config, need, problems) -> None:
  """The memory limit, the transport, CUDA graphs and 2BW's minibatch."""
  try:
    memory_limit(config.pipeline.memory_limit)
  except ValueError as e:
    problems.append(f"config.pipeline.memory_limit: {e}")
  try:
    command_buffers(config.pipeline.gpu_command_buffers)
  except ValueError as e:
    problems.append(f"config.pipeline.gpu_command_buffers: {e}")
  need(
    config.pipeline.transport in ("pull", "collective"),
    "pipeline.transport",
    f"{config.pipeline.transport!r} is not one of 'pull', 'collective'",
  )
  routing = config.pipeline.replica_routing
  need(
    routing in REPLICA_ROUTINGS,
    "pipeline.replica_routing",
    f"{routing!r} is not one of {', '.join(map(repr, REPLICA_ROUTINGS))}",
  )
  if routing == "round_robin" and _streams(config):
    need(
      _stale(config) and config.schedule.step_every == 1,
      "pipeline.replica_routing",
      "round_robin (PipeDream's 1F1B-RR) streams as "
      f"{' or '.join(map(repr, schedule_lib.STALE))} with "
      "schedule.step_every 1: a replicated stage steps once per round of "
      "its replicas",
    )
  if _two_versions(config):
    need(
      config.schedule.step_every >= config.pipeline.num_stages,
      "schedule.step_every",
      f"{config.schedule.name} needs microbatches per minibatch >= "
      f"pipeline.num_stages "
      f"({config.pipeline.num_stages}), got {config.schedule.step_every}",
    )


def _v_shaped(config) -> bool:
  """Whether the schedule places two stages per device in a V."""
  kind = schedule_lib.REGISTRY.get(config.schedule.name)
  return kind is not None and kind.placement is not None


def _check_v_placement(config, need) -> None:
  """zbv and dualpipev: an even stage count, contiguous stages, and
  DualPipeV's 2p microbatches."""
  if not _v_shaped(config):
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
  n, stages = len(devices), config.pipeline.num_stages
  if _v_shaped(config):
    stages = (stages + 1) // 2
  kind = devices[0].platform if devices else "no"
  p = config.data_parallel.pipelines if uses_data_parallel(config) else 1
  if stages * p <= n:
    return
  if p > n:
    raise UsageError(
      f"config.data_parallel.pipelines: {p} pipelines need at least {p} "
      f"devices, this run has {n} (jax.devices(): {n} {kind}); use at most "
      f"{n} pipelines"
    )
  what = f"{p} pipelines x {stages} stages" if p > 1 else f"{stages} stages"
  most = max(n // p, 1)
  raise UsageError(
    f"config.pipeline.num_stages: {what} need {stages * p} devices, this "
    f"run has {n} (jax.devices(): {n} {kind}); use at most {most} stages"
    + (" per pipeline" if p > 1 else "")
    + ", or --config.pipeline.partition=mixed (several stages per device)"
  )


def _check_dynamic(config, need, problems) -> None:
  """DynPipe's options (``config.dynamic``)."""
  dyn = config.dynamic
  need(
    dyn.policy in dynamic.POLICIES,
    "dynamic.policy",
    f"{dyn.policy!r} is not one of {dynamic.POLICIES}",
  )
  need(dyn.window >= 1, "dynamic.window", "must be >= 1 steps")
  need(dyn.warmup_windows >= 0, "dynamic.warmup_windows", "must be >= 0")
  need(dyn.top_k >= 1, "dynamic.top_k", "must be >= 1")
  need(dyn.horizon_steps >= 0, "dynamic.horizon_steps", "must be >= 0")
  need(dyn.simulated_ms >= 0, "dynamic.simulated_ms", "must be >= 0")
  need(
    dyn.low < 1.0 < dyn.high,
    "dynamic.high",
    f"the thresholds need low < 1 < high, got low={dyn.low}, high={dyn.high}",
  )
  try:
    inject = dynamic.parse_inject(dyn.inject)
  except ValueError as e:
    problems.append(f"config.dynamic.inject: {e}")
    inject = ()
  if not dyn.enabled:
    need(
      not inject and not dyn.simulated_ms and not dyn.predictor,
      "dynamic.enabled",
      "inject / simulated_ms / predictor are set but dynamic.enabled is "
      "False: enable it (policy='static' to measure without "
      "re-partitioning)",
    )
    return
  _check_dynamic_run(config, need, inject)


def _check_dynamic_run(config, need, inject) -> None:
  """What an enabled re-partitioning run needs of the rest of the config."""
  dyn = config.dynamic
  need(
    not uses_data_parallel(config),
    "dynamic.enabled",
    "re-partitioning runs one pipeline: set data_parallel.pipelines=1 "
    "(and no data_parallel delays)",
  )
  need(
    config.pipeline.partition
    in ("contiguous", "pipedream", "pipedream_hybrid"),
    "pipeline.partition",
    f"re-partitioning keeps a straight pipeline, one stage per device or "
    f"replica group; {config.pipeline.partition!r} is not: use "
    "'contiguous', 'pipedream' or 'pipedream_hybrid'",
  )
  need(
    config.pipeline.replica_routing in ("split", "weighted"),
    "pipeline.replica_routing",
    "re-partitioning runs replicated stages that split each microbatch: "
    "set it to 'split' or 'weighted' (re-split by the replicas' speeds)",
  )
  need(
    config.schedule.name != "interleaved" and not _v_shaped(config),
    "schedule.name",
    f"re-partitioning needs one stage per device, not {config.schedule.name!r}",
  )
  need(
    not dyn.predictor or dyn.policy != "static",
    "dynamic.predictor",
    "the static policy never re-plans, so a predictor would go unused: "
    "set dynamic.policy to 'jpipe' or 'dynpipe', or predictor=''",
  )
  need(
    not dyn.predictor or os.path.isfile(dyn.predictor),
    "dynamic.predictor",
    f"no file {dyn.predictor!r}: write one with `python -m "
    "jpipe.train.slowdowns --config CONFIG --out PATH`",
  )
  stages = config.pipeline.num_stages
  for s in inject:
    need(
      s.device < max(stages, 1),
      "dynamic.inject",
      f"device {s.device} holds no stage of {stages}: use 0 .. {stages - 1}",
    )


def _check_data_parallel(config, need, problems) -> None:
  dp = config.data_parallel
  p = dp.pipelines
  need(p >= 1, "data_parallel.pipelines", "must be >= 1")
  need(
    dp.sync in parallel.SYNC_POLICIES,
    "data_parallel.sync",
    f"{dp.sync!r} is not one of {parallel.SYNC_POLICIES}",
  )
  need(
    p > 1 or dp.sync == "allreduce",
    "data_parallel.sync",
    f"{dp.sync!r} synchronises several pipelines: set "
    "data_parallel.pipelines >= 2 (or sync='allreduce')",
  )
  need(
    dp.placement in parallel.PLACEMENTS,
    "data_parallel.placement",
    f"{dp.placement!r} is not one of {parallel.PLACEMENTS}",
  )
  need(
    dp.sync != "adpsgd" or p % 2 == 0,
    "data_parallel.sync",
    f"adpsgd pairs pipelines: it needs an even data_parallel.pipelines, "
    f"got {p} (or use sync='preduce')",
  )
  need(
    p == 1 or config.pipeline.partition != "pipedream_hybrid",
    "pipeline.partition",
    "pipedream_hybrid replicates stages inside a pipeline; with "
    "data_parallel.pipelines > 1 the pipelines are the replicas: use "
    "'contiguous' or 'pipedream'",
  )
  for key in ("epoch_batches", "hetero", "simulated_ms"):
    need(dp[key] >= 0, f"data_parallel.{key}", "must be >= 0")
  for key in ("ssp_bound", "hetpipe_every"):
    need(dp[key] >= 1, f"data_parallel.{key}", "must be >= 1")
  try:
    slowdown = parallel.parse_slowdown(dp.slowdown)
    parallel.Heterogeneity(slowdown=slowdown)
  except ValueError as e:
    problems.append(f"config.data_parallel.slowdown: {e}")
    slowdown = {}
  need(
    not slowdown or dp.simulated_ms > 0,
    "data_parallel.slowdown",
    "slows the simulated compute time down: set data_parallel.simulated_ms "
    "> 0 too",
  )
