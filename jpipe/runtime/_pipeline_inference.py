"""``Pipeline``'s forward-only calls: evaluate, predict and generate,
through the stages at the state's params (``execute/forward_only.py``,
``execute/generation.py`` run them)."""

from collections.abc import Callable
from typing import Any

import jax

from jpipe.runtime._pipeline_state import PipelineState
from jpipe.runtime.build.user_mesh import every_process
from jpipe.runtime.execute import forward_only as _forward_only
from jpipe.runtime.execute import generation as _generation


class PipelineInferenceMethods:
  """A base of ``Pipeline``: what runs forward through the stages
  without training, given the built pipeline's parts."""

  @every_process
  def evaluate(
    self,
    state: PipelineState,
    batch: Any,
    metrics_fn: Callable[..., Any] | None = None,
  ) -> Any:
    """The loss, or ``metrics_fn``'s metrics, of ``batch`` at the state's
    params, forward through the stages: each stage runs its forward on
    its own devices and passes its activations on, as in training, and
    nothing is gathered to one device (a model too big for one device
    evaluates so). Nothing is saved for a backward and the state is not
    changed (model state, e.g. BatchNorm statistics, is read, not
    updated; a round-robin replica group's is its replica 0's, on every
    replica, as PipeDream evaluates from each stage's first rank).

    ``metrics_fn(params, batch)`` (with model state ``metrics_fn(params,
    model_state, batch)``) returns a pytree of per-microbatch sums, e.g.
    ``{"correct": ..., "count": ...}``. It is traced on one microbatch
    and cut by the pipeline's plan: each of its module calls runs on the
    stage that runs the same module in ``loss_fn`` (call the model as
    ``loss_fn`` does, in inference mode if you like; equations outside
    modules join the call before them). Traced once per function and
    per-example shapes.

    Mid-stream (asynchronous schedules between flushes) each stage's
    params are its newest: the stages are then at different steps; flush
    first to evaluate the params of one step. Across processes every
    process calls it with the same batch size (as ``step``), a multiple
    of the microbatch size: sums and means would count padding (pad a
    last batch yourself with a weight leaf, 0 on padding, that
    ``metrics_fn`` multiplies in).

    Returns:
      Without ``metrics_fn``: ``{"loss": the mean of the microbatches'
      losses}`` (``loss_fn`` at these params, as ``step``'s "loss" is at
      the params each forward used), with ``has_aux`` also ``"aux"``:
      each aux output's mean over them. With it: its pytree, each leaf
      summed over the microbatches. Arrays, on every process.
    """
    return _forward_only.evaluate(
      self, state, batch, self._on_whole(metrics_fn)
    )

  @every_process
  def predict(
    self, state: PipelineState, batch: Any, predict_fn: Callable[..., Any]
  ) -> Any:
    """``predict_fn(params, batch)`` (with model state ``predict_fn(params,
    model_state, batch)``) of ``batch`` at the state's params, forward
    through the stages as ``evaluate`` runs ``metrics_fn``: e.g. logits
    or class indices. Its outputs have the microbatch's examples on
    their leading axis; returns them concatenated over the microbatches
    (the batch's order), on every process. Any batch size: past a
    multiple of the microbatch size, copies of the last example fill the
    last microbatch and their outputs are dropped (exact where each
    example's output is its own, as in inference mode; a function mixing
    a microbatch's examples -- BatchNorm's batch statistics -- sees the
    copies too)."""
    return _forward_only.predict(self, state, batch, self._on_whole(predict_fn))

  @every_process
  def generate(
    self,
    state: PipelineState,
    prompts: Any,
    decode_fn: Callable[..., Any],
    empty_cache: Callable[[int, int], Any],
    *,
    max_new_tokens: int,
    eos_id: int | None = None,
    prefill_fn: Callable[..., Any] | None = None,
    start_id: int = 0,
    one_position: bool = False,
  ) -> jax.Array:
    """Greedy continuations of ``prompts`` (int [B, P], or B 1-D int
    arrays of different lengths; any B: past a multiple of the
    microbatch size, copies of the last prompt fill the last microbatch
    and are dropped) through the stages, each layer's key/value cache
    on the stage that runs it (``execute/generation.py``).

    ``decode_fn(params, batch) -> (next-token logits [b, vocab], new
    cache)``, batch ``{"tokens": int [b, L], "index": int [b] (the cache
    slot of tokens[:, 0]), "pad": int [b] (each row's left padding, the
    slots before its first token), "cache": ...}``, e.g. ``models.gpt2.
    decode_fn(model)``; it is cut by the plan as ``predict_fn`` is.
    ``empty_cache(b, length)``: the cache's zeros (shapes only are used;
    each stage makes its own on its device). An encoder-decoder gives
    ``prefill_fn`` too (e.g. ``models.t5_v1.decode_fns(model)``): the
    prompts are then its sources, the batch's "inputs" -- token rows, or
    any array [B, ...] (a speech model's float features, an image) or a
    pytree of them (features and their mask), passed in that structure
    --, the encoder runs once in the prefill, and the decoder starts from
    ``start_id`` (token sources of different lengths are right-padded with
    0; no "pad").
    ``one_position=True``: ``decode_fn`` takes one position per call
    (Flax's decode mode, ``nn.MultiHeadDotProductAttention(decode=True)``
    as the Flax examples' LMs decode; a scanned model's stacked cache),
    and the prompt is fed to it position by position -- no prefill
    program (decoder-only models).
    With model state both take it as ``predict_fn`` does:
    ``decode_fn(params, model_state, batch)``. Stages on replica groups
    decode as they predict; across processes every process calls it with
    the same prompts.

    Returns:
      int32 [B, n] on the last stage's device (across processes: on a
      device of each process), n <= max_new_tokens:
      after a sequence's ``eos_id`` its tokens are ``eos_id``, and
      decoding stops once every sequence has ended.
    """
    return _generation.generate(
      self,
      state,
      prompts,
      self._on_whole(decode_fn),
      empty_cache,
      max_new_tokens,
      eos_id,
      self._on_whole(prefill_fn),
      start_id,
      one_position,
    )

  def _on_whole(self, fn):
    """``fn`` as the stages call it: with ``frozen``, over the trained
    params and the model state holding the frozen ones, calling ``fn``
    on the whole params."""
    if self.frozen_params is None:
      return fn
    return self.frozen_params.user_fn(fn)
