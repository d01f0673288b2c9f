"""The training loop of several pipelines in data parallel (SD-Pipe).

``train_and_evaluate`` hands over here when ``config.data_parallel`` asks
for more than one pipeline (or for simulated delays). Training runs in
epochs of ``data_parallel.epoch_batches`` batches per pipeline on average
(``jpipe.parallel.DataParallelPipelines.run_epoch``: fast pipelines run
more, the epoch ends without a barrier); after each, the consensus model
(the replicas' mean) is evaluated, a line is printed and logged, and a
checkpoint of every replica is written. The run's "step" counts batches
per pipeline on average: ``train.steps`` of them in all.

Across processes (``python -m jpipe.launch``) each process runs its share
of the pipelines and reads only their batches; process 0 prints, logs
and evaluates; checkpoints hold every replica (gathered) and resume with
another process count. A SIGTERM or SIGINT ends the epoch under way,
checkpoints and exits with 128 + the signal's number.
"""

import math
import time

import jax
import numpy as np

from jpipe import parallel
from jpipe.train import stopping
from jpipe.train.errors import TrainingDiverged, UsageError
from jpipe.train.metric_log import MetricLog
from jpipe.train.watchdog import Watchdog


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
      task.loss_fn,
      task.params,
      example,
      pipelines=dp.pipelines,
      sync=dp.sync,
      batches_per_epoch=epoch_batches(config) * steps_per_call,
      hetero=hetero,
      ssp_bound=dp.ssp_bound,
      gossip_seed=dp.gossip_seed,
      hetpipe_every=dp.hetpipe_every,
      **options,
    )
  except ValueError as e:
    raise UsageError(f"config.data_parallel: {e}") from e


def epoch_batches(config) -> int:
  return config.data_parallel.epoch_batches or config.train.eval_every


def train(config, workdir, task, dp, checkpoints, saved_step, fingerprint, say):
  """Runs the epochs; returns the closing summary."""
  per_epoch = epoch_batches(config)
  epochs = math.ceil(config.train.steps / per_epoch)
  states = dp.init(task.params, task.model_state)
  start, drawn = 0, 0
  if saved_step is not None:
    template = jax.tree.map(np.asarray, dp.state_dict(states))
    saved, meta = checkpoints.restore(template, fingerprint)
    states = dp.load_state_dict(saved)
    start, drawn = int(meta["epoch"]), int(meta["data_position"])
    say(f"Resuming from epoch {start} ({checkpoints.directory}).")
  p = dp.num_pipelines
  say(
    f"{p} pipelines x {dp.num_stages} stages, sync {dp.sync}; stage "
    f"devices per pipeline {[ds for ds in dp.plan.stage_devices]} "
    f"(+{dp.devices_per_pipeline} per pipeline); {epochs} epochs of "
    f"{per_epoch} batches per pipeline"
  )
  say("Compiled averaging programs for", dp.compile_groups(states), "groups.")
  main = jax.process_index() == 0
  log = MetricLog(workdir, resume_step=start * per_epoch) if main else None
  evaluation, seconds, examples = None, 0.0, 0
  bs = config.data.batch_size
  # Every process issues the same cross-process operations in one order
  # (jpipe.distributed states the rule): the epoch's averaging, the
  # consensus gather, the checkpoint's, the stop agreement.
  with (
    stopping.StopRequest() as stop,
    Watchdog(config.train.hang_timeout) as watchdog,
  ):
    for epoch in range(start, epochs):
      position = drawn

      def batch_at(rank, i, position=position):
        # Disjoint shards of the stream: pipeline p takes every P-th batch.
        return task.batch_at(position + i * p + rank)

      t0 = time.perf_counter()
      states, report = dp.run_epoch(states, batch_at)
      took = time.perf_counter() - t0
      seconds += took
      watchdog.beat(f"after epoch {epoch + 1}", took if epoch > start else None)
      examples += bs * sum(report.batches)
      drawn += p * max(report.batches)
      done = (epoch + 1) * per_epoch
      losses = [np.mean(ls) for ls in report.losses if ls]
      if not np.all(np.isfinite(losses)):
        raise TrainingDiverged(
          f"loss is non-finite in epoch {epoch + 1} (per pipeline: "
          f"{[float(x) for x in losses]}). Lower "
          "config.optimizer.learning_rate (now "
          f"{config.optimizer.learning_rate:g}), or resume from an earlier "
          "checkpoint"
        )
      # Every process takes part in the mean; process 0 evaluates it.
      consensus = dp.consensus_params(states)
      if main:
        evaluation = task.evaluate(consensus, _model_state(dp, states))
      scalars = {
        "train/loss": float(np.mean(losses)),
        "train/epoch_seconds": report.seconds,
        "sync/mean_group_size": float(np.nanmean(report.mean_group_size)),
        "sync/batches_min": min(report.batches),
        "sync/batches_max": max(report.batches),
      }
      if main:
        scalars |= {f"eval/{k}": v for k, v in evaluation.items()}
        log.write(done, **scalars)
        say(
          f"epoch {epoch + 1}/{epochs} (step {done}): loss "
          f"{scalars['train/loss']:.4f}, {report.seconds:.2f} s, batches "
          f"per pipeline {report.batches}, mean group size "
          f"{scalars['sync/mean_group_size']:.2f}; "
          + ", ".join(f"{k} {v:.4f}" for k, v in evaluation.items())
        )
      checkpoints.save(
        done,
        jax.tree.map(np.asarray, dp.state_dict(states)),
        {
          "step": done,
          "epoch": epoch + 1,
          "data_position": drawn,
          "fingerprint": fingerprint,
        },
      )
      watchdog.beat(f"after the checkpoint of epoch {epoch + 1}")
      requested = stopping.agreed(stop.signal)
      if requested and epoch + 1 < epochs:
        code = stopping.exit_code(requested)
        say(
          f"{requested}: saved step {done} (epoch {epoch + 1}) to "
          f"{checkpoints.directory}; exiting with status {code} (not "
          "finished: run the same command to resume)."
        )
        _close(log, checkpoints, dp)
        raise SystemExit(code)
  _close(log, checkpoints, dp)
  summary = {
    "pipelines": p,
    "sync": dp.sync,
    "examples_per_second": examples / seconds if seconds else None,
    "eval": evaluation,
  }
  say(f"Done: {summary}")
  return summary


def _close(log, checkpoints, dp):
  if log is not None:
    log.close()
  checkpoints.close()
  dp.close()


def _model_state(dp, states):
  """This process's first pipeline's model state (pipeline 0's on
  process 0; BatchNorm statistics are not averaged)."""
  return dp.pipelines[0].gather_model_state(states[0])
