"""Greedy decoding through a pipeline's stages, each layer's key/value
cache kept on the stage that runs the layer.

The model's decoding step -- ``decode_fn(params, batch) -> (next-token
logits [b, vocab], new cache)`` with ``batch = {"tokens": int [b, L],
"index": int [b], "cache": ...}`` -- is a function of the params like
``Pipeline.predict``'s, so it is traced and cut by the pipeline's plan
as forward-only evaluation cuts it (``forward_only.cut_function``): each
layer's cache leaves are batch inputs read, and written back as results,
by the stage holding that layer, and the argmax joins the last stage.
Two programs: the prefill (the prompts, L = P, at index 0) and the step
(one token, L = 1, at index P + t - 1).

Between steps nothing is gathered: a stage's new cache leaves stay on
its device and are its next step's batch inputs for the same
microbatch; only each microbatch's next tokens ([b] ints) move from the
last stage to the first. The batch's microbatches run as a forward-only
call's (each stage in turn, dispatched asynchronously), and microbatch
b's next step depends only on its own tokens, so the stages work on
several sequences at once.

Stopping: a sequence is finished after it produced ``eos_id``; its later
tokens are ``eos_id``. The host reads whether every sequence has
finished one step late (after dispatching the next step) so that reading
does not stall the stages; at most one step is computed and dropped.

Limits: one process, one device per stage (no replica groups), no model
state, prompts of one length (the cache index is shared by a batch).
"""

import dataclasses
import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

from jpipe.runtime.execute import forward_only


@dataclasses.dataclass(frozen=True)
class _Decoder:
  """The prefill and step programs and the batch leaves' indices."""

  prefill: forward_only.ForwardProgram
  step: forward_only.ForwardProgram
  tokens: int  # The "tokens" batch leaf.
  index: int  # The "index" batch leaf.
  cache: tuple[int, ...]  # The cache's batch leaves, in flatten order.


@functools.lru_cache(maxsize=32)
def _greedy(decode_fn: Callable) -> Callable:
  """``decode_fn`` with its logits replaced by their argmax (int32 [b])."""

  def greedy(params, batch):
    logits, cache = decode_fn(params, batch)
    return jnp.argmax(logits, axis=-1).astype(jnp.int32), cache

  return greedy


def generate(
  pipe,
  state,
  prompts,
  decode_fn: Callable,
  empty_cache: Callable,
  max_new_tokens: int,
  eos_id: int | None = None,
) -> jax.Array:
  """``Pipeline.generate``: greedy continuations int32 [B, n] of the
  prompts int [B, P], n <= max_new_tokens (fewer when every sequence
  finished early), on the last stage's device."""
  prompts = np.asarray(prompts)
  _check(pipe, prompts, max_new_tokens)
  mb = pipe.microbatch_size
  m, length = len(prompts) // mb, prompts.shape[1]
  cache = jax.eval_shape(
    functools.partial(empty_cache, mb, length + max_new_tokens - 1)
  )
  dec = _decoder(pipe, decode_fn, cache, length)
  batches = _first_batches(dec, prompts, jax.tree.leaves(cache), m)
  results = forward_only.run_placed(dec.prefill, state, batches, m)
  tokens, done = results[0], None
  if eos_id is not None:
    tokens, done = _mark_ends([None] * m, tokens, eos_id)
  steps = [tokens]
  for t in range(1, max_new_tokens):
    batches = _step_batches(dec, results, tokens, length + t - 1, m)
    results = forward_only.run_placed(dec.step, state, batches, m)
    tokens = results[0]
    if done is not None:
      # Read after the step is dispatched: the stages keep working.
      if all(bool(jnp.all(d)) for d in done):
        break
      tokens, done = _mark_ends(done, tokens, eos_id)
    steps.append(tokens)
  return jnp.concatenate(
    [jnp.stack([s[b] for s in steps], axis=1) for b in range(m)]
  )


def _check(pipe, prompts, max_new_tokens) -> None:
  """One-line ValueErrors for what ``generate`` cannot run."""
  if prompts.ndim != 2 or not np.issubdtype(prompts.dtype, np.integer):
    raise ValueError(
      f"prompts must be int tokens [batch, length], got {prompts.dtype} "
      f"{prompts.shape}"
    )
  if len(prompts) % pipe.microbatch_size:
    raise ValueError(
      f"{len(prompts)} prompts do not split into microbatches of "
      f"{pipe.microbatch_size}: pass a multiple of {pipe.microbatch_size}"
    )
  if max_new_tokens < 1:
    raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
  if pipe.transport.multiprocess:
    raise ValueError(
      "generate runs in one process: call it without jax.distributed"
    )
  grouped = [s for s, p in enumerate(pipe.placement) if len(p.devices) > 1]
  if grouped:
    raise ValueError(
      f"generate runs each stage on one device; stage {grouped[0]} is a "
      "replica group: build the pipeline without replicas to generate"
    )
  if pipe.state_treedef is not None:
    raise ValueError(
      "generate does not take model state: use a model without it"
    )


def _decoder(pipe, decode_fn, cache, length) -> _Decoder:
  """The two programs of ``decode_fn`` (cached by the pipeline per
  function and shapes), checked to keep each cache leaf on one stage."""
  mb = pipe.microbatch_size

  def example(n):
    return {
      "cache": cache,
      "index": jax.ShapeDtypeStruct((mb,), np.int32),
      "tokens": jax.ShapeDtypeStruct((mb, n), np.int32),
    }

  fn = _greedy(decode_fn)
  programs = [
    forward_only.program_for(pipe, fn, example(n), "decode_fn")
    for n in (length, 1)
  ]
  paths = [p[0].key for p, _ in jax.tree.flatten_with_path(example(1))[0]]
  dec = _Decoder(
    *programs,
    paths.index("tokens"),
    paths.index("index"),
    tuple(i for i, key in enumerate(paths) if key == "cache"),
  )
  want = jax.tree.structure((0, cache))
  for program in programs:
    if program.stages.traced.out_tree != want:
      raise ValueError(
        "decode_fn must return (logits [batch, vocab], the cache in "
        "batch['cache']'s structure)"
      )
    _check_cache_stages(program, dec.cache)
  return dec


def _check_cache_stages(program, cache_leaves) -> None:
  """Each cache leaf is read and rewritten by one placement."""
  for k, leaf in enumerate(cache_leaves):
    s = program.stage_of_result.get(1 + k)
    readers = {p for p, w in program.batch_leaves.items() if leaf in w}
    if s is None or readers != {program.placement[s]}:
      raise ValueError(
        f"decode_fn's cache leaf {k} is not read and written by one stage: "
        "read and update each layer's cache inside that layer's module"
      )


def _first_batches(dec, prompts, cache_avals, m) -> dict:
  """The prefill's placed microbatches: the prompts, index 0, zero
  caches made on their stages' devices."""
  mb = len(prompts) // m
  out = {}
  for place, wanted in dec.prefill.batch_leaves.items():
    out[place] = {}
    for b in range(m):
      leaves = {}
      for i in wanted:
        if i == dec.tokens:
          leaves[i] = jax.device_put(
            prompts[b * mb : (b + 1) * mb], place.device
          )
        elif i == dec.index:
          leaves[i] = jax.device_put(np.zeros(mb, np.int32), place.device)
        else:
          aval = cache_avals[dec.cache.index(i)]
          leaves[i] = jnp.zeros(aval.shape, aval.dtype, device=place.device)
      out[place][b] = leaves
  return out


def _step_batches(dec, results, tokens, position, m) -> dict:
  """A step's placed microbatches: each one's last tokens moved to the
  stages reading them, the position, the caches where they are."""
  out = {}
  for place, wanted in dec.step.batch_leaves.items():
    out[place] = {}
    for b in range(m):
      mb = tokens[b].shape[0]
      leaves = {}
      for i in wanted:
        if i == dec.tokens:
          leaves[i] = jax.device_put(tokens[b][:, None], place.device)
        elif i == dec.index:
          leaves[i] = jax.device_put(
            np.full(mb, position, np.int32), place.device
          )
        else:
          leaves[i] = results[1 + dec.cache.index(i)][b]
      out[place][b] = leaves
  return out


def _mark_ends(done, tokens, eos_id) -> tuple[list, list]:
  """Per microbatch, ``_finished``: (its tokens, its ends so far)."""
  pairs = [_finished(d, x, eos_id) for d, x in zip(done, tokens, strict=True)]
  return [x for x, _ in pairs], [d for _, d in pairs]


@functools.partial(jax.jit, static_argnums=2)
def _finished(done, tokens, eos_id):
  """(tokens with eos_id after a sequence's end, the ends so far)."""
  if done is None:
    return tokens, tokens == eos_id
  tokens = jnp.where(done, eos_id, tokens)
  return tokens, done | (tokens == eos_id)
