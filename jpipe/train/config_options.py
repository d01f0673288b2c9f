"""A training config as the library's options: each section turned into
the value ``jpipe.Pipeline`` (or the loop) takes, with the conversions'
own errors (a size, a schedule file, a cap); ``config_check`` checks the
rest before any work."""

import inspect
import os

import optax

from jpipe import partition as partition_lib
from jpipe import schedule as schedule_lib
from jpipe import staleness as staleness_lib
from jpipe.runtime import DynamicLossScale, Staleness
from jpipe.train import optimizers
from jpipe.train.errors import UsageError

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
    if config.optimizer.name in ("adam", "adamw"):
      # FTPipe's Adam Gap-Aware: S decays with beta2, C adds Adam's eps.
      b1, b2, eps = adam_args(config)
      options |= {"beta": b2, "eps": eps}
      if st.gap_aware == "ga_from_grad":
        options["adam_betas"] = (b1, b2)
    if config.optimizer.no_decay:  # The optimizer's own mask.
      options["weight_decay_mask"] = optimizers.decay_mask(
        config.optimizer.no_decay
      )
  return Staleness(
    recompute=config.pipeline.recompute,
    step_every=config.schedule.step_every if streams(config) else 1,
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


def streams(config) -> bool:
  """Whether the config's schedule streams microbatches across optimizer
  steps (``ScheduleKind.asynchronous``: 'async', '2bw')."""
  kind = schedule_kind(config)
  return kind is not None and kind.asynchronous


def v_shaped(config) -> bool:
  """Whether the schedule places two stages per device in a V."""
  kind = schedule_kind(config)
  return kind is not None and kind.placement is not None


def stage_devices_needed(config) -> int:
  """Devices one pipeline's stages take: one per stage; half under a V
  schedule; num_stages / stages_per_device in a loop; a Split's own."""
  split = partition(config)
  if isinstance(split, partition_lib.Split):
    return split.num_devices
  stages = config.pipeline.num_stages
  if v_shaped(config):
    return (stages + 1) // 2
  return -(-stages // max(1, config.pipeline.stages_per_device))


def steps_per_call(config) -> int:
  """Optimizer steps one pipeline step takes."""
  kind, m = schedule_kind(config), config.pipeline.num_microbatches
  if kind is None or not kind.asynchronous:
    return 1
  if kind.two_versions:  # A whole minibatch a step.
    return m // config.schedule.step_every
  return -(-m // config.schedule.step_every)


# Learning-rate schedules whose shape depends on the steps they span.
DECAYING_SCHEDULES = ("warmup_cosine", "warmup_linear")


def schedule_steps(config) -> int:
  """Training steps a decaying schedule spans: ``optimizer.
  schedule_steps``, else ``train.steps``."""
  return config.optimizer.schedule_steps or config.train.steps


def adam_args(config) -> tuple[float, float, float]:
  """``(b1, b2, eps)`` of the config's Adam / AdamW: its
  ``optimizer.args``, else optax's defaults."""
  args = optimizers.parse_args(config.optimizer.args)
  fn = getattr(optax, config.optimizer.name)
  defaults = inspect.signature(fn).parameters
  return tuple(
    float(args.get(name, defaults[name].default))
    for name in ("b1", "b2", "eps")
  )


def pipemare_anneal_steps(config) -> int | None:
  """``staleness.pipemare_anneal_steps`` as ``jpipe.Pipeline`` takes it:
  0 -> None (off), -1 -> a quarter of the run's optimizer steps."""
  k = config.staleness.pipemare_anneal_steps
  if k == -1:
    return max(2, config.train.steps * steps_per_call(config) // 4)
  return k or None


def delay_nesterov(config, learning_rate=None):
  """``staleness.delay_nesterov`` as ``jpipe.Pipeline``'s
  ``stage_optimizer``: ``(delay, num_stages) -> optimizer``, or None."""
  mode = config.staleness.delay_nesterov
  if not mode:
    return None
  opt = config.optimizer
  if opt.name == "sgd":  # (Its Nesterov form reads neither b2 nor eps.)
    base, b2, eps = opt.momentum, 0.999, 1e-8
  else:
    base, b2, eps = adam_args(config)
  lr = 0.0 if learning_rate is None else learning_rate

  def stage_optimizer(delay, num_stages):
    return staleness_lib.delay_aware_nesterov(
      lr,
      delay=delay,
      num_stages=num_stages,
      optimizer=opt.name,
      momentum=staleness_lib.NESTEROV_MOMENTUM if mode == "fixed" else base,
      adaptive=mode == "adaptive",
      b2=b2,
      eps=eps,
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


def loss_scale(config):
  """``config.optimizer.loss_scale`` as ``jpipe.Pipeline`` takes it: ""
  -> None, "dynamic" -> a ``DynamicLossScale`` growing after
  ``loss_scale_window`` finite steps, a number -> that static scale."""
  value = loss_scale_value(config.optimizer.loss_scale)
  if value == "dynamic":
    return DynamicLossScale(growth_interval=config.optimizer.loss_scale_window)
  return value


def loss_scale_value(text) -> float | str | None:
  """A loss scale's text read: "" -> None, "dynamic", or a number > 0."""
  text = str(text).strip()
  if not text or text == "dynamic":
    return text or None
  try:
    value = float(text)
  except ValueError:
    value = None
  if value is None or not 0 < value < float("inf"):
    raise ValueError(
      f"{text!r} is not a loss scale: use a number > 0 ('4096'), 'dynamic' "
      "or '' (none)"
    )
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


def partition(config):
  """``jpipe.Pipeline``'s ``partition``: the config's method, or the
  ``jpipe.partition.Split`` its ``pipeline.split`` / ``pipeline.replicas``
  give (config_check has checked them)."""
  nodes, replicas = (
    counts(config.pipeline.split),
    counts(config.pipeline.replicas),
  )
  if nodes is None and replicas is None:
    return config.pipeline.partition
  return partition_lib.Split(nodes, replicas)


def mixed_blocks(config) -> tuple[int, ...] | None:
  """``config.pipeline.mixed_blocks`` as ``jpipe.Pipeline`` takes it:
  "" -> None, "16,32" -> (16, 32) (config_check has checked it)."""
  return counts(config.pipeline.mixed_blocks)


def counts(text: str) -> tuple[int, ...] | None:
  """ "4,4,4" -> (4, 4, 4); "" -> None. A ValueError names a bad one."""
  if not text.strip():
    return None
  return tuple(int(x) for x in text.split(","))


def pipeline_devices(config, devices) -> list:
  """The devices a pipeline's stages take, in the planner's order.

  In one process: ``devices`` (a loop, ``stages_per_device`` > 1: its
  first num_stages / stages_per_device). Across processes, where the stages need
  fewer devices than there are (one per stage; half under a V schedule),
  the first ones of every process, as evenly as they go: the planner
  fills devices in order, so ``jax.devices()`` as it is would leave the
  last processes without a stage (nothing to run, no loss to report).
  FTPipe's mixed pipe and PipeDream's hybrid plans use every device.
  Raises UsageError when there are fewer stages than processes.
  """
  processes = sorted({getattr(d, "process_index", 0) for d in devices})
  if len(processes) == 1 and config.pipeline.stages_per_device > 1:
    return list(devices)[: stage_devices_needed(config)]  # The loop's p.
  if len(processes) == 1 or config.pipeline.partition in (
    "mixed",
    "pipedream_hybrid",
  ):
    return list(devices)
  stages, needed = config.pipeline.num_stages, stage_devices_needed(config)
  if needed < len(processes):
    raise UsageError(
      f"config.pipeline.num_stages: {stages} stages cannot give each of "
      f"the {len(processes)} processes a stage (a process without one has "
      f"nothing to run); use at least {len(processes)} devices' worth of "
      "stages, or fewer processes"
    )
  if needed >= len(devices):
    return list(devices)
  chosen = []
  for i, p in enumerate(processes):
    count = needed // len(processes) + (i < needed % len(processes))
    chosen += [d for d in devices if d.process_index == p][:count]
  return chosen
