"""An evaluation-only run (``--config.train.steps=0``; FTPipe's eval mode):
the workdir's latest checkpoint, or ``config.init_from``'s params, or the
model's initial ones, evaluated once through the run's mode, printed and
logged (``eval/*`` at that checkpoint's step in ``metrics.jsonl`` and
TensorBoard); nothing trained, no checkpoint written.
"""

import jax

from jpipe.train import loop
from jpipe.train.errors import UsageError
from jpipe.train.metric_log import MetricLog


def evaluate(mode, task, run, checkpoints, *, workdir: str, source: str, say):
  """Evaluates ``mode``'s state: the latest checkpoint's where
  ``checkpoints`` has one (else ``task``'s params, described by
  ``source``). Returns the closing summary (process 0's)."""
  if task.evaluate is None and task.evaluation is None:
    raise UsageError(
      "config.train.steps=0 evaluates, but this task has no evaluation: "
      "give it eval data (or an evaluate function), or train with "
      "train.steps >= 1"
    )
  state, step = mode.init(task), 0
  if checkpoints.latest_step() is not None:
    state, step, _ = loop.restore(
      mode, state, checkpoints, run.fingerprint, say
    )
    source = f"the checkpoint of step {step}"
  evaluation = mode.evaluate(state, task)
  mode.close()
  checkpoints.close()
  if jax.process_index() != 0:
    return {"eval": None, "examples_per_second": None, "finished": True}
  log = MetricLog(workdir, resume_step=step)
  log.write(step, **{f"eval/{k}": v for k, v in evaluation.items()})
  log.close()
  say(f"Evaluation of {source}: {loop.format_evaluation(evaluation)}.")
  return {"eval": evaluation, "examples_per_second": None, "finished": True}
