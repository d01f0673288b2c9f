"""One pipeline in the training loop: a unit is one ``Pipeline.step``.

``PipelineMode`` feeds the step its batch (only shapes where this
process's stages read no batch leaf), drains an asynchronous stream
before evaluation and checkpoints, evaluates forward through the stages
(a Task's ``evaluation``: nothing gathered), explains a non-finite loss by the
stages whose params hold NaN or inf, and, with
``train.profile_last_step``, draws the measured timeline of the last
step (``timeline.png`` and a Perfetto trace in the workdir).
"""

import json
import os

import jax
import numpy as np

from jpipe import schedule as schedule_lib
from jpipe.runtime import format_bytes
from jpipe.train import config_cli, config_options
from jpipe.train import evaluation as evaluation_lib
from jpipe.train.loop import Mode, Outcome, aux_floats


class PipelineMode(Mode):
  """``pipe`` (a ``jpipe.Pipeline``, or anything with its training
  methods) trained step by step on ``task``'s batches (``example``: one
  of them, whose shapes stand in for the data where this process's
  stages read none)."""

  def __init__(self, pipe, task, config, say, example):
    self.pipe, self.task, self.config = pipe, task, config
    kind = config_options.schedule_kind(config)  # (None: auto, synchronous.)
    self.first_loss_at_init = kind is None or not kind.asynchronous
    self.profile_last = config.train.profile_last_step
    if self.profile_last and pipe.transport.multiprocess:
      say(
        "train.profile_last_step: no timeline across processes (each sees "
        "only its own stages); profile a one-process run of this config"
      )
      self.profile_last = False
    self.timeline = None  # (step, the last step's measured timeline)
    # Across processes, one whose stages read no batch leaf reads no data.
    self.shapes = jax.tree.map(
      lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), example
    )

  def init(self, task):
    return self.pipe.init(task.params, task.model_state)

  def restore(self, state, saved, meta, say):
    return self.pipe.load_state_dict(saved)

  def announce(self, state, workdir, main, say):
    if main:
      print_plan(self.pipe, self.config.optimizer.learning_rate)
      write_run_files(workdir, self.config, self.pipe)

  def advance(self, state, unit):
    pipe = self.pipe
    batch = self.task.batch_at(unit) if pipe.reads_batch else self.shapes
    # The last step is profiled: its programs are compiled by then.
    profile = self.profile_last and unit == self.config.train.steps - 1
    state, metrics = pipe.step(state, batch, profile=profile)
    # The examples it trained (a task's batches may have another size
    # than config.data.batch_size, or a short one).
    self.examples = int(jax.tree.leaves(batch)[0].shape[0])
    loss = float(metrics["loss"])  # Blocks: the step's losses are in.
    if profile:
      self.timeline = (unit + 1, metrics["timeline"])
    return state, self.outcome(loss, unit + 1, metrics)

  def outcome(self, loss, done, metrics) -> Outcome:
    """The step's ``Outcome`` (``metrics``: the step's)."""
    del done
    return Outcome(
      loss,
      self.examples,
      scalars=loss_scale_scalars(metrics),
      metrics=aux_floats(metrics),
      skipped=bool(metrics.get("step_skipped", False)),
    )

  def flush(self, state):
    state, _ = self.pipe.flush(state)
    return state

  def in_flight(self, state):
    flight = getattr(state, "in_flight", None)
    return flight is not None and not flight.drained

  def evaluation_inputs(self, state):
    # Every process gathers (a collective); process 0 evaluates.
    return self.pipe.gather_params(state), self.pipe.gather_model_state(state)

  def evaluate(self, state, task):
    if task.evaluation is None:  # The user's evaluate: on whole params.
      return super().evaluate(state, task)
    # Forward through the stages; every process gets the metrics.
    return evaluation_lib.through_pipeline(self.pipe, state, task.evaluation)

  def state_dict(self, state):
    return self.pipe.state_dict(state)

  # Across processes each process writes and reads its own stages' part
  # of a checkpoint: nothing is gathered (jpipe.train.process_arrays).
  per_process_checkpoints = property(lambda self: jax.process_count() > 1)

  def checkpoint_state(self, state):
    if not self.per_process_checkpoints:
      return super().checkpoint_state(state)
    return self.pipe.local_state_dict(state), True

  def checkpoint_layout(self, state):
    if not self.per_process_checkpoints:
      return super().checkpoint_layout(state)
    return self.pipe.state_dict_layout()

  def nonfinite_cause(self, state, outcome):
    bad = self.pipe.nonfinite_params(state)
    if not bad:
      return (
        "every stage's params are finite: the forward made it (an input or "
        "an activation overflowed, or the loss read an integer label "
        "outside the model's classes: optax's cross entropy is NaN there)"
      )
    return "non-finite values in " + "; ".join(
      f"stage {s}'s params (first: {path})" for s, path in bad.items()
    )

  def nonfinite_batch(self, unit):
    if not self.pipe.reads_batch:
      return None
    leaves = jax.tree_util.tree_leaves_with_path(self.task.batch_at(unit))
    paths = [jax.tree_util.keystr(p) for p, x in leaves if _nonfinite(x)]
    if not paths:
      return None
    return (
      f"step {unit + 1}'s batch holds non-finite values in {', '.join(paths)}"
    )

  def param_norms(self, state):
    return self.pipe.param_norms(state)

  def finish(self, workdir):
    if self.timeline is None:
      return {}, []
    return draw_timeline(self.pipe, self.timeline, self.config, workdir)


def _nonfinite(x) -> bool:
  """Whether a batch leaf is floating and holds a NaN or an infinity."""
  dtype = x.dtype if hasattr(x, "dtype") else np.asarray(x).dtype
  return jax.dtypes.issubdtype(dtype, np.inexact) and not bool(
    np.isfinite(np.asarray(x)).all()
  )


def _idle_processes(pipe) -> list[int]:
  """The processes whose devices hold no stage (``pipe``: a Pipeline, or
  a DynamicPipeline, whose pipeline in force has the devices)."""
  devices = getattr(pipe, "pipeline", pipe).devices
  used = {
    devices[i].process_index for group in pipe.plan.stage_devices for i in group
  }
  return sorted(set(range(jax.process_count())) - used)


def print_plan(pipe, learning_rate: float | None = None) -> None:
  """The stages, their devices, the schedule, the predicted memory
  (``learning_rate``: named in the note on a stream's rate)."""
  plan = pipe.plan
  print(
    f"{plan.num_stages} stages on devices "
    f"{_device_groups(plan.stage_devices)}, schedule "
    f"{pipe.schedule_name}, {pipe.num_microbatches} microbatches; "
    f"predicted speed-up {_predicted_speedup(pipe)}"
  )
  idle = _idle_processes(pipe)
  if idle:
    print(
      f"Note: process(es) {idle} hold none of the stages' devices and only "
      "wait for the run to end: start fewer processes, or more stages"
    )
  if pipe.schedule_choice is not None:
    print("\n".join(pipe.schedule_choice.table(pipe.device_names)))
  if pipe.granularity is not None:
    print(f"Nodes: {pipe.granularity.reason}.")
  if plan.indivisible_note:
    print(f"Warning: {plan.indivisible_note}.")
  m = pipe.num_microbatches
  if pipe.stream is not None and pipe.stream.step_every == 1 and m > 1:
    # (The stream's staleness, not a bug: README, "The pipeline".)
    print(
      f"Note: {pipe.schedule_name} steps each stage after every "
      f"microbatch ({m} steps per batch where 1f1b takes one): if this "
      f"learning rate{'' if learning_rate is None else f' ({learning_rate:g})'}"
      " was tuned for 1f1b, it may be too high here (about 1/"
      f"{m} of it is a start); --config.schedule.step_every={m} steps on "
      f"the mean of {m} instead."
    )
  if any(p.round_robin for p in pipe.placement):
    print(
      "Replicated stages take whole microbatches in turn: round-robin "
      "replicas (1F1B-RR)"
      + (
        ", PipeDream's warm-up per replica and rate r_s / r_0 per stage."
        if pipe.stream is not None
        else "."
      )
    )
  rows = pipe.replica_rows
  if rows:
    splits = ", ".join(f"stage {s}: {list(r)}" for s, r in rows.items())
    print(
      "Replicated stages split each microbatch by weight (examples per "
      f"replica, re-split by speed under re-partitioning): {splits}."
    )
  limit = pipe.memory_limit
  print(
    "Predicted peak memory per stage (its compiled programs' buffers): "
    + ", ".join(format_bytes(m.total) for m in pipe.memory)
    + (f" (limit {format_bytes(limit)})" if limit else "")
    + "."
  )


def write_run_files(workdir, config, pipe) -> None:
  """The plan beside the checkpoints; a resumed run whose fields changed
  since its checkpoint's config.json says which (and where that
  stretches its learning-rate schedule)."""
  path = os.path.join(workdir, "config.json")
  changed = config_cli.changed_fields(path, config)
  if changed:
    print(
      f"Resumed with changed fields (the earlier -> this run's): {changed}."
    )
    stretched = _stretched_schedule(path, config)
    if stretched:
      print(stretched)
  # (config.json itself is written with the attempt's first checkpoint:
  # the config of the latest checkpointed state, which a failed attempt
  # leaves as it was: config_cli.write_config_json.)
  with open(os.path.join(workdir, "plan.json"), "w") as f:
    f.write(plan_json(pipe) + "\n")


def _stretched_schedule(path, config) -> str:
  """A note where a resume changed the steps a decaying learning-rate
  schedule spans (its rate at the resumed step jumps); "" otherwise."""
  opt = config.optimizer
  if opt.schedule not in config_options.DECAYING_SCHEDULES:
    return ""
  saved = config_cli.saved_fields(path)
  was = saved.get("optimizer.schedule_steps") or saved.get("train.steps")
  if not isinstance(was, int) or was == config_options.schedule_steps(config):
    return ""
  return (
    f"Note: optimizer.schedule={opt.schedule!r} decays over "
    f"{config_options.schedule_steps(config)} steps now, {was} before: "
    "its learning rate from the resumed step on is another schedule's "
    f"(to keep the earlier one, pass --config.optimizer.schedule_steps="
    f"{was})."
  )


def plan_json(pipe) -> str:
  """The plan as JSON; with ``schedule="auto"``, its ``schedule_choice``
  too: the chosen schedule and the table it was chosen from (which
  ``jpipe.partition.Plan.from_json`` reads past)."""
  choice = getattr(pipe, "schedule_choice", None)
  if choice is None:
    return pipe.plan.to_json()
  data = json.loads(pipe.plan.to_json())
  data["schedule_choice"] = choice.to_dict(pipe.device_names)
  return json.dumps(data, indent=1)


def draw_timeline(pipe, profiled, config, workdir) -> tuple[dict, list[str]]:
  """``timeline.png`` and ``timeline.json`` (Perfetto) of the profiled
  step; the summary's ``stage_time_split`` and the lines naming them."""
  step, timeline = profiled
  busy = {}
  for action, start in timeline.start.items():
    busy[action.stage] = busy.get(action.stage, 0.0) + (
      timeline.end[action] - start
    )
  total = sum(busy.values())
  split = {s: busy[s] / total for s in sorted(busy)}
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
  lines = [
    f"Per-stage share of device time (one profiled step, {step}): "
    + ", ".join(f"stage {s} {100 * f:.0f}%" for s, f in split.items()),
    f"Timeline: {png} (Perfetto trace: {trace})",
  ]
  return {"stage_time_split": split, "timeline_png": png}, lines


def _predicted_speedup(pipe) -> str:
  """The plan's steady-state speed-up over one device and, for a
  synchronous schedule, the one its step reaches with this many
  microbatches (the schedule simulated at the plan's stage costs)."""
  plan = pipe.plan
  text = f"{plan.predicted_speedup:.2f} in steady state"
  schedule = getattr(pipe, "schedule", None)  # (Not a re-partitioner's.)
  if pipe.stream is not None or schedule is None:
    return text
  timeline = schedule_lib.simulate(
    schedule, plan.stage_forward_seconds, plan.stage_backward_seconds
  )
  if timeline.makespan <= 0:
    return text
  m = pipe.num_microbatches
  step = m * plan.sequential_seconds / timeline.makespan
  return (
    f"{text}, {step:.2f} at {m} microbatches a step (simulated bubble "
    f"{100 * timeline.bubble:.0f}%)"
  )


def _device_groups(stage_devices) -> list:
  """[0, 1, [2, 3]]: a stage's device, or its replica group."""
  return [ds[0] if len(ds) == 1 else list(ds) for ds in stage_devices]


def loss_scale_scalars(metrics) -> dict:
  """``{"train/loss_scale": the scale the step used}`` with a dynamic
  loss scale (else empty)."""
  if "loss_scale" not in metrics:
    return {}
  return {"train/loss_scale": float(metrics["loss_scale"])}
