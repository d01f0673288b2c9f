"""Greedy decoding through a pipeline's stages, each layer's key/value
cache kept on the stage that runs the layer.

The model's decoding step -- ``decode_fn(params, batch) -> (next-token
logits [b, vocab], new cache)`` with ``batch = {"tokens": int [b, L],
"index": int [b], "pad": int [b], "cache": ...}`` -- is a function of the params like
``Pipeline.predict``'s, so it is traced and cut by the pipeline's plan
as forward-only evaluation cuts it (``forward_only.cut_function``): each
layer's cache leaves are batch inputs read, and written back as results,
by the stage holding that layer, and the argmax joins the last stage.
Two programs: the prefill (the prompts, L = P, at index 0) and the step
(one token, L = 1, at index P + t - 1). An encoder-decoder's prefill
(``prefill_fn``) runs the encoder too and fills each decoder block's
cross-attention cache, which its steps read and return unchanged: a
cache leaf a function returns as it got it is dropped from that
function's outputs (found by tracing it once), so it stays where it is
rather than joining the last stage's results. A cache leaf made on
another stage than one reading it is copied to each reader after each
write: GNMT's attention keeps the encoder's outputs, made on the
encoder's last stage; a decoder whose every block reads the encoder's
outputs from the cache (the Flax examples' WMT model decodes so) gets a
copy on each decoder stage, once, in the prefill.

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

Prompts of different lengths (a list of 1-D token arrays): a
decoder-only model's are left-padded to the longest, so that the cache
slot written stays one per batch; "pad" says how many slots each row's
padding takes (its position 0 is at that slot; the model masks the
padding slots out: ``models.gpt2``). An encoder-decoder's sources are
right-padded with 0, which its encoder masks (no "pad": every decoder
starts at slot 0). Its sources need not be tokens: any array with the
examples on its leading axis (a speech model's float features, an
image captioner's pixels), or a pytree of them (features with their
mask), reaches ``prefill_fn`` as the batch's "inputs" in that structure.

A stage on a replica group reads a microbatch's feeds as its other
work does: split over the group, whole on the first device (weighted),
or on the microbatch's replica (round robin); its cache stays so.

With model state (e.g. BatchNorm statistics) the decoding functions
take it as ``predict_fn`` does -- ``decode_fn(params, model_state,
batch)`` -- and read it on the stages that keep it (not updated).

Across processes every process calls ``generate`` with the same prompts
and runs its own stages; each step's tokens are shared from the last
stage's process with every process (each feeds its first stage, if it
has it, and sees every sequence end at the same step), and a cache leaf
read on another process's stage moves there over the pipeline's
transport.
"""

import dataclasses
import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

from jpipe import partition as partition_lib
from jpipe.runtime.build.batches import padded_to_multiple
from jpipe.runtime.build.state_rows import StateRows
from jpipe.runtime.execute import cache_rows, forward_only


@dataclasses.dataclass(frozen=True)
class _Program:
  """One of the two programs and the cache leaves (their positions in
  the cache's flatten order) it writes: its results 1, 2, ..."""

  program: forward_only.ForwardProgram
  written: tuple[int, ...]


@dataclasses.dataclass(frozen=True)
class _Decoder:
  """The prefill and step programs and the batch leaves' indices."""

  prefill: _Program
  step: _Program
  tokens: int  # The "tokens" batch leaf.
  index: int  # The "index" batch leaf.
  cache: tuple[int, ...]  # The cache's batch leaves, in flatten order.
  inputs: tuple[int, ...]  # The "inputs" batch leaves (encoder-decoder).
  pad: int | None  # The "pad" batch leaf (decoder-only).
  # Per cache leaf, the stages reading it (one per placement; empty:
  # none reads it), on every process.
  readers: tuple = ()


@functools.lru_cache(maxsize=32)
def _greedy(decode_fn: Callable, written: tuple[int, ...]) -> Callable:
  """``decode_fn`` returning its logits' argmax (int32 [b]) and only the
  cache leaves at ``written``."""

  def greedy(params, *state_and_batch):
    logits, cache = decode_fn(params, *state_and_batch)
    leaves = jax.tree.leaves(cache)
    return jnp.argmax(logits, axis=-1).astype(jnp.int32), [
      leaves[k] for k in written
    ]

  return greedy


def generate(
  pipe,
  state,
  prompts,
  decode_fn: Callable,
  empty_cache: Callable,
  max_new_tokens: int,
  eos_id: int | None = None,
  prefill_fn: Callable | None = None,
  start_id: int = 0,
  one_position: bool = False,
) -> jax.Array:
  """``Pipeline.generate``: greedy continuations int32 [B, n] of the
  prompts (int [B, P], or B 1-D int arrays of any lengths; an
  encoder-decoder's sources when ``prefill_fn`` is given -- those, or
  any array [B, ...] or pytree of them: the decoder starts from
  ``start_id``), n <= max_new_tokens (fewer when every
  sequence finished early), on the last stage's device. ``one_position``:
  ``decode_fn`` takes one position per call, the prompt fed to it
  position by position (no prefill program)."""
  encoder_decoder = prefill_fn is not None
  if one_position and encoder_decoder:
    raise ValueError(
      "one_position feeds a decoder-only model's prompt position by "
      "position; an encoder-decoder's prefill_fn runs its encoder once: "
      "pass one or the other"
    )
  prompts, pad = padded_prompts(prompts, encoder_decoder)
  _check(prompts, max_new_tokens, encoder_decoder)
  # Rows past a multiple of the microbatch size: copies of the last
  # prompt, decoded alongside and dropped.
  (prompts, pad), size = padded_to_multiple(
    (prompts, pad), pipe.microbatch_size
  )
  feeds = _Feeds(pipe.microbatch_size, prompts, pad, start_id)
  m, length = feeds.m, feeds.first.shape[1]
  cache = jax.eval_shape(
    functools.partial(empty_cache, feeds.mb, length + max_new_tokens - 1)
  )
  prefill = None if one_position else prefill_fn or decode_fn
  dec, feeds.avals = _decoder(pipe, prefill, decode_fn, cache, feeds)
  if pad is not None and pad.any() and not _reads(dec, dec.pad):
    raise ValueError(
      "prompts of different lengths are left-padded: decode_fn must read "
      "batch['pad'] (each row's padding slots, e.g. models.gpt2.decode_fn)"
    )
  tokens = _after_prompts(feeds, dec, state)
  done = None
  if eos_id is not None:
    tokens, done = _mark_ends([None] * m, tokens, eos_id)
  steps = [tokens]
  for t in range(1, max_new_tokens):
    tokens = feeds.run(dec, dec.step, state, length + t - 1, tokens)
    if done is not None:
      # Read after the step is dispatched: the stages keep working.
      if all(bool(jnp.all(d)) for d in done):
        break
      tokens, done = _mark_ends(done, tokens, eos_id)
    steps.append(tokens)
  rows = [jnp.stack([s[b] for s in steps], axis=1) for b in range(m)]
  if pipe.transport.multiprocess:  # Shared: on a device of this process.
    return jnp.concatenate(rows)[:size]
  # Each microbatch's [mb, n] tokens (on the last stage's group or
  # replica) together on that stage's first device.
  last = pipe.placement[-1].device
  return jnp.concatenate([jax.device_put(r, last) for r in rows])[:size]


def _after_prompts(feeds, dec, state) -> list:
  """Each microbatch's first new tokens: the prefill program on the
  prompts, or (no prefill program: one position per call) the step
  program on each prompt position in turn."""
  if dec.prefill is not dec.step:
    return feeds.run(dec, dec.prefill, state, 0, None)
  mb = feeds.mb
  for t in range(feeds.first.shape[1]):
    column = [feeds.first[b * mb : (b + 1) * mb, t] for b in range(feeds.m)]
    tokens = feeds.run(dec, dec.step, state, t, column)
  return tokens


def padded_prompts(prompts, encoder_decoder: bool):
  """(int [B, P], each row's left padding int32 [B] or None): ``prompts``
  as one array -- 1-D arrays of different lengths padded with 0, on the
  left (decoder-only) or the right (an encoder-decoder's sources). An
  encoder-decoder's sources in a dict (or another pytree that is not a
  list of rows) stay so, each leaf a NumPy array."""
  if encoder_decoder and not isinstance(prompts, (list, tuple, np.ndarray)):
    if not isinstance(prompts, jax.Array):  # (A pytree of sources.)
      return jax.tree.map(np.asarray, prompts), None
  if isinstance(prompts, (list, tuple)) and prompts:
    rows = [np.asarray(p) for p in prompts]
    if any(r.ndim != 1 or not len(r) for r in rows):
      raise ValueError(
        "prompts of different lengths must be non-empty 1-D token arrays, "
        f"got shapes {[r.shape for r in rows]}"
      )
    width = max(len(r) for r in rows)
    pads = np.array([width - len(r) for r in rows], np.int32)
    side = (lambda n: (0, n)) if encoder_decoder else (lambda n: (n, 0))
    prompts = np.stack(
      [np.pad(r, side(n)) for r, n in zip(rows, pads, strict=True)]
    )
  else:
    prompts = np.asarray(prompts)
    pads = np.zeros(len(prompts), np.int32)
  return prompts, None if encoder_decoder else pads


class _Feeds:
  """A generation's batch leaves, placed per microbatch where the stages
  read them: the first tokens (the prompts, or the decoder's start),
  the sources (placed once), the position, the caches (each leaf's
  latest value per microbatch, on the device of the stage writing it;
  zeros made there before the first write)."""

  def __init__(self, mb, prompts, pad, start_id):
    encoder_decoder = pad is None
    size = len(jax.tree.leaves(prompts)[0])
    self.mb, self.m = mb, size // mb
    # An encoder-decoder's sources: their leaves (flatten order).
    self.source = jax.tree.leaves(prompts) if encoder_decoder else None
    self.source_tree = prompts if encoder_decoder else None
    self.pad = pad
    self.first = (
      np.full((size, 1), start_id, np.int32)
      if encoder_decoder
      else prompts.astype(np.int32)
    )
    self.avals = None  # The cache's leaves' shapes.
    self.cache = {}  # Cache leaf -> {reader: its value per microbatch}.
    self._sources = {}  # (placement, microbatch) -> its placed source.

  def run(self, dec, step: _Program, state, position, tokens) -> list:
    """``step``'s program at ``position`` on every microbatch (``tokens``
    None: the first tokens; else each one's last); its new tokens per
    microbatch, its cache leaves kept."""
    batches = self._placed(dec, step.program, position, tokens)
    program = step.program
    results = forward_only.run_placed(program, state, batches, self.m)
    for j, k in enumerate(step.written):
      maker = program.stage_of_result[1 + j]
      values = results.get(1 + j, [None] * self.m)  # (None: elsewhere.)
      self.cache[k] = {
        program.placement[s]: self._copied(program, values, maker, s, k)
        for s in dec.readers[k]
      }
    return self._tokens(program, results.get(0))

  def _copied(self, program, values, maker: int, reader: int, k: int):
    """Cache leaf k's new values (per microbatch, made by stage
    ``maker``) where stage ``reader`` reads them: made elsewhere (e.g.
    the encoder's outputs that an attention keeps), copied there once
    per write; across processes every process calls it alike."""
    transport, place = program.transport, program.placement[reader]
    if transport.multiprocess:
      return [
        transport.move(v, maker, reader, self.avals[k], microbatch=b)
        for b, v in enumerate(values)
      ]
    if place == program.placement[maker]:
      return values
    return [_put(place, b, v) for b, v in enumerate(values)]

  def _tokens(self, program, mine) -> list:
    """Each microbatch's new tokens, made on the last stage; across
    processes shared with every process (each feeds its first stage
    and decides alike when every sequence has ended)."""
    transport = program.transport
    if not transport.multiprocess:
      return mine
    s = program.stage_of_result[0]
    aval = jax.ShapeDtypeStruct((self.mb,), np.int32)
    return [
      transport.share(mine[b] if mine else None, s, aval) for b in range(self.m)
    ]

  def _placed(self, dec, program, position, tokens) -> dict:
    """``program``'s batch leaves per placement and microbatch."""
    index = np.full(self.mb, position, np.int32)
    rows = lambda x, b: x[b * self.mb : (b + 1) * self.mb]  # noqa: E731
    out = {}
    for place, wanted in program.batch_leaves.items():
      out[place] = {}
      for b in range(self.m):
        leaves = {}
        put = functools.partial(_put, place, b)
        for i in wanted:
          if i == dec.tokens:
            x = rows(self.first, b) if tokens is None else tokens[b][:, None]
            leaves[i] = put(x)
          elif i == dec.index:
            leaves[i] = put(index)
          elif i == dec.pad:
            leaves[i] = put(rows(self.pad, b))
          elif i in dec.inputs:
            j = dec.inputs.index(i)
            key = (place, b, j)
            if key not in self._sources:
              self._sources[key] = put(rows(self.source[j], b))
            leaves[i] = self._sources[key]
          else:
            k = dec.cache.index(i)
            aval = self.avals[k]
            leaves[i] = (
              self.cache[k][place][b]
              if k in self.cache
              else put(np.zeros(aval.shape, aval.dtype))
            )
        out[place][b] = leaves
    return out


def _put(place, b: int, x):
  """Microbatch b's value ``x`` (leading axis: its examples) where
  ``place`` reads it: on its device; a replica group's split over the
  group, on its first device (weighted), or on b's replica (round
  robin)."""
  if place.round_robin:
    return jax.device_put(x, place.replica(b).device)
  return place.put_values(x)


def _check(prompts, max_new_tokens, encoder_decoder: bool) -> None:
  """One-line ValueErrors for what ``generate`` cannot run."""
  if encoder_decoder:
    sizes = {
      np.shape(x)[0] if np.ndim(x) else None for x in jax.tree.leaves(prompts)
    }
    if len(sizes) != 1 or None in sizes:
      raise ValueError(
        "an encoder-decoder's sources must be arrays sharing a leading "
        f"batch axis; got leading sizes {sorted(sizes, key=str)}"
      )
  elif prompts.ndim != 2 or not np.issubdtype(prompts.dtype, np.integer):
    raise ValueError(
      f"prompts must be int tokens [batch, length], got {prompts.dtype} "
      f"{prompts.shape}"
    )
  if not len(jax.tree.leaves(prompts)[0]):
    raise ValueError("no prompts: pass at least one")
  if max_new_tokens < 1:
    raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")


def _decoder(pipe, prefill_fn, decode_fn, cache, feeds):
  """``(decoder, the cache's leaves as the stages hold them)``: the
  prefill's and step's programs (cached by the pipeline per function and
  shapes; ``prefill_fn`` None: the prefill is the step's program, run per
  prompt position) and each cache leaf's readers. A cache leaf stacked
  per layer of a scan split by layer goes to the stages as its rows, each
  row on its layer's stage (``cache_rows``)."""
  dec = _programs(pipe, prefill_fn, decode_fn, cache, feeds)
  rows = cache_rows.layer_rows(dec.step.program, dec.cache)
  if rows:
    layout = StateRows.of(cache, rows)
    decode_fn = cache_rows.on_rows(decode_fn, layout)
    if prefill_fn is not None:
      prefill_fn = cache_rows.on_rows(prefill_fn, layout)
    cache = layout.to_rows(cache)
    dec = _programs(pipe, prefill_fn, decode_fn, cache, feeds)
  return dataclasses.replace(dec, readers=_readers(dec)), jax.tree.leaves(cache)


def _programs(pipe, prefill_fn, decode_fn, cache, feeds) -> _Decoder:
  """The prefill's and step's programs and the batch leaves' indices."""
  mb = pipe.microbatch_size

  def example(n):
    batch = {
      "cache": cache,
      "index": jax.ShapeDtypeStruct((mb,), np.int32),
      "tokens": jax.ShapeDtypeStruct((mb, n), np.int32),
    }
    if feeds.source is not None:
      batch["inputs"] = jax.tree.map(
        lambda x: jax.ShapeDtypeStruct((mb, *x.shape[1:]), x.dtype),
        feeds.source_tree,
      )
    else:
      batch["pad"] = jax.ShapeDtypeStruct((mb,), np.int32)
    return batch

  def program(fn, n, what):
    written = _written(pipe, fn, example(n), what)
    return _Program(
      forward_only.program_for(
        pipe, _greedy(fn, written), example(n), what, microbatch=True
      ),
      written,
    )

  step = program(decode_fn, 1, "decode_fn")
  prefill = step  # (None: one position per call, the step's program.)
  if prefill_fn is not None:
    prefill = program(prefill_fn, feeds.first.shape[1], "prefill_fn")
  paths = [p[0].key for p, _ in jax.tree.flatten_with_path(example(1))[0]]
  return _Decoder(
    prefill,
    step,
    paths.index("tokens"),
    paths.index("index"),
    tuple(i for i, key in enumerate(paths) if key == "cache"),
    tuple(i for i, key in enumerate(paths) if key == "inputs"),
    paths.index("pad") if "pad" in paths else None,
  )


def _written(pipe, fn, example, what) -> tuple[int, ...]:
  """The cache leaves ``fn`` returns changed (not as it got them), from
  one abstract trace (cached per function and shapes)."""
  key = ("written", fn, jax.tree.structure(example), str(example))
  if key not in pipe.forward_programs:
    avals = [
      jax.ShapeDtypeStruct(a.shape, a.dtype)
      for a in pipe.traced.closed_jaxpr.in_avals
    ]
    n = pipe.traced.num_param_leaves
    # (Rows of a stacked leaf split by layer stacked back: the model's.)
    leaves = pipe.traced.model_leaves(avals[:n])
    args = [jax.tree.unflatten(pipe.params_treedef, leaves)]
    if pipe.state_treedef is not None:  # fn(params, model_state, batch).
      state = avals[n + pipe.num_batch_leaves :]
      if pipe.state_rows is not None:  # (Rows of a stacked leaf: stacked.)
        args.append(pipe.state_rows.to_model(state))
      else:
        args.append(jax.tree.unflatten(pipe.state_treedef, state))
    flat, tree = jax.tree.flatten((*args, example))
    with partition_lib.caller_axes(flat) as typed:  # (The caller's mesh.)
      closed, out = jax.make_jaxpr(fn, return_shape=True)(
        *jax.tree.unflatten(tree, typed)
      )
    if jax.tree.structure(out) != jax.tree.structure((0, example["cache"])):
      raise ValueError(
        f"{what} must return (logits [batch, vocab], the cache in "
        "batch['cache']'s structure)"
      )
    jaxpr = closed.jaxpr
    inputs = {id(v) for v in jaxpr.invars}
    pipe.forward_programs[key] = tuple(
      k for k, v in enumerate(jaxpr.outvars[1:]) if id(v) not in inputs
    )
  return pipe.forward_programs[key]


def _reads(dec, leaf) -> bool:
  """Whether a stage of the prefill or step program reads batch ``leaf``."""
  return any(
    leaf in wanted
    for step in (dec.prefill, dec.step)
    for wanted in step.program.batch_leaves.values()
  )


def _readers(dec) -> tuple:
  """Each cache leaf's reading stages (the prefill's and the step's),
  the first of each placement, in stage order, on every process."""
  out = []
  for leaf in dec.cache:
    readers = {}
    for step in (dec.prefill, dec.step):
      program = step.program
      for s, spec in enumerate(program.stages.specs):
        if leaf in spec.batch_leaves:
          readers.setdefault(program.placement[s], s)
    out.append(tuple(sorted(readers.values())))
  return tuple(out)


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
