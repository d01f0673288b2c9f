"""Held-out evaluation as the pipeline runs it: per-batch sums, then
metrics.

An ``Evaluation`` is what a ``Task`` measures: held-out batches, a
function of ``(params, [model_state,] batch)`` returning sums over the
batch's examples, and how the totals become metrics. Sums, because they
add up over microbatches and batches whatever their sizes: the last
batch is padded to full size with examples of weight 0
(``padded_batches``), and every metric is a ratio of totals (accuracy =
correct / count, loss = summed token loss / tokens).

``through_pipeline`` runs it forward through a pipeline's stages
(``Pipeline.evaluate(state, batch, sums_fn)``: each stage on its own
devices, nothing gathered -- what the CLI does); ``on_one_device`` on
whole params (a model that fits one device; the data-parallel mode
evaluates its averaged params so).
"""

import dataclasses
import math
from collections.abc import Callable, Iterable

import jax
import numpy as np


@dataclasses.dataclass(frozen=True)
class Evaluation:
  """Held-out evaluation, runnable through a pipeline's stages.

  Attributes:
    sums_fn: ``sums_fn(params, batch)``, or with model state
      ``sums_fn(params, model_state, batch)``: ``{name: a scalar, the sum
      over the batch's examples}`` (weighted by the batch's "weight" leaf
      where it pads). Through a pipeline it is traced on one microbatch
      and cut by the pipeline's plan: call the model as the loss does
      (in inference mode), and its modules run on the stages that train
      them.
    batches: ``() -> the held-out batches`` (pytrees of host arrays),
      each of the training batch's size so they split into the same
      microbatches.
    metrics: ``{name: total over all batches} -> {metric: float}``.
  """

  sums_fn: Callable
  batches: Callable[[], Iterable]
  metrics: Callable[[dict], dict]

  def on_one_device(self, params, model_state) -> dict:
    """The metrics at ``params`` (whole, on one device)."""
    sums = jax.jit(self.sums_fn)
    state = () if model_state is None else (model_state,)
    totals = _add(sums(params, *state, batch) for batch in self.batches())
    return self.metrics(totals)


def through_pipeline(pipe, state, evaluation: Evaluation) -> dict:
  """The metrics at the pipeline state's params, every batch forward
  through the stages (every process calls it; each gets the metrics)."""
  totals = _add(
    pipe.evaluate(state, batch, evaluation.sums_fn)
    for batch in evaluation.batches()
  )
  return evaluation.metrics(totals)


def _add(sums: Iterable[dict]) -> dict:
  """``{name: float total}`` of per-batch sums (float64 on the host:
  counts stay exact)."""
  totals = {}
  for batch_sums in sums:
    for name, value in batch_sums.items():
      totals[name] = totals.get(name, 0.0) + float(value)
  if not totals:
    raise ValueError("the evaluation has no batches")
  return totals


def padded_batches(arrays: dict, batch_size: int) -> list[dict]:
  """``arrays`` (equal leading sizes) cut into batches of ``batch_size``
  with a "weight" leaf: 1 for an example, 0 for the last batch's padding
  (copies of its first example)."""
  n = len(next(iter(arrays.values())))
  out = []
  for start in range(0, n, batch_size):
    rows = np.arange(start, start + batch_size)
    real = rows < n
    rows = np.where(real, rows, start)
    batch = {k: np.asarray(v)[rows] for k, v in arrays.items()}
    batch["weight"] = real.astype(np.float32)
    out.append(batch)
  return out


def held_out(
  sums_fn: Callable, arrays: dict, batch_size: int, metrics: Callable
) -> Evaluation:
  """The Evaluation of ``sums_fn`` over ``arrays`` (equal leading sizes),
  in ``padded_batches`` of ``batch_size``."""
  batches = padded_batches(arrays, batch_size)
  return Evaluation(sums_fn, lambda: batches, metrics)


def accuracy(totals: dict) -> dict:
  """``{"accuracy"}`` of totals "correct" and "count"."""
  return {"accuracy": totals["correct"] / totals["count"]}


def token_loss(totals: dict) -> dict:
  """``{"loss", "perplexity"}`` of totals "loss" (nats summed over
  tokens) and "tokens"."""
  loss = totals["loss"] / totals["tokens"]
  return {"loss": loss, "perplexity": math.exp(loss)}
