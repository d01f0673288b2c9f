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

An evaluation may also generate: its ``Generation`` continues held-out
prompts greedily (through the stages by ``Pipeline.generate``, each
layer's key/value cache on its stage; on one device by the same decoding
functions) and scores the generated tokens, e.g. SQuAD's exact match
and F1, accuracy of label words, BLEU (``text_metrics``), in one
process or across processes alike.
"""

import dataclasses
import math
from collections.abc import Callable, Iterable

import jax
import jax.numpy as jnp
import numpy as np


@dataclasses.dataclass(frozen=True)
class Generation:
  """Held-out prompts continued greedily, then scored.

  Attributes:
    prompts: int [N, P]: decoder-only prompts, or an encoder-decoder's
      sources (``prefill_fn`` given).
    decode_fn, prefill_fn, empty_cache, eos_id, start_id: as
      ``Pipeline.generate`` takes them (``prefill_fn`` None: decoder-
      only).
    max_new_tokens: tokens generated per prompt at most.
    batch_size: prompts per ``generate`` call (the training batch's
      size, so they split into the pipeline's microbatches).
    score: ``generated int [N, n] -> {metric: float}``.
  """

  prompts: np.ndarray
  decode_fn: Callable
  prefill_fn: Callable | None
  empty_cache: Callable
  eos_id: int | None
  start_id: int
  max_new_tokens: int
  batch_size: int
  score: Callable[[np.ndarray], dict]

  def padded(self) -> list[np.ndarray]:
    """The prompts in batches of ``batch_size`` (the last padded with
    copies of its first prompt)."""
    return [
      b["p"] for b in padded_batches({"p": self.prompts}, self.batch_size)
    ]

  def scored(self, generated: list) -> dict:
    """``score`` of the batches' generated tokens (padding dropped; rows
    ended early filled with ``eos_id``)."""
    width = max(np.shape(g)[1] for g in generated)
    rows = [
      np.pad(
        np.asarray(g),
        ((0, 0), (0, width - np.shape(g)[1])),
        constant_values=self.eos_id or 0,
      )
      for g in generated
    ]
    return self.score(np.concatenate(rows)[: len(self.prompts)])

  def on_one_device(self, params) -> dict:
    """The scores of a greedy loop with the cache on one device."""
    prefill = jax.jit(self.prefill_fn or self.decode_fn)
    step = jax.jit(self.decode_fn)
    out = []
    for prompts in self.padded():
      b = len(prompts)
      first = prompts if self.prefill_fn is None else None
      if first is None:
        first = np.full((b, 1), self.start_id, np.int32)
      batch = {
        "tokens": jnp.asarray(first, jnp.int32),
        "index": jnp.zeros(b, jnp.int32),
        "cache": self.empty_cache(b, first.shape[1] + self.max_new_tokens - 1),
      }
      if self.prefill_fn is not None:
        batch["inputs"] = jnp.asarray(prompts)
      else:  # Prompts of one length: no left padding.
        batch["pad"] = jnp.zeros(b, jnp.int32)
      logits, batch["cache"] = prefill(params, batch)
      tokens = [jnp.argmax(logits, -1).astype(jnp.int32)]
      for t in range(1, self.max_new_tokens):
        batch["tokens"] = tokens[-1][:, None]
        batch["index"] = jnp.full(b, first.shape[1] + t - 1, jnp.int32)
        logits, batch["cache"] = step(params, batch)
        tokens.append(jnp.argmax(logits, -1).astype(jnp.int32))
      out.append(_after_end(np.stack(tokens, axis=1), self.eos_id))
    return self.scored(out)

  def through_pipeline(self, pipe, state) -> dict:
    """The scores of ``Pipeline.generate`` (nothing gathered; across
    processes every process calls it and gets them)."""
    out = [
      pipe.generate(
        state,
        prompts,
        self.decode_fn,
        self.empty_cache,
        max_new_tokens=self.max_new_tokens,
        eos_id=self.eos_id,
        prefill_fn=self.prefill_fn,
        start_id=self.start_id,
      )
      for prompts in self.padded()
    ]
    return self.scored(out)


def _after_end(rows: np.ndarray, eos_id) -> np.ndarray:
  """Rows with ``eos_id`` after each one's first ``eos_id``."""
  if eos_id is None:
    return rows
  ended = np.cumsum(rows == eos_id, axis=1) > 0
  after = np.pad(ended[:, :-1], ((0, 0), (1, 0)))
  return np.where(after, eos_id, rows)


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
    generation: held-out generation and its scores (``Generation``),
      added to the metrics; None: none.
  """

  sums_fn: Callable
  batches: Callable[[], Iterable]
  metrics: Callable[[dict], dict]
  generation: Generation | None = None

  def on_one_device(self, params, model_state) -> dict:
    """The metrics at ``params`` (whole, on one device)."""
    sums = jax.jit(self.sums_fn)
    state = () if model_state is None else (model_state,)
    totals = _add(sums(params, *state, batch) for batch in self.batches())
    metrics = self.metrics(totals)
    if self.generation is not None:
      metrics |= self.generation.on_one_device(params)
    return metrics


def through_pipeline(pipe, state, evaluation: Evaluation) -> dict:
  """The metrics at the pipeline state's params, every batch forward
  through the stages (every process calls it; each gets the metrics)."""
  totals = _add(
    pipe.evaluate(state, batch, evaluation.sums_fn)
    for batch in evaluation.batches()
  )
  metrics = evaluation.metrics(totals)
  if evaluation.generation is not None:
    metrics |= evaluation.generation.through_pipeline(pipe, state)
  return metrics


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
  sums_fn: Callable,
  arrays: dict,
  batch_size: int,
  metrics: Callable,
  generation: Generation | None = None,
) -> Evaluation:
  """The Evaluation of ``sums_fn`` over ``arrays`` (equal leading sizes),
  in ``padded_batches`` of ``batch_size`` (and ``generation``)."""
  batches = padded_batches(arrays, batch_size)
  return Evaluation(sums_fn, lambda: batches, metrics, generation)


def accuracy(totals: dict) -> dict:
  """``{"accuracy"}`` of totals "correct" and "count"."""
  return {"accuracy": totals["correct"] / totals["count"]}


def token_loss(totals: dict) -> dict:
  """``{"loss", "perplexity", "tokens"}`` of totals "loss" (nats summed
  over tokens) and "tokens" (the tokens scored)."""
  loss = totals["loss"] / totals["tokens"]
  return {
    "loss": loss,
    "perplexity": math.exp(loss),
    "tokens": int(totals["tokens"]),
  }
