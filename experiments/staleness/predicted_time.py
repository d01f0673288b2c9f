"""The simulator's time per step of a training config's pipeline, from
per-action costs measured one at a time (``time_to_accuracy`` and
``time_to_target`` predict wall time with it)."""

import ml_collections

from experiments.runtime import stage_costs
from jpipe import staleness
from jpipe.train import train_lib


def isolated_costs(config, task, prediction_delay=0):
  """Per-stage forward, backward and step seconds of the variant, each
  action timed alone (``experiments/runtime/stage_costs.py``) on a
  ``seq`` twin of its pipeline (same model, partition, recomputation);
  with ``prediction_delay``, each forward is charged one prediction."""
  twin = ml_collections.ConfigDict(config.to_dict())
  twin.schedule.name = "seq"
  twin.schedule.step_every = 1
  twin.staleness.stashing = False
  twin.staleness.prediction = ""
  twin.staleness.gap_aware = ""
  # (A stage's own optimizer -- NAdamW for delay_nesterov -- costs about
  # its base optimizer's step; PipeMare's scale is one multiply.)
  twin.staleness.pipemare_anneal_steps = 0
  twin.staleness.delay_nesterov = ""
  twin.pipeline.fuse_last_stage = False
  lr = train_lib.learning_rate(twin)
  tx = train_lib.build_optimizer(twin, lr)
  pipe = train_lib.build_pipeline(twin, task, task.batch_at(0), tx, lr)
  state = pipe.init(task.params, task.model_state)
  predictor = staleness.replay_predictor(tx) if prediction_delay else None
  return stage_costs.isolated_stage_costs(
    pipe,
    state,
    [task.batch_at(i) for i in range(6)],
    predictor=predictor,
    delay=prediction_delay,
  )


def seconds_per_step(config, costs, calls):
  """Predicted seconds per ``step`` call: the config's schedule simulated
  over ``calls`` calls with per-stage costs (a stream: its warm-up paid
  once per evaluation interval, where the loop flushes)."""
  timeline = stage_costs.simulate_calls(
    config.schedule.name,
    len(costs["F"]),
    config.pipeline.num_microbatches,
    calls,
    costs,
    config.schedule.step_every,
  )
  return timeline.makespan / calls
