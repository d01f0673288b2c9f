"""Config -> data -> Pipeline -> loop, evaluation, checkpoints, logs.

Small top-level functions (build the model, the optimizer, the pipeline)
and ``train_and_evaluate``, the imperative shell that runs them.
"""

import dataclasses
import importlib
import os
import signal
import time

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax
import tqdm

import jpipe
from jpipe import schedule as schedule_lib
from jpipe.train import checkpoint as checkpoint_lib
from jpipe.train import config_check, input_pipeline
from jpipe.train.metric_log import MetricLog


@dataclasses.dataclass(frozen=True)
class Task:
  """A model with its loss: ``loss_fn`` for the Pipeline, ``logits_fn``
  for evaluation; ``model_state`` is None without BatchNorm."""

  loss_fn: object
  logits_fn: object
  params: object
  model_state: object


def build_task(config, example_x) -> Task:
  """jpipe.models.<name>.Model(**kwargs) with a softmax cross-entropy."""
  try:
    module = importlib.import_module(f"jpipe.models.{config.model.name}")
  except ModuleNotFoundError as e:
    raise ValueError(
      f"config.model.name: no model {config.model.name!r} in jpipe.models "
      f"(mlp, resnet, vgg, gpt, t5)"
    ) from e
  model = module.Model(**config.model.kwargs.to_dict())
  variables = model.init(jax.random.key(config.seed), example_x[:1])
  params = variables["params"]
  if "batch_stats" in variables:

    def loss_fn(params, stats, batch):
      logits, updates = model.apply(
        {"params": params, "batch_stats": stats},
        batch["x"],
        mutable=["batch_stats"],
      )
      loss = optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"])
      return loss.mean(), updates["batch_stats"]

    def logits_fn(params, stats, x):
      return model.apply(
        {"params": params, "batch_stats": stats}, x, train=False
      )

    return Task(loss_fn, logits_fn, params, variables["batch_stats"])

  def loss_fn(params, batch):
    logits = model.apply({"params": params}, batch["x"])
    return optax.softmax_cross_entropy_with_integer_labels(
      logits, batch["y"]
    ).mean()

  def logits_fn(params, stats, x):
    del stats
    return model.apply({"params": params}, x, train=False)

  return Task(loss_fn, logits_fn, params, None)


def learning_rate(config):
  """A constant or warm-up + cosine schedule (per optimizer step)."""
  opt = config.optimizer
  if opt.schedule == "constant":
    return opt.learning_rate
  steps = config.train.steps * _steps_per_call(config)
  return optax.warmup_cosine_decay_schedule(
    0.0, opt.learning_rate, max(opt.warmup_steps, 1), max(steps, 2)
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


def _steps_per_call(config) -> int:
  """Optimizer steps one pipeline step takes."""
  if config.schedule.name == "async":
    m = config.pipeline.num_microbatches
    return -(-m // config.schedule.step_every)
  if config.schedule.name == "2bw":
    return config.pipeline.num_microbatches // config.schedule.step_every
  return 1


def build_pipeline(config, task: Task, example_batch, tx, lr):
  st = config.staleness
  kwargs = {}
  if config.schedule.name in ("async", "2bw"):
    kwargs["step_every"] = config.schedule.step_every
  if st.stashing:
    kwargs["weight_stashing"] = True
  if st.prediction:
    kwargs["prediction"] = st.prediction
  if st.gap_aware:
    kwargs["gap_aware"] = st.gap_aware
    kwargs["gap_aware_policy"] = st.gap_aware_policy
    kwargs["gap_aware_options"] = {
      "optimizer": config.optimizer.name,
      "learning_rate": lr,
      "weight_decay": config.optimizer.weight_decay,
    }
  if task.model_state is not None:
    kwargs["model_state"] = task.model_state
  devices = jax.devices()
  return jpipe.Pipeline(
    task.loss_fn,
    task.params,
    example_batch,
    num_stages=config.pipeline.num_stages,
    devices=devices,
    schedule=config.schedule.name,
    num_microbatches=config.pipeline.num_microbatches,
    optimizer=tx,
    partition=config.pipeline.partition,
    depth=config.pipeline.depth,
    recompute=config.pipeline.recompute,
    **kwargs,
  )


def fingerprint(config) -> dict:
  """What a checkpoint must match to be resumed (not the partition)."""
  return {
    "model": config.model.name,
    "model_kwargs": repr(sorted(config.model.kwargs.to_dict().items())),
    "optimizer": config.optimizer.name,
  }


def evaluate(task: Task, params, model_state, data, batch_size=512) -> float:
  """Accuracy of the full model on ``data`` (one device)."""
  logits_fn = jax.jit(task.logits_fn)
  correct = 0
  for i in range(0, len(data.labels), batch_size):
    logits = logits_fn(params, model_state, data.images[i : i + batch_size])
    correct += int(
      jnp.sum(jnp.argmax(logits, -1) == data.labels[i : i + batch_size])
    )
  return correct / len(data.labels)


class _StopRequest:
  """SIGTERM / SIGINT: finish the current step, checkpoint, exit."""

  def __init__(self):
    self.signal = None
    self._old = {}

  def __enter__(self):
    for sig in (signal.SIGTERM, signal.SIGINT):
      self._old[sig] = signal.signal(sig, self._handle)
    return self

  def _handle(self, signum, frame):
    del frame
    self.signal = signal.Signals(signum).name

  def __exit__(self, *exc):
    for sig, old in self._old.items():
      signal.signal(sig, old)


def train_and_evaluate(config: ml_collections.ConfigDict, workdir: str) -> dict:
  """Trains as the config says, resuming from ``workdir`` if it has a
  checkpoint. Returns the closing summary (also printed)."""
  config_check.check(config)
  os.makedirs(workdir, exist_ok=True)
  train_data, eval_data = input_pipeline.load(config)
  bs = config.data.batch_size
  example = input_pipeline.batch_at(train_data, 0, bs, config.seed)
  task = build_task(config, example["x"])
  lr = learning_rate(config)
  tx = build_optimizer(config, lr)
  pipe = build_pipeline(config, task, example, tx, lr)
  checkpoints = checkpoint_lib.Checkpoints(
    workdir, config.train.keep_checkpoints
  )
  state = pipe.init(task.params, task.model_state)
  start = 0
  if checkpoints.latest_step() is not None:
    template = jax.tree.map(np.asarray, pipe.state_dict(state))
    saved, meta = checkpoints.restore(template, fingerprint(config))
    try:
      state = pipe.load_state_dict(saved)
    except ValueError as e:
      raise checkpoint_lib.CheckpointError(
        f"checkpoint in {checkpoints.directory} does not fit this model: "
        f"{e}; delete it or use another --workdir"
      ) from e
    start = int(meta["step"])
    print(f"Resuming from step {start} ({checkpoints.directory}).")
  _print_plan(pipe)
  log = MetricLog(workdir)

  def save(step):
    checkpoints.save(
      step,
      jax.tree.map(np.asarray, pipe.state_dict(state)),
      {"step": step, "fingerprint": fingerprint(config)},
    )

  steps = config.train.steps
  accuracy = None
  seconds, examples = 0.0, 0
  with _StopRequest() as stop:
    bar = tqdm.tqdm(
      range(start, steps),
      initial=start,
      total=steps,
      unit="step",
      dynamic_ncols=True,
      mininterval=1.0,
    )
    for step in bar:
      batch = input_pipeline.batch_at(train_data, step, bs, config.seed)
      profile = config.train.profile_last_step and step == steps - 1
      t0 = time.perf_counter()
      state, metrics = pipe.step(state, batch, profile=profile)
      loss = float(metrics["loss"])  # Blocks: the step is done.
      seconds += time.perf_counter() - t0
      examples += bs
      done = step + 1
      bar.set_postfix(loss=f"{loss:.4f}")
      if not np.isfinite(loss):
        raise FloatingPointError(
          f"loss is {loss} at step {done}: lower config.optimizer."
          f"learning_rate (now {config.optimizer.learning_rate})"
        )
      if done % config.train.log_every == 0 or done == steps:
        log.write(done, loss=loss, examples_per_second=examples / seconds)
      if done % config.train.eval_every == 0 or done == steps:
        accuracy = evaluate(
          task,
          pipe.gather_params(state),
          pipe.gather_model_state(state),
          eval_data,
        )
        log.write(done, eval_accuracy=accuracy)
        bar.write(f"step {done}: loss {loss:.4f}, eval accuracy {accuracy:.4f}")
      if done % config.train.checkpoint_every == 0 or done == steps:
        save(done)
      if stop.signal:
        save(done)
        bar.close()
        print(f"{stop.signal}: saved step {done} to {checkpoints.directory}.")
        log.close()
        checkpoints.close()
        raise SystemExit(0)
    bar.close()
  log.close()
  checkpoints.close()
  return _summary(config, pipe, workdir, examples, seconds, accuracy)


def _print_plan(pipe) -> None:
  plan = pipe.plan
  print(
    f"{plan.num_stages} stages on devices "
    f"{[d[0] for d in plan.stage_devices]}, schedule "
    f"{pipe.schedule.name}, {pipe.num_microbatches} microbatches; "
    f"predicted speed-up {plan.predicted_speedup:.2f}"
  )


def _summary(config, pipe, workdir, examples, seconds, accuracy) -> dict:
  summary = {
    "examples_per_second": examples / seconds if seconds else float("nan"),
    "eval_accuracy": accuracy,
  }
  lines = [
    f"Done: {config.train.steps} steps; eval accuracy "
    f"{accuracy if accuracy is None else round(accuracy, 4)}; "
    f"throughput {summary['examples_per_second']:.1f} examples/s "
    f"(this run)."
  ]
  if pipe.timeline is not None:
    timeline = pipe.timeline
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
    schedule_lib.plot_timeline(timeline, png)
    schedule_lib.write_chrome_trace(timeline, trace)
    summary["timeline_png"] = png
    lines.append(
      "Per-stage share of device time (last step): "
      + ", ".join(f"stage {s} {100 * f:.0f}%" for s, f in split.items())
    )
    lines.append(f"Timeline: {png} (Perfetto trace: {trace})")
  print("\n".join(lines))
  return summary
