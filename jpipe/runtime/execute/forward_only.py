"""Forward-only runs through a pipeline's stages: evaluation, prediction.

A function of the model's params -- the training loss itself, or the
user's metrics or prediction function -- runs stage by stage on the
devices the stages train on: each stage's forward program at its own
params, its activations passed on as in training, nothing saved for a
backward, nothing gathered to one device (a model too big for one device
evaluates so) and the state unchanged (model state, e.g. BatchNorm
statistics, is read, not updated).

A function other than the loss is traced on a microbatch at the loss's
depth and cut by the pipeline's node -> stage map
(``partition.follow_plan``: a node goes to the stage holding the loss's
node of the same module), so each stage reads params it already holds.
Its microbatches' outputs are then combined on the stage that made them
-- summed (metrics), averaged (the loss) or concatenated (predictions)
-- and, across processes, shared with every process.
"""

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.extend.core as jcore
import jax.numpy as jnp
import numpy as np

from jpipe import partition as partition_lib
from jpipe import schedule as schedule_lib
from jpipe.runtime.build.batches import (
  batch_size,
  padded_to_multiple,
  place_microbatches,
  stored_dtype,
)
from jpipe.runtime.execute.stage_work import local_inputs
from jpipe.runtime.execute.transfer_ends import TransferEnds

FORWARD = schedule_lib.ActionKind.FORWARD
SEND, RECV, MOVE = (
  schedule_lib.MoveKind.SEND,
  schedule_lib.MoveKind.RECV,
  schedule_lib.MoveKind.MOVE,
)


@dataclasses.dataclass(frozen=True, eq=False)
class ForwardProgram:
  """A function of ``(params, [model state,] batch)`` on a pipeline's
  stages, run forward only.

  Attributes:
    stages: its ``partition.Stages``, one per pipeline stage (a stage may
      run none of its equations).
    param_positions: per stage, where each of its param leaves is in the
      pipeline stage's params tuple.
    num_batch_leaves: leaves of its batch (the model-state leaves follow
      them among a stage's batch inputs).
    batch_leaves: ``{placement: batch leaves its stages read}``, for this
      process's stages.
    placement: the pipeline's stage placements.
    transport: the pipeline's transport (moves between processes).
    schedule_device: each stage's schedule device (the issue order).
    microbatch_size: examples per microbatch.
    tied: the pipeline's ``TiedParams``.
    tied_reads: per stage, ``(position, leaf, owner, owner position)``
      of its param leaves whose value is the owner stage's (streaming
      schedules: a replica holder's own copy never steps; the owner's
      current value moves to it once per run).
    producer: each activation's producing stage.
    readers: each activation's count of reading stages.
    stage_of_result: each non-constant result's producing stage.
  """

  stages: Any
  param_positions: tuple[tuple[int, ...], ...]
  num_batch_leaves: int
  batch_leaves: dict
  placement: tuple
  transport: Any
  schedule_device: tuple[int, ...]
  microbatch_size: int
  tied: Any
  tied_reads: tuple[tuple[tuple[int, int, int, int], ...], ...]
  producer: dict = dataclasses.field(init=False)
  readers: dict = dataclasses.field(init=False)
  stage_of_result: dict = dataclasses.field(init=False)
  _lowered: dict = dataclasses.field(init=False, default_factory=dict)

  def __post_init__(self):
    producer, readers = {}, {}
    for s, spec in enumerate(self.stages.specs):
      producer.update((v, s) for v in spec.outputs)
      for v in spec.inputs:
        readers[v] = readers.get(v, 0) + 1
    results = {
      r: s for s, spec in enumerate(self.stages.specs) for r in spec.results
    }
    # (Derived once; the value stays frozen.)
    object.__setattr__(self, "producer", producer)
    object.__setattr__(self, "readers", readers)
    object.__setattr__(self, "stage_of_result", results)

  def lower(self, m: int) -> tuple:
    """This process's forwards and moves for m microbatches (cached)."""
    ops = self._lowered.get(m)
    if ops is None:
      transport = self.transport
      ops = self._lowered[m] = schedule_lib.lower(
        _forward_order(len(self.stages.specs), self.schedule_device, m),
        self._transfers,
        transport.stage_processes,
        transport.process,
        made_by=_maker if transport.sends_early else None,
        replica_process=transport.replica_processes,
      )
    return ops

  def _transfers(self, action):
    """A forward's transfers, before it: its input activations; at the
    first microbatch, the owners' values of its tied leaves."""
    s = action.stage
    tied = []
    if action.microbatch == 0:
      tied = [
        schedule_lib.Transfer("tied", owner, s, leaf)
        for _, leaf, owner, _ in self.tied_reads[s]
      ]
    inputs = [
      schedule_lib.Transfer("F", self.producer[v], s, v)
      for v in self.stages.specs[s].inputs
    ]
    return tied + inputs, ()


def own_program(pipe) -> ForwardProgram:
  """The pipeline's loss on its own stages (result 0: the loss; then
  new model-state leaves, dropped, and aux outputs)."""
  return ForwardProgram(
    pipe.stages,
    tuple(tuple(range(len(spec.param_leaves))) for spec in pipe.stages.specs),
    pipe.num_batch_leaves,
    pipe.batch_leaves,
    pipe.placement,
    pipe.transport,
    pipe.calls.stage_device,
    pipe.microbatch_size,
    pipe.tied,
    _tied_reads(pipe, pipe.stages),
  )


def _tied_reads(pipe, stages) -> tuple:
  """``ForwardProgram.tied_reads`` of ``stages`` (a function's, cut by
  ``pipe``): under a streaming schedule, the reads of a tied leaf on a
  stage holding a replica of it."""
  out = []
  for s, spec in enumerate(stages.specs):
    replicas = {}
    if pipe.stream is not None:
      replicas = {
        leaf: (owner, owner_pos)
        for _, leaf, owner, owner_pos in pipe.tied.replicas.get(s, ())
      }
    out.append(
      tuple(
        (k, leaf, *replicas[leaf])
        for k, leaf in enumerate(spec.param_leaves)
        if leaf in replicas
      )
    )
  return tuple(out)


def cut_function(
  pipe, fn: Callable, example_batch, what: str, microbatch: bool = False
):
  """``fn`` traced on a microbatch of ``example_batch`` (arrays or
  ``jax.ShapeDtypeStruct``) and cut by ``pipe``'s node -> stage map.
  ``what``: how errors name ``fn``. ``microbatch``: ``example_batch``
  is one microbatch already, its shapes kept (a decoding cache's scalar
  index, leaves stacked per layer). ValueError where ``fn`` reads a
  param on a stage that does not hold it."""
  size = pipe.microbatch_size
  micro = jax.tree.map(
    lambda x: partition_lib.keep_type(  # (The caller's, to trace on.)
      x,
      jax.ShapeDtypeStruct(
        np.shape(x) if microbatch else (size, *np.shape(x)[1:]), x.dtype
      ),
    ),
    example_batch,
  )
  avals = pipe.traced.closed_jaxpr.in_avals
  n_params = pipe.traced.num_param_leaves
  rows = [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in avals[:n_params]]
  params = jax.tree.unflatten(
    pipe.params_treedef, pipe.traced.model_leaves(rows)
  )
  num_batch_leaves = len(jax.tree.leaves(micro))
  traced_fn, inputs = fn, micro
  if pipe.state_treedef is not None:
    state = jax.tree.unflatten(
      pipe.state_treedef,
      [
        jax.ShapeDtypeStruct(a.shape, a.dtype)
        for a in avals[n_params + pipe.num_batch_leaves :]
      ],
    )
    if pipe.state_rows is not None:  # (The stages hold a stacked leaf's rows.)
      fn = pipe.state_rows.reading_rows(fn)
    traced_fn, inputs = partition_lib.with_model_state(fn, micro, state)
  traced = partition_lib.trace(
    traced_fn, params, inputs, depth=pipe.traced.depth, returns_loss=False
  )
  if traced.param_layout != pipe.traced.param_layout:
    raise ValueError(
      f"{what} runs the model's stacked layers otherwise than loss_fn (a "
      "scan over layers in one, not the other): scan them alike in both, "
      "once per call (a stacked leaf read by several scans -- a decoding "
      "loop calling the scanned model per position -- is not split by "
      "layer: give generate a decode_fn of one position and "
      "one_position=True)"
    )
  stage_of_node = partition_lib.follow_plan(
    traced, pipe.traced, pipe.stages.stage_of_node
  )
  try:
    stages = partition_lib.Stages(
      traced,
      stage_of_node,
      num_stages=len(pipe.stages.specs),
      compiler_options=pipe.stages.compiler_options,
    )
  except ValueError as e:
    raise ValueError(
      f"{what} does not follow the pipeline's stages ({e}): call the "
      "model's modules in the order loss_fn does"
    ) from e
  positions = _param_positions(pipe, stages, what)
  _check_state_reads(pipe, stages, num_batch_leaves, what)
  batch_leaves = {}
  for s, (spec, place) in enumerate(
    zip(stages.specs, pipe.placement, strict=True)
  ):
    if not pipe.transport.owns(s):
      continue
    wanted = batch_leaves.setdefault(place, [])
    wanted.extend(
      i for i in spec.batch_leaves if i < num_batch_leaves and i not in wanted
    )
  return ForwardProgram(
    stages,
    positions,
    num_batch_leaves,
    batch_leaves,
    pipe.placement,
    pipe.transport,
    pipe.calls.stage_device,
    pipe.microbatch_size,
    pipe.tied,
    _tied_reads(pipe, stages),
  )


def _param_positions(pipe, stages, what) -> tuple[tuple[int, ...], ...]:
  """Per stage, its param leaves' positions in the pipeline stage's
  params; ValueError naming a leaf read where it is not held."""
  positions = []
  for s, (spec, own) in enumerate(
    zip(stages.specs, pipe.stages.specs, strict=True)
  ):
    where = {leaf: p for p, leaf in enumerate(own.param_leaves)}
    for leaf in spec.param_leaves:
      if leaf not in where:
        holders = [
          t for t, o in enumerate(pipe.stages.specs) if leaf in o.param_leaves
        ]
        raise ValueError(
          f"{what} reads param {pipe.leaf_names[leaf]} on stage {s}, which "
          f"does not hold it (stage {holders[0]} does): call the model's "
          "modules as loss_fn does"
        )
    positions.append(tuple(where[leaf] for leaf in spec.param_leaves))
  return tuple(positions)


def _check_state_reads(pipe, stages, num_batch_leaves, what) -> None:
  """Across processes, a stage's model-state leaves are current only
  where its training forwards read or make them: the function must read
  them there too."""
  if not pipe.transport.multiprocess:
    return
  nb = pipe.num_batch_leaves
  for s, (spec, own) in enumerate(
    zip(stages.specs, pipe.stages.specs, strict=True)
  ):
    held = {i - nb for i in own.batch_leaves if i >= nb}
    held |= {r - 1 for r in own.results if r > 0}
    read = {i - num_batch_leaves for i in spec.batch_leaves}
    read = {j for j in read if j >= 0}
    if read - held:
      raise ValueError(
        f"{what} reads model-state leaf {min(read - held)} on stage {s}, "
        "where the training forwards do not: across processes it is not "
        "current there"
      )


def run(program: ForwardProgram, state, batch) -> tuple[dict, int]:
  """Every microbatch of ``batch`` forward through ``program`` at the
  state's params; ``({result: [its value per microbatch]}`` for the
  results this process's stages make, the microbatch count)."""
  size = batch_size(batch)
  if not size:
    raise ValueError("an empty batch: pass at least one example")
  micro = program.microbatch_size
  if size % micro:  # (predict pads; a sum or mean would count padding.)
    raise ValueError(
      f"a batch of {size} examples does not split into microbatches of "
      f"{micro}: pass a multiple of {micro} (evaluate sums or averages "
      "every example it is given; pad a last batch with a weight leaf, 0 "
      "on padding, that metrics_fn multiplies in)"
    )
  m = size // micro
  batches = place_microbatches(
    jax.tree.leaves(batch), program.batch_leaves, m, 0
  )
  return run_placed(program, state, batches, m), m


def run_placed(program: ForwardProgram, state, batches: dict, m: int) -> dict:
  """``run`` of m microbatches already placed: ``batches`` is
  ``{placement: {b: {batch leaf index: array on its device(s)}}}`` (as
  ``place_microbatches`` makes it); returns ``{result: [its value per
  microbatch]}``."""
  call = _ForwardCall(program, state)
  call.batches = batches
  methods = {
    FORWARD: call.forward,
    SEND: call.send,
    RECV: call.receive,
    MOVE: call.move,
  }
  ops = program.lower(m)
  program.transport.begin_call()
  for op in ops:
    methods[op.kind](op)
  if call.values or call.inbox:  # A lowering bug, not a user error.
    raise RuntimeError(
      f"activations left unread: {sorted(map(str, call.values))[:4]}"
    )
  return call.results


def combined(program: ForwardProgram, results: dict, m: int, combine):
  """The function's output pytree: each result's microbatch values
  combined by ``combine`` (a list of m arrays -> one array) on the stage
  that made it, on every process."""
  outvars = program.stages.traced.jaxpr.outvars
  flat = [
    combined_result(program, results, r, m, combine)
    for r in range(len(outvars))
  ]
  return jax.tree.unflatten(program.stages.traced.out_tree, flat)


def combined_result(program: ForwardProgram, results, r, m, combine):
  """Result r's microbatch values combined (``combined``)."""
  v = program.stages.traced.jaxpr.outvars[r]
  if isinstance(v, jcore.Literal):  # A constant: the same per microbatch.
    return combine([jnp.asarray(v.val)] * m)
  s = program.stage_of_result[r]
  transport = program.transport
  values = results.get(r)
  place = program.placement[s]
  if values and place.round_robin:  # Each on its replica's device.
    values = [jax.device_put(x, place.device) for x in values]
  x = combine(values) if transport.owns(s) else None
  if transport.multiprocess:
    aval = jax.eval_shape(
      combine, [jax.ShapeDtypeStruct(v.aval.shape, v.aval.dtype)] * m
    )
    x = transport.share(x, s, aval)
  return x


def total(values):
  """Microbatches' values summed (per-batch sums of a metric)."""
  return jnp.sum(jnp.stack(values), axis=0)


def mean(values):
  """Microbatches' values averaged (their mean losses)."""
  return jnp.mean(jnp.stack(values), axis=0)


def concatenated(values):
  """Microbatches' values in batch order (per-example predictions)."""
  if not values[0].ndim:
    raise ValueError(
      "predict_fn returned a scalar: return per-example values (leading "
      "axis: the microbatch's examples)"
    )
  return jnp.concatenate(values, axis=0)


class _ForwardCall(TransferEnds):
  """One forward-only run's working state: activations until their
  readers took them (``TransferEnds``' "F" transfers), and the results
  of this process's stages."""

  def __init__(self, program: ForwardProgram, state):
    self.d = program
    self.params = state.stage_params
    self.model_state = _replica0_state(program, state.model_state)
    self.batches = {}
    self.values, self.reads_left, self.inbox = {}, {}, {}
    self.results = {}  # result -> [value per microbatch, in order]
    # (leaf, 0) -> an owner's value of a tied leaf, sent to its holders
    # before their first forward; (stage, leaf) -> what a holder got.
    self.tied, self.replica = {}, {}
    for reads in program.tied_reads:
      for _, leaf, owner, owner_pos in reads:
        if program.transport.owns(owner):
          self.tied[(leaf, 0)] = self.params[owner][owner_pos]

  def state_leaf(self, i: int, j: int):
    """Model-state leaf i: replica 0's copy for every replica j of a
    round-robin group (PipeDream evaluates from each stage's first
    rank)."""
    del j
    return self.model_state[i]

  def forward(self, action):
    """F(s, b): stage s's part of the function on microbatch b."""
    d, s, b = self.d, action.stage, action.microbatch
    spec, place = d.stages.specs[s], d.placement[s]
    acts = tuple(self.inbox.pop((s, b, v)) for v in spec.inputs)
    if not spec.eqns and not spec.results:
      return  # The function runs nothing on this stage.
    own = self.params[s]
    params = [own[p] for p in d.param_positions[s]]
    for k, leaf, _, _ in d.tied_reads[s]:  # The owner's current value.
      if b == 0:
        self.replica[(s, leaf)] = place.put_replicated(self.tied[(leaf, 0)])
      params[k] = self.replica[(s, leaf)]
    if place.round_robin:  # Microbatch b's replica, its own copy.
      params = place.on_replica(params, b)
    elif place.weighted:  # Whole on the first replica: forward only,
      params = place.on_device(params, 0)  # nothing to balance per step.
    local = local_inputs(self, spec, self.batches[place][b], place, b)
    outputs, results = d.stages.jitted("forward", s)(tuple(params), local, acts)
    for v, x in zip(spec.outputs, outputs, strict=True):
      self.values[(b, v)] = x
      self.reads_left[(b, v)] = d.readers[v]
    for r, x in zip(spec.results, results, strict=True):
      self.results.setdefault(r, []).append(x)


def _replica0_state(program: ForwardProgram, model_state) -> list:
  """``model_state`` with the leaves a round-robin group across processes
  reads at replica 0's copy in every process: only replica 0's process
  (the group's lead) keeps that copy current (each replica's forwards
  update their own, ``replica_state``), so it is shared from there,
  every process in the same order."""
  transport, nb = program.transport, program.num_batch_leaves
  out = list(model_state)
  for s in transport.spanning:
    if not program.placement[s].round_robin:
      continue
    for i in program.stages.specs[s].batch_leaves:
      if i < nb:
        continue
      x = out[i - nb]
      aval = jax.ShapeDtypeStruct(np.shape(x), x.dtype)
      y = transport.share(x if transport.leads(s) else None, s, aval)
      if y is not None:  # (None: a process outside the pipeline.)
        out[i - nb] = y
  return out


def _maker(action, transfer):
  """The forward that makes an activation (the "pull" transport sends
  it right after); a tied leaf's value is there from the start."""
  if transfer.what == "F":
    return schedule_lib.Action(FORWARD, transfer.src, action.microbatch)
  return None


@functools.lru_cache(maxsize=64)
def _forward_order(num_stages: int, stage_device: tuple, m: int):
  """Every stage's forwards of m microbatches (stage by stage on a device
  holding several), in an issue order."""
  lists = schedule_lib.place(
    "forward",
    [
      [schedule_lib.Action(FORWARD, s, b) for b in range(m)]
      for s in range(num_stages)
    ],
    stage_device,
  )
  return schedule_lib.issue_order(lists)


def evaluate(pipe, state, batch, metrics_fn=None):
  """``Pipeline.evaluate``: the loss's mean over the batch's
  microbatches, or ``metrics_fn``'s outputs summed over them."""
  if metrics_fn is None:
    program = program_for(pipe, None, batch, "")
    results, m = run(program, state, batch)
    # Result 0: the loss; then new model state (dropped) and aux outputs.
    out = {"loss": combined_result(program, results, 0, m, mean)}
    outputs = pipe.loss_outputs
    if outputs.aux_treedef is not None:
      first = outputs.first_aux
      aux = [
        combined_result(program, results, r, m, mean)
        for r in range(first, first + outputs.num_aux_leaves)
      ]
      out["aux"] = jax.tree.unflatten(outputs.aux_treedef, aux)
    return out
  program = program_for(pipe, metrics_fn, batch, "metrics_fn")
  results, m = run(program, state, batch)
  return combined(program, results, m, total)


def predict(pipe, state, batch, predict_fn):
  """``Pipeline.predict``: ``predict_fn``'s outputs of every microbatch,
  concatenated in batch order; a batch that does not split into
  microbatches is padded with copies of its last example, their outputs
  dropped."""
  batch, size = padded_to_multiple(batch, pipe.microbatch_size)
  program = program_for(pipe, predict_fn, batch, "predict_fn")
  results, m = run(program, state, batch)
  out = combined(program, results, m, concatenated)
  if m * program.microbatch_size == size:
    return out
  return jax.tree.map(lambda x: x[:size], out)


def program_for(
  pipe, fn, batch, what, microbatch: bool = False
) -> ForwardProgram:
  """``fn`` cut by the pipeline (None: the loss on its own stages),
  cached per function and per-example shapes of the batch (``microbatch``:
  ``batch`` is one microbatch, as ``cut_function`` takes it)."""
  if fn is None:  # (The loss's stages were traced for the example batch.)
    pipe.batch_spec.check(batch)
  examples = tuple(
    (np.shape(x) if microbatch else np.shape(x)[1:], stored_dtype(x))
    for x in jax.tree.leaves(batch)
  )
  key = (fn, jax.tree.structure(batch), examples, microbatch)
  program = pipe.forward_programs.get(key)
  if program is None:
    if fn is None:
      program = own_program(pipe)
    else:
      program = cut_function(pipe, fn, batch, what, microbatch)
    pipe.forward_programs[key] = program
  return program
