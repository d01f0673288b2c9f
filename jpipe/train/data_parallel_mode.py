"""Several pipelines in data parallel (SD-Pipe) in the training loop.

``train_and_evaluate`` trains a ``DataParallelMode`` when
``config.data_parallel`` asks for more than one pipeline (or for
simulated delays). A unit of the loop is an epoch of
``data_parallel.epoch_batches`` batches per pipeline on average
(``jpipe.parallel.DataParallelPipelines.run_epoch``: fast pipelines run
more, the epoch ends without a barrier); after each, the consensus model
(the replicas' mean, averaged stage by stage on the devices) is evaluated
forward through the first pipeline's stages, a line is printed and
logged, and a checkpoint of every replica is written. The run's "step" counts batches
per pipeline on average: ``train.steps`` of them in all.

Across processes (``python -m jpipe.launch``) each process runs its share
of the pipelines and reads only their batches; process 0 prints and
logs; each evaluates through its first pipeline; checkpoints hold every replica (gathered) and resume with
another process count. A SIGTERM or SIGINT ends the epoch under way
early (each pipeline stops after its step in progress and drains: a
preemption notice need not outlast an epoch), checkpoints at the steps
it trained and exits with 128 + the signal's number; the resumed run
trains the rest of that epoch first, so epochs end at the same steps.
"""

import math

import jax
import numpy as np

from jpipe import parallel
from jpipe.runtime import PipelineBuilder
from jpipe.train import evaluation as evaluation_lib
from jpipe.train import pipeline_mode
from jpipe.train.errors import UsageError
from jpipe.train.loop import Cadence, Mode, Outcome


def uses_data_parallel(config) -> bool:
  """Whether the config asks for this loop."""
  dp = config.data_parallel
  return dp.pipelines > 1 or dp.hetero > 0 or dp.simulated_ms > 0


def build(config, task, example, options, steps_per_call):
  """The ``DataParallelPipelines`` the config describes (``options``:
  ``jpipe.Pipeline``'s keyword arguments)."""
  dp = config.data_parallel
  hetero = parallel.Heterogeneity(
    hetero=dp.hetero,
    slowdown=parallel.parse_slowdown(dp.slowdown),
    base_seconds=dp.simulated_ms / 1000.0,
    seed=config.seed,
  )
  try:
    return parallel.DataParallelPipelines(
      PipelineBuilder.of(task.loss_fn, task.params, example, **options),
      pipelines=dp.pipelines,
      sync=dp.sync,
      placement=dp.placement,
      batches_per_epoch=epoch_batches(config) * steps_per_call,
      hetero=hetero,
      ssp_bound=dp.ssp_bound,
      gossip_seed=dp.gossip_seed,
      hetpipe_every=dp.hetpipe_every,
    )
  except ValueError as e:
    raise UsageError(f"config.data_parallel: {e}") from e


def epoch_batches(config) -> int:
  return config.data_parallel.epoch_batches or config.train.eval_every


class DataParallelMode(Mode):
  """Several pipelines in data parallel (``dp``) in the loop: a unit is
  an epoch of ``epoch_batches`` batches per pipeline on average, after
  which the consensus model is evaluated and every replica saved."""

  def __init__(self, dp, task, config):
    self.dp, self.task, self.config = dp, task, config
    self.unit_steps = epoch_batches(config)
    self.drawn = 0  # Batches of the stream handed out so far.
    # Steps left of an epoch a stop request cut short (a resumed run's
    # first), else None.
    self.left = None
    self.stop_requested = None  # (``watch_stop``.)

  def cadence(self, config):
    return Cadence(self.unit_steps, self.unit_steps, self.unit_steps)

  def init(self, task):
    return self.dp.init(task.params, task.model_state)

  def restore(self, states, saved, meta, say):
    self.drawn = int(meta["data_position"])
    done = int(meta["step"]) % self.unit_steps
    self.left = self.unit_steps - done if done else None
    return self.dp.load_state_dict(saved)

  def watch_stop(self, stop):
    self.stop_requested = lambda: stop.signal

  def resumed_at(self, step):
    return self._epochs(step)

  def where(self, done):
    return f"step {done} ({self._epochs(done)})"

  def _epochs(self, done) -> str:
    """Epochs trained after ``done`` steps (and the steps of one cut
    short)."""
    epochs, steps = divmod(done, self.unit_steps)
    return f"epoch {epochs}" + (f" + {steps} steps" if steps else "")

  def progress(self, done, steps):
    epochs = math.ceil(steps / self.unit_steps)
    return f"epoch {done // self.unit_steps}/{epochs} (step {done})"

  def announce(self, states, workdir, main, say):
    dp = self.dp
    epochs = math.ceil(self.config.train.steps / self.unit_steps)
    ids = dp.stage_device_ids
    shown = "; ".join(f"{p}: {list(ids[p])}" for p in sorted(ids)[:3])
    more = f"; ... {dp.num_pipelines - 1}: {list(ids[max(ids)])}"
    say(
      f"{dp.num_pipelines} pipelines x {dp.num_stages} stages, sync "
      f"{dp.sync}; stage devices by pipeline {shown}"
      f"{more if dp.num_pipelines > 3 else ''}; {epochs} epochs of "
      f"{self.unit_steps} batches per pipeline"
    )
    if main:  # config.json and pipeline 0's plan.json, as a pipeline's run.
      pipeline_mode.write_run_files(workdir, self.config, dp.all_pipelines[0])
    # A collective: every process compiles its groups' programs.
    say("Compiled averaging programs for", dp.compile_groups(states), "groups.")

  def advance(self, states, unit):
    p, position = self.dp.num_pipelines, self.drawn

    def batch_at(rank, i):
      # Disjoint shards of the stream: pipeline p takes every P-th batch.
      return self.task.batch_at(position + i * p + rank)

    left, self.left = self.left or self.unit_steps, None
    per_step = self.dp.batches_per_epoch // self.unit_steps  # (Async: m.)
    states, report = self.dp.run_epoch(
      states,
      batch_at,
      batches=left * per_step if left < self.unit_steps else None,
      stop_requested=self.stop_requested,
    )
    self.drawn += p * max(report.batches)
    self.losses = [float(np.mean(ls)) for ls in report.losses if ls]
    group = float(np.nanmean(report.mean_group_size))
    scalars = {
      "train/epoch_seconds": report.seconds,
      "sync/mean_group_size": group,
      "sync/batches_min": min(report.batches),
      "sync/batches_max": max(report.batches),
    }
    note = (
      f"{report.seconds:.2f} s, batches per pipeline {report.batches}, "
      f"mean group size {group:.2f}"
    )
    examples = self.config.data.batch_size * sum(report.batches)
    loss = float(np.mean(self.losses))
    steps, lines = None, ()  # A whole epoch (or its rest).
    if report.cut_short:
      # The steps it trained: batches per pipeline on average.
      steps = min(left, max(1, round(sum(report.batches) / p)))
      if steps < left:
        lines = (
          f"epoch {unit + 1} cut short by a stop request after {steps} of "
          f"{left} steps (batches per pipeline {report.batches}); a "
          "resumed run trains the rest of it first.",
        )
    return states, Outcome(
      loss,
      examples,
      scalars,
      note=note,
      metrics=self._aux_means(report),
      lines=lines,
      steps=None if steps == left else steps,
      stop_requested=report.cut_short,
    )

  def _aux_means(self, report) -> dict:
    """The loss's own metrics (``Task.has_aux``): each pipeline's mean
    over its calls, averaged over the pipelines that ran."""
    treedef = self.dp.pipelines[0].loss_outputs.aux_treedef
    ran = [a for a in report.aux if a]
    if treedef is None or not ran:
      return {}
    flat = [float(np.mean(leaf)) for leaf in zip(*ran, strict=True)]
    return jax.tree.unflatten(treedef, flat)

  def evaluate(self, states, task):
    if task.evaluation is None:  # The user's evaluate: on whole params.
      return super().evaluate(states, task)
    # The replicas' mean on pipeline 0's stages, evaluated forward
    # through them; every process gets the metrics.
    return self.dp.evaluate_consensus(
      states,
      lambda pipe, consensus: evaluation_lib.through_pipeline(
        pipe, consensus, task.evaluation
      ),
    )

  def evaluation_inputs(self, states):
    # Every process takes part in the mean; process 0 evaluates it with
    # pipeline 0's model state (BatchNorm statistics are not averaged).
    consensus = self.dp.consensus_params(states)
    return consensus, self.dp.first_model_state(states)

  def state_dict(self, states):
    return self.dp.state_dict(states)

  def checkpoint_meta(self, done):
    return {"epoch": done // self.unit_steps, "data_position": self.drawn}

  def nonfinite_cause(self, states, outcome):
    return f"per pipeline {self.losses}"

  def finish(self, workdir):
    return {"pipelines": self.dp.num_pipelines, "sync": self.dp.sync}, []

  def close(self):
    self.dp.close()


def check_config(config, need, problems) -> None:
  """The data-parallel options (``config.data_parallel``), for
  ``config_check``: ``need(ok, key, message)`` records a problem with a
  key when not ok; ``problems`` takes the conversions' own errors."""
  dp = config.data_parallel
  p = dp.pipelines
  need(p >= 1, "data_parallel.pipelines", "must be >= 1")
  need.one_of("data_parallel.sync", parallel.SYNC_POLICIES)
  need(
    p > 1 or dp.sync == "allreduce",
    "data_parallel.sync",
    f"{dp.sync!r} synchronises several pipelines: set "
    "data_parallel.pipelines >= 2 (or sync='allreduce')",
  )
  need.one_of("data_parallel.placement", parallel.PLACEMENTS)
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
