"""Re-partitioning while training (DynPipe) in the training CLI.

``build`` makes the ``jpipe.dynamic.DynamicPipeline`` that
``config.dynamic`` describes; ``DynamicMode`` trains it in the loop: each
step reports what the pipeline measured and decided (a re-partition
prints a line starting with ``re-partition`` and goes to
``metrics.jsonl`` under "repartition", a weighted replica group's
re-split a line starting with ``re-split``, under "rebalance"; each
measured window logs the stage slots' slowdowns), a checkpoint records
the split in force (a resumed run continues on it), and the end draws
``dynamic.png`` (step time per window, the re-partitions marked).
"""

import os

import jax

from jpipe import dynamic
from jpipe.runtime import PipelineBuilder
from jpipe.train import config_options, data_parallel_mode
from jpipe.train.errors import UsageError
from jpipe.train.loop import Outcome, aux_floats
from jpipe.train.pipeline_mode import PipelineMode, loss_scale_scalars

_POLICY_FIELDS = ("policy", "window", "high", "low", "warmup_windows", "top_k")


def build(config, task, example_batch, tx, options):
  """The DynamicPipeline of ``config.dynamic`` (``options``: the other
  ``jpipe.Pipeline`` keyword arguments)."""
  dyn = config.dynamic
  interference = dynamic.Interference(
    dynamic.parse_inject(dyn.inject), simulated_seconds=dyn.simulated_ms / 1e3
  )
  try:
    predictor = (
      dynamic.SlowdownPredictor.load(dyn.predictor) if dyn.predictor else None
    )
    build = PipelineBuilder.of(
      task.loss_fn,
      task.params,
      example_batch,
      devices=jax.devices(),
      optimizer=tx,
      **options,
    )
    return dynamic.DynamicPipeline(
      build,
      # The policy's fields, named as config.dynamic names them.
      **{name: dyn[name] for name in _POLICY_FIELDS},
      horizon_steps=dyn.horizon_steps or None,
      interference=interference,
      predictor=predictor,
    )
  except ValueError as e:
    raise UsageError(f"config.dynamic: {e}") from e


class DynamicMode(PipelineMode):
  """A ``DynamicPipeline`` in the loop: one pipeline whose split moves."""

  # Its checkpoints are gathered (the split moves between saves).
  per_process_checkpoints = False

  def restore(self, state, saved, meta, say):
    state = self.pipe.load_state_dict(saved)
    self.pipe.start_at(int(meta["step"]))
    if "plan" in meta:  # The split in force.
      state = self.pipe.move_to(state, meta["plan"])
      say(f"Resuming on the split in force: {dynamic.describe(meta['plan'])}")
    return state

  def outcome(self, loss, done, metrics):
    """A measured window's slowdowns as scalars; a re-partition as an
    event and a line."""
    scalars, events, lines = loss_scale_scalars(metrics), {}, ()
    window = metrics.get("window")
    if window is not None:
      scalars |= {"dynamic/step_seconds": window.step_seconds} | {
        f"dynamic/slowdown/{s}": x for s, x in enumerate(window.sigma)
      }
    record = metrics.get("repartition")
    if record is not None:
      events, lines = {"repartition": record}, (line(done, record),)
    balanced = metrics.get("rebalance")
    if balanced:
      events = {**events, "rebalance": balanced}
      lines = (*lines, *(rebalance_line(done, r) for r in balanced))
    return Outcome(
      loss,
      self.examples,
      scalars,
      events,
      lines,
      metrics=aux_floats(metrics),
      skipped=bool(metrics.get("step_skipped", False)),
    )

  def checkpoint_meta(self, done):
    return {"plan": list(self.pipe.boundaries)}

  def finish(self, workdir):
    summary, lines = super().finish(workdir)
    summary["repartitions"] = list(self.pipe.history)
    summary["rebalances"] = list(self.pipe.rebalances)
    if self.pipe.windows:
      summary["dynamic_png"] = draw(self.pipe, workdir)
      lines.append(f"Re-partitioning: {summary['dynamic_png']}")
    return summary, lines


def line(step, record) -> str:
  """The printed line of a re-partition."""
  sigma = ", ".join(f"{x:.2f}" for x in record["sigma"])
  return (
    f"re-partition at step {step}: {dynamic.describe(record['old'])} -> "
    f"{dynamic.describe(record['new'])} (slowdowns {sigma}; s per step "
    f"on the old split: measured {record['measured_seconds']:.4f}, "
    f"simulated {record['predicted_old_seconds']:.4f} -- the schedule's "
    "compute alone --; on the new: simulated "
    f"{record['predicted_new_seconds']:.4f}; switch "
    f"{record['switch_seconds']:.3f} s"
    f"{', new pipeline' if record['compiled'] else ''})"
  )


def rebalance_line(step, record) -> str:
  """The printed line of a weighted group's re-split."""
  speeds = ", ".join(f"{x:.0f}" for x in record["examples_per_second"])
  return (
    f"re-split at step {step}: stage {record['stage']}'s replicas take "
    f"{record['old']} -> {record['new']} examples of each microbatch "
    f"(measured {speeds} examples/s; predicted "
    f"{record['predicted_gain']:.2f}x faster)"
  )


def draw(pipe, workdir) -> str:
  """``WORKDIR/dynamic.png``: each window's step seconds and slowdowns,
  re-partitions marked. Returns its path."""
  import matplotlib

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  steps = [w.step for w in pipe.windows]
  fig, (top, bottom) = plt.subplots(2, 1, figsize=(8, 6), sharex=True)
  top.plot(steps, [w.step_seconds for w in pipe.windows], marker="o")
  top.set_ylabel("measured step seconds")
  for s in range(pipe.plan.num_stages):
    bottom.plot(steps, [w.sigma[s] for w in pipe.windows], label=f"slot {s}")
  bottom.set_ylabel("slowdown (vs reference)")
  bottom.set_xlabel("step")
  bottom.legend()
  for record in pipe.history:
    for ax in (top, bottom):
      ax.axvline(record["step"], color="red", ls="--", lw=0.8)
    top.annotate(
      dynamic.describe(record["new"]),
      (record["step"], top.get_ylim()[1]),
      fontsize=7,
      rotation=90,
      va="top",
    )
  fig.suptitle(f"re-partitioning ({pipe.policy.name}), red: switches")
  fig.tight_layout()
  path = os.path.join(workdir, "dynamic.png")
  fig.savefig(path, dpi=100)
  plt.close(fig)
  return path


def check_config(config, need, problems) -> None:
  """DynPipe's options (``config.dynamic``), for ``config_check``:
  ``need(ok, key, message)`` records a problem with a key when not ok,
  ``need.one_of(key, choices)`` a value not among the choices;
  ``problems`` takes the conversions' own errors."""
  dyn = config.dynamic
  need.one_of("dynamic.policy", dynamic.POLICIES)
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
  _check_run(config, need, inject)


def _check_run(config, need, inject) -> None:
  """What an enabled re-partitioning run needs of the rest of the config."""
  dyn = config.dynamic
  need(
    not data_parallel_mode.uses_data_parallel(config),
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
    config.schedule.name not in ("interleaved", "interleaved_zb")
    and not config_options.v_shaped(config),
    "schedule.name",
    f"re-partitioning needs one stage per device, not {config.schedule.name!r}",
  )
  need(
    config.schedule.name != "auto",
    "schedule.name",
    "'auto' chooses a schedule for one plan and re-partitioning changes "
    "the plan: name a schedule (auto's choice for the first plan is in "
    "a run without dynamic.enabled's plan.json)",
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
