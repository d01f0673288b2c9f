"""The driver: executes a call's actions, one method per kind of op.

A call's global issue order (``issue_order``) is first lowered to this
process's ops (``jpipe.schedule.lower``, cached per order): the compute
actions of its own stages (F, B, S) and its end of every transfer
between stages that it takes part in -- SEND where it runs the source
stage, RECV where it runs the destination, MOVE where it runs both (a
copy between its devices). Activations move before their reader's
forward, input cotangents after the backward that computes them (also
when that backward ran fused with its forward), model-state leaves after
the forward that produces them, a tied leaf's value before a holder's
forward and a holder's tied gradient after its step (``_transfers``).
Every process lowers the same order, so the two ends of every transfer
between two processes come in the same sequence (``_transport.py``).

A stream's step that applies the one backward right before it runs in
that backward's program (``Call.fused_steps``, where the step reads
nothing but the gradient: ``Driver.steps_with_backward``; a tied leaf's
owner also its holders' gradients of the leaf, where they all arrive
before its backward: ``Driver.fused_steps``); its S op then only passes.

The driver dispatches the ops and never waits: JAX dispatches
asynchronously, so the devices run concurrently while the host moves
on. What a call leaves unfinished -- an asynchronous stream's in-flight
microbatches -- is returned in an ``InFlight`` and picked up by the next
call.
"""

import dataclasses
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp

from jpipe import schedule as schedule_lib
from jpipe.runtime._calls import shifted_ops
from jpipe.runtime._held_params import HeldParams
from jpipe.runtime._placement import StagePlacement, put
from jpipe.runtime._profiler import ActionProfiler
from jpipe.runtime._programs import StagePrograms
from jpipe.runtime._stage_optimizer import StageOptimizer
from jpipe.runtime._stored_params import StoredParams
from jpipe.runtime._tied import TiedParams
from jpipe.runtime._transfer_ends import TransferEnds
from jpipe.runtime._transport import Transport
from jpipe.runtime._versions import VersionPolicy

FORWARD, BACKWARD, STEP, INPUT, WEIGHT = schedule_lib.ActionKind
SEND, RECV, MOVE = schedule_lib.MoveKind
Transfer = schedule_lib.Transfer


class DriverHooks:
  """What a layer above may do around a driver's actions; these defaults
  do nothing. Several pipelines in data parallel (``jpipe.parallel``)
  synchronise replicas of a stage and inject simulated delays here. A
  driver calls them only for the stages its process runs.
  """

  def before_compute(self, action: schedule_lib.Action, inputs=()) -> None:
    """Before a forward or backward (or I, W) is dispatched, with the
    values its program reads (``inputs``: a pytree of arrays, some still
    arriving from other devices; empty for a backward that ran fused
    with its forward)."""

  def reduce_gradient(self, stage: int, grads: Any) -> Any:
    """A stage's gradient (packed accumulator or leaves) before its step:
    returns the gradient the step applies."""
    return grads

  def after_step(self, stage: int, params: tuple) -> tuple:
    """A stage's params after its step: returns the params it keeps."""
    return params


def _copied(thaw, freeze=None):
  """An ``InFlight`` field copied by ``thaw`` for a call to change, and
  by ``freeze`` (default: ``thaw``) back into the frozen value. Fields
  are required: the metadata is all this sets."""
  return dataclasses.field(metadata={"thaw": thaw, "freeze": freeze or thaw})


@dataclasses.dataclass(frozen=True)
class InFlight:
  """An asynchronous stream between calls: what its microbatches left
  behind. Microbatch indices count from the stream's start; a drained
  stream (``fed == 0``) holds nothing.

  Attributes:
    fed: microbatches fed into the stream so far.
    forwards: per stage, forwards run in the stream.
    stream_steps: per stage, steps taken in the stream.
    versions: per stage, ``{stream step: params}`` that later forwards may
      still read (2BW's W(t-1); the current params are the last).
    forward_params: ``(stage, b) -> params`` F(s, b) used, while its
      backward or a Gap-Aware step still needs them (the weight stash).
    saved: ``(stage, b) ->`` what B(s, b) needs of its forward (inputs to
      recompute from, or residuals).
    cots: ``(b, var) ->`` a cotangent waiting for its stage's backward.
    grads: per stage, its packed gradient accumulator (or None).
    pending: per stage, microbatches whose backward ran, not yet applied.
    tied: ``(leaf, b) ->`` the tied leaf value the owner's F(b) used.
    tied_grads: ``(leaf, b) ->`` replica holders' gradients for the
      owner's step that applies microbatches up to b.
    grad_sq_norms: per stage, the squared L2 norm of the gradient its
      latest step applied (None before its first; kept with gradient
      clipping only: the other stages' share of a step's global norm).
  """

  fed: int = _copied(int)
  forwards: tuple[int, ...] = _copied(list, tuple)
  stream_steps: tuple[int, ...] = _copied(list, tuple)
  versions: tuple[dict, ...] = _copied(lambda vs: [dict(v) for v in vs], tuple)
  forward_params: dict = _copied(dict)
  saved: dict = _copied(dict)
  cots: dict = _copied(dict)
  grads: tuple = _copied(list, tuple)
  pending: tuple[tuple[int, ...], ...] = _copied(
    lambda ps: [list(p) for p in ps], lambda ps: tuple(map(tuple, ps))
  )
  tied: dict = _copied(dict)
  tied_grads: dict = _copied(dict)
  grad_sq_norms: tuple = _copied(list, tuple)

  def thawed(self) -> dict:
    """``{field: a mutable copy}`` for a call to work on."""
    return {
      f.name: f.metadata["thaw"](getattr(self, f.name))
      for f in dataclasses.fields(self)
    }

  @classmethod
  def frozen(cls, working: dict) -> "InFlight":
    """The InFlight of ``thawed``'s fields as a call left them (other
    keys of ``working`` are ignored)."""
    return cls(
      **{
        f.name: f.metadata["freeze"](working[f.name])
        for f in dataclasses.fields(cls)
      }
    )

  @classmethod
  def start(cls, stage_params: Sequence[Any]) -> "InFlight":
    """A new stream from the current params."""
    n = len(stage_params)
    return cls(
      fed=0,
      forwards=(0,) * n,
      stream_steps=(0,) * n,
      versions=tuple({0: p} for p in stage_params),
      forward_params={},
      saved={},
      cots={},
      grads=(None,) * n,
      pending=((),) * n,
      tied={},
      tied_grads={},
      grad_sq_norms=(None,) * n,
    )

  @property
  def drained(self) -> bool:
    """Nothing in flight: no pending backward, step or stashed value."""
    return not (
      self.saved
      or self.cots
      or self.forward_params
      or self.tied_grads
      or any(self.pending)
      or any(g is not None for g in self.grads)
    )


@dataclasses.dataclass
class CallResult:
  """What one call of the driver produced.

  Attributes:
    stage_params, opt_states, model_state: the new values.
    in_flight: the stream's state for the next call.
    loss: the mean loss of the microbatches whose forward ran in the
      call, on every process (None if no forward ran).
    param_versions: per stage, the most param versions held at once.
    param_bytes: per stage, the most bytes of distinct param arrays held
      at once (versions share the arrays that did not change, e.g. a tied
      replica's own leaves).
    used_params: ``(kind, stage, b) -> params`` every F and B used (when
      recording; kind "F" or "B").
  """

  stage_params: list
  opt_states: list
  model_state: list
  in_flight: InFlight
  loss: Any
  param_versions: list
  param_bytes: list
  used_params: dict | None


class Driver:
  """Executes action lists over a pipeline's stages.

  Args:
    stages: the built ``jpipe.partition.Stages``.
    programs: their compiled programs.
    placement: each stage's ``StagePlacement``.
    optimizers: each stage's ``StageOptimizer``.
    policy: the weight-version policy.
    tied: tied-parameter ownership.
    transport: moves values between stages (and processes).
    stream: the asynchronous stream rule, or None (synchronous: the steps
      come after every action, with tied gradients summed).
    num_batch_leaves: leaves of a batch (model-state leaves follow them
      among a stage's batch inputs).
    record_params: report the params every action used.
    hooks: called around the actions (None: none).
    clip_global_norm: the global gradient norm steps clip to (None:
      no clipping; ``Pipeline``'s argument).
    partial_window: how a stream steps a window a flush cut short
      ("mean" or "ftpipe", ``Staleness.partial_window``).
    param_storage: per stage, how its params are stored while a call
      runs (``StoredParams``: packed, converted at the call's ends).
  """

  def __init__(
    self,
    stages,
    programs: StagePrograms,
    placement: Sequence[StagePlacement],
    optimizers: Sequence[StageOptimizer],
    policy: VersionPolicy,
    tied: TiedParams,
    transport: Transport,
    stream: schedule_lib.Stream | None,
    *,
    num_batch_leaves: int,
    record_params: bool = False,
    hooks: DriverHooks | None = None,
    clip_global_norm: float | None = None,
    partial_window: str = "mean",
    param_storage: Sequence[StoredParams],
  ):
    self.clip_global_norm = clip_global_norm
    self.param_storage = tuple(param_storage)
    self.partial_window = partial_window
    self.stages = stages
    self.programs = programs
    self.placement = tuple(placement)
    # PipeDream's learning rate per stage with round-robin replicas
    # (1F1B-RR, asynchronous): base rate x r_s / r_0, so every stage
    # moves as far per microbatch; synchronous steps keep one rate.
    counts = [len(p.devices) for p in self.placement]
    round_robin = any(p.round_robin for p in self.placement)
    self.replica_rate = tuple(
      c / counts[0] if round_robin and stream is not None else 1.0
      for c in counts
    )
    self.optimizers = tuple(optimizers)
    self.policy = policy
    self.tied = tied
    self.transport = transport
    self.stream = stream
    self.num_batch_leaves = num_batch_leaves
    self.record_params = record_params
    self.hooks = hooks or DriverHooks()
    self._lowered = {}  # id(base call) -> (base call, ops, makes a loss)
    self._scalars = {}  # (stage, type, number) -> it on the stage's devices
    self.producer = {
      v: s for s, spec in enumerate(stages.specs) for v in spec.outputs
    }
    self.readers = {}  # var -> how many stages read it
    for spec in stages.specs:
      for v in spec.inputs:
        self.readers[v] = self.readers.get(v, 0) + 1
    # Per stage: which of its inputs (read by F) and of its outputs'
    # cotangents (read by B and I) another process sends -- what a
    # profile stamps the arrival of (``ActionProfiler.record_inputs``).
    self.remote_inputs = _remote_inputs(stages.specs, self.producer, transport)
    # Per stage: its inputs, each with whether it comes from a stage on
    # the same devices. Moving those would copy nothing: F reads them
    # where their producer left them and B adds their cotangents straight
    # in, with no MOVE op between (~14 µs of Python each, 448 a step at
    # p = 8, m = 32 on one device).
    self.inputs_placed = tuple(
      tuple(
        (v, _same_place(self.placement[self.producer[v]], self.placement[s]))
        for v in spec.inputs
      )
      for s, spec in enumerate(stages.specs)
    )
    # Per stage: its outputs, each with how many stages read it.
    self.outputs_read = tuple(
      tuple((v, self.readers.get(v, 0)) for v in spec.outputs)
      for spec in stages.specs
    )
    avals = stages.traced.closed_jaxpr.in_avals
    # Per stage: whether a stream's step may run in the program of the
    # backward before it (``Call.fused_steps``), a third fewer programs
    # per microbatch: where the step reads the accumulated gradient as it
    # is (no clipping, no hooks reducing it), on one device or an SPMD
    # group. A holder of tied leaves hands their gradients on from the
    # same program; an owner adds its holders' (``fused_steps``: only
    # where they all arrive before its backward runs).
    plain = clip_global_norm is None and (
      type(self.hooks).reduce_gradient is DriverHooks.reduce_gradient
    )
    self.steps_with_backward = tuple(
      stream is not None and plain and not (p.round_robin or p.weighted)
      for p in self.placement
    )
    # Per stage: (position, leaf) of the tied leaves it holds a replica
    # of (read at every step).
    self.replica_leaves = tuple(
      tuple(tied.replica_leaves(s)) for s in range(len(stages.specs))
    )
    first_state = stages.traced.num_param_leaves + num_batch_leaves
    self.state_avals = avals[first_state:]
    self.state_readers = _state_readers(stages, transport, num_batch_leaves)

  def lower(self, call) -> tuple[Sequence, bool]:
    """(this process's actions and moves of ``call``'s order, whether the
    order makes a loss: a forward of the last stage). The lowering of a
    call's ``base`` is cached (a stream repeats a few orders, shifted by
    its position): a shifted call gets the base's ops shifted, which
    costs ~1 µs an op against ~15 µs an op to lower."""
    ops, makes_loss, _ = self._lowered_base(call.base)
    return shifted_ops(ops, call.shift), makes_loss

  def fused_steps(self, call) -> frozenset:
    """``call.fused_steps`` less a tied leaf owner's backwards that some
    holder's gradient (a "tied_grad" move or receive, which the owner's
    step adds) reaches only after them in this process's ops."""
    _, _, late = self._lowered_base(call.base)
    if not late:
      return call.fused_steps
    shift = call.shift
    return call.fused_steps - {(s, b + shift) for s, b in late}

  def _lowered_base(self, base):
    """(ops, makes a loss, late owners' backwards) of a base call."""
    # Keyed by identity (a call's hash would go through its whole order);
    # the entry holds its base, so the id stays its own.
    cached = self._lowered.get(id(base))
    if cached is None:
      ops = schedule_lib.lower(
        base.order,
        self._transfers,
        self.transport.stage_process,
        self.transport.process,
        made_by=_made_by if self.transport.sends_early else None,
      )
      last = len(self.stages.specs) - 1
      makes_loss = any(
        a.kind == FORWARD and a.stage == last for a in base.order
      )
      ops = [op for op in ops if not self._moves_in_place(op)]
      late = _late_tied_grads(ops, base.fused)
      cached = self._lowered[id(base)] = (base, ops, makes_loss, late)
    return cached[1:]

  def device_scalar(self, s, number):
    """``number`` (a Python int or float a program of stage s takes: a
    loss cotangent, a step's scale, a prediction's delay) as an array on
    the stage's devices, weakly typed as the number is (the same program
    runs, to the bit); anything else (an array, a bool) passes through.
    A number argument is converted and copied at every call -- ~6 µs of
    the host's time per call, against ~0.8 µs for an array in place."""
    kind = type(number)
    if kind is not float and kind is not int:
      return number
    key = (s, kind, number)
    x = self._scalars.get(key)
    if x is None:
      if len(self._scalars) > 1024:  # Scales of short windows: a few.
        self._scalars.clear()
      x = jnp.asarray(number)
      x = self._scalars[key] = self.placement[s].put_replicated(x)
    return x

  def _moves_in_place(self, op) -> bool:
    """Whether ``op`` is an activation's or input cotangent's MOVE
    between two stages on the same devices (which F and B do
    themselves)."""
    if op.kind != MOVE or op.transfer.what not in ("F", "B"):
      return False
    t = op.transfer
    reader, v = (t.dst, t.value) if t.what == "F" else (t.src, t.value)
    i = self.stages.specs[reader].inputs.index(v)
    return self.inputs_placed[reader][i][1]

  def _transfers(self, action):
    """(before, after): the values ``action`` moves between stages."""
    s = action.stage
    spec = self.stages.specs[s]
    if action.kind == FORWARD:
      tied = []
      if self.stream is not None:  # The owner's value of the tied leaf.
        tied = [
          Transfer("tied", owner, s, leaf)
          for _, leaf, owner, _ in self.tied.replicas.get(s, ())
        ]
      inputs = [Transfer("F", self.producer[v], s, v) for v in spec.inputs]
      states = [
        Transfer("state", s, reader, r - 1)
        for r in spec.results
        if r > 0
        for reader in self.state_readers[r - 1]
      ]
      return tied + inputs, states
    if action.kind in (BACKWARD, INPUT):  # Its input cotangents.
      diff = self.stages.differentiable_inputs(s)
      cots = [
        Transfer("B", s, self.producer[v], v)
        for v, differentiable in zip(spec.inputs, diff, strict=True)
        if differentiable
      ]
      return (), cots
    if action.kind == WEIGHT or self.stream is None:
      # A W stays on its stage; synchronous steps: ``sum_replicas`` moves.
      return (), ()
    return (), [
      Transfer("tied_grad", s, owner, leaf)
      for _, leaf, owner, _ in self.tied.replicas.get(s, ())
    ]

  def run(
    self,
    work,
    *,
    stage_params,
    opt_states,
    model_state,
    in_flight: InFlight,
    batches: dict,
    loss_cotangent: float,
    profiler: ActionProfiler | None = None,
  ) -> CallResult:
    """Runs this process's share of the actions of ``work``.

    Args:
      work: the call's work (a ``Call`` or ``ShiftedCall``): its actions
        in issue order (every process's) and the ``(stage, b)`` pairs
        whose backward may run with the forward.
      stage_params, opt_states, model_state: the state before the call.
      in_flight: the stream's state (``InFlight.start`` for a call of a
        synchronous schedule).
      batches: ``{placement: {b: {batch leaf index: array}}}``: the
        microbatches entering in this call, placed.
      loss_cotangent: each microbatch's loss cotangent: 1 / microbatches
        its step averages over.
      profiler: records when each action ran, if given.
    """
    call = _Call(self, stage_params, opt_states, model_state, in_flight)
    call.batches, call.fused, call.profiler = batches, work.fused, profiler
    call.fused_steps = self.fused_steps(work)
    call.loss_cotangent = loss_cotangent
    # Synchronous steps wait for every backward (tied gradients are
    # summed over all stages first).
    deferred_steps = []
    methods = {
      FORWARD: call.forward,
      BACKWARD: call.backward,
      INPUT: call.input_grad,
      WEIGHT: call.weight_grad,
      STEP: call.step if self.stream is not None else deferred_steps.append,
      SEND: call.send,
      RECV: call.receive,
      MOVE: call.move,
    }
    ops, shares_loss = self.lower(work)
    self.transport.begin_call()
    if jax.profiler.TraceAnnotation.is_enabled():
      # Each op a span in the jax.profiler trace being taken, so it shows
      # where the host's time goes per kind of action.
      for op in ops:
        with jax.profiler.TraceAnnotation(_trace_name(op)):
          methods[op.kind](op)
    else:  # (Naming and entering spans cost ~2 µs an op.)
      for op in ops:
        methods[op.kind](op)
    if self.stream is None:
      with jax.profiler.TraceAnnotation("jpipe.S synchronous"):
        call.synchronous_steps(deferred_steps)
    return call.result(self._mean_loss(call.losses) if shares_loss else None)

  def _mean_loss(self, losses):
    """The mean of a call's losses (computed by the last stage: the
    list is empty where another process runs it), shared with every
    process."""
    last = len(self.stages.specs) - 1
    place = self.placement[last]
    if place.round_robin:  # Each replica's on its own device.
      losses = [put(x, place.device) for x in losses]
    loss = _mean(losses) if losses else None
    if not self.transport.multiprocess:
      return loss
    dtype = self.stages.traced.jaxpr.outvars[0].aval.dtype
    return self.transport.share(loss, last, jax.ShapeDtypeStruct((), dtype))


def _late_tied_grads(ops, fused) -> frozenset:
  """(owner, b) whose backward comes before the arrival of a holder's
  gradient of a tied leaf it owns for microbatch b (a "tied_grad" MOVE
  or RECV among ``ops``; ``fused``: pairs whose F runs their B). Its
  step must wait for it: it stays apart from the backward."""
  ran = {}  # (stage, b) -> index of the op running its backward
  late = set()
  for i, op in enumerate(ops):
    if isinstance(op, schedule_lib.Move):
      t = op.transfer
      if t.what == "tied_grad" and op.kind != SEND:
        key = (t.dst, op.action.microbatch)
        if key in ran:
          late.add(key)
    elif op.kind == BACKWARD or (
      op.kind == FORWARD and (op.stage, op.microbatch) in fused
    ):
      ran[(op.stage, op.microbatch)] = i
  return frozenset(late)


def _trace_name(op) -> str:
  """An op's span name in a profiler's trace: ``jpipe.KIND s=S b=B``
  (KIND an action's letter, F B S I W, or a transfer end's SEND / RECV /
  MOVE with what it carries: ``jpipe.MOVE_F 0->1 b=3``). No colon: the
  profiler drops spans named ``a:b``."""
  if isinstance(op, schedule_lib.Move):
    t = op.transfer
    return f"jpipe.{op.kind}_{t.what} {t.src}->{t.dst} b={op.action.microbatch}"
  return f"jpipe.{op.kind} s={op.stage} b={op.microbatch}"


def _made_by(action, transfer):
  """The action that makes a ``before`` transfer's value: an
  activation's, its producer's forward of the microbatch (a tied leaf's
  value is the owner's, sent where its reader is)."""
  if transfer.what == "F":
    return schedule_lib.Action(FORWARD, transfer.src, action.microbatch)
  return None


def _same_place(a: StagePlacement, b: StagePlacement) -> bool:
  """Whether a value of a stage placed at ``a`` is already where a stage
  placed at ``b`` reads it (neither deals microbatches to replicas)."""
  return a == b and not a.round_robin and not b.round_robin


def _remote_inputs(specs, producer, transport) -> tuple:
  """Per stage s: (per input of s, whether another process's stage makes
  it; per output of s, whether a stage of another process reads it, and
  so sends its cotangent)."""
  process = transport.stage_process
  reader_processes = {}
  for r, spec in enumerate(specs):
    for v in spec.inputs:
      reader_processes.setdefault(v, set()).add(process[r])
  return tuple(
    (
      tuple(process[producer[v]] != process[s] for v in spec.inputs),
      tuple(
        bool(reader_processes.get(v, set()) - {process[s]})
        for v in spec.outputs
      ),
    )
    for s, spec in enumerate(specs)
  )


def _state_readers(stages, transport, num_batch_leaves) -> list[tuple]:
  """Per model-state leaf: per process other than its producer's, the
  first stage there that reads it (it is sent there whenever the
  producer updates it)."""
  producer_of_result = {
    r: s for s, spec in enumerate(stages.specs) for r in spec.results
  }
  num_leaves = len(stages.traced.closed_jaxpr.in_avals) - (
    stages.traced.num_param_leaves + num_batch_leaves
  )
  out = []
  for i in range(num_leaves):
    src = producer_of_result.get(i + 1)
    readers = {}
    for s, spec in enumerate(stages.specs):
      if num_batch_leaves + i in spec.batch_leaves:
        readers.setdefault(transport.stage_process[s], s)
    if src is not None:
      readers.pop(transport.stage_process[src], None)
    out.append(tuple(readers.values()))
  return out


class _Call(TransferEnds):
  """One call's working state: the in-flight state's fields as mutable
  copies (``InFlight.thawed``: fed, forwards, stream_steps, versions,
  forward_params, saved, cots, grads, pending, tied, tied_grads), plus
  what the call produces. Its public methods are the kinds of the
  lowered ops: a compute action of one of this process's stages
  (``forward``, ``backward``, ``step``), or this process's end of a
  transfer (``send``, ``receive``, ``move``: ``TransferEnds``). Counters
  are kept for this process's stages."""

  def __init__(self, driver, stage_params, opt_states, model_state, flight):
    # The run's inputs (set by Driver.run): this call's placed
    # microbatches, fusable pairs, profiler and loss cotangent.
    self.batches, self.fused, self.profiler = {}, frozenset(), None
    self.fused_steps = frozenset()
    self.loss_cotangent = 1.0
    self.d = driver
    # Params stored packed while the call runs (``StoredParams``): every
    # program takes and returns a few buffers instead of every leaf.
    storage = driver.param_storage
    self.params = [
      st.stored(p) for st, p in zip(storage, stage_params, strict=True)
    ]
    self.opt_states = list(opt_states)
    self.model_state = list(model_state)
    vars(self).update(flight.thawed())
    # A new stream's versions are the leaves it started from.
    for st, versions in zip(storage, self.versions, strict=True):
      for k, v in versions.items():
        versions[k] = st.stored(v)
    self.values = {}  # (b, var) -> activation, until its last reader ran
    self.reads_left = {}
    self.inbox = {}  # (s, b, var) -> an input of F(s, b), on s's devices
    # (what, s, b, value) -> what an action of stage s made for another
    # stage: B's input cotangents, a step's tied gradients.
    self.outbox = {}
    # (s, b) whose B ran with F -> its input cotangents, until B(s, b).
    self.fused_done = {}
    # (s, b) whose I ran -> what its W needs, until W(s, b).
    self.kept = {}
    # Stages whose next S ran in the program of the B before it.
    self.stepped = set()
    # (s, replica) -> the action behind that accumulator (``_set_acc``;
    # when profiling).
    self.acc_producer = {}
    # Whether opt_states[s] came from this call's steps (donatable).
    self.made_state = [False] * len(self.params)
    self.losses = []
    self.used = {} if driver.record_params else None
    self.peak = [0] * len(self.params)  # Param versions held at most,
    self.peak_bytes = [0] * len(self.params)  # and their bytes.
    # Per stage: how a forward predicts its params (None: none does).
    self.predictors = [
      _predictor(self, s) if driver.policy.prediction else None
      for s in range(len(self.params))
    ]
    # Per stage: what it holds now (versions, live, stashed).
    self.held = [
      HeldParams(
        nbytes,
        [
          *self.versions[s].values(),
          self.params[s],
          *(t for (s_, _), t in self.forward_params.items() if s_ == s),
        ],
      )
      for s, nbytes in enumerate(st.buffer_bytes for st in storage)
    ]
    for s in range(len(self.params)):
      self._note_held(s)

  # -- compute actions -----------------------------------------------------

  def forward(self, action):
    d, s, b = self.d, action.stage, action.microbatch
    spec, place = d.stages.specs[s], d.placement[s]
    self.forwards[s] += 1
    own = d.policy.forward_params(
      s, b, self.params[s], self.versions[s], self.predictors[s]
    )
    if place.round_robin:  # The replica's own copy of those params.
      own = place.on_replica(own, b)
    theta = own if d.stream is None else d.tied.record(s, b, own, self.tied)
    if d.policy.keeps_forward_params:
      self.forward_params[(s, b)] = theta
      self.held[s].take(theta)
      self._note_held(s)
    self._record("F", s, b, theta)
    acts = tuple(
      [
        self.take_activation(b, v) if here else self.inbox.pop((s, b, v))
        for v, here in d.inputs_placed[s]
      ]
    )
    if self.profiler and d.transport.multiprocess:
      self._record_remote(action, acts, d.remote_inputs[s][0])
    local = local_inputs(self, spec, self.batches[place][b], place)
    d.hooks.before_compute(action, (theta, local, acts))
    if (s, b) in self.fused and d.policy.same_backward_params(
      own, self.params[s]
    ):
      # Its backward needs only this forward: run both as one program.
      args = (theta, local, acts, self._result_cots(s))
      if self._steps_with(s, b):  # And the step after that backward.
        results, act_cots = self._backward_and_step(
          "forward_backward", s, [b], args
        )
        acc = self.params[s]  # What the profiler waits for.
      else:
        acc = self._acc(s, b)
        run = d.programs.forward_backward(s, acc is None)
        self._before_donating(s, b)
        results, acc, act_cots = run(acc, *args)
        self._set_acc(s, b, acc, action)
      outputs = ()
      self.fused_done[(s, b)] = act_cots  # Moved at B(s, b).
      self._record("B", s, b, theta)
    elif d.programs.recompute:
      outputs, results = d.programs.forward(s)(theta, local, acts)
      self.saved[(s, b)] = (local, acts)
    else:
      outputs, results, residuals = d.programs.forward(s)(theta, local, acts)
      self.saved[(s, b)] = residuals
    if self.profiler:  # A fused program ends with its accumulator.
      fused = acc if (s, b) in self.fused_done else ()
      self.profiler.record(action, (outputs, results, fused))
    self._keep(s, b, outputs, results)

  def _keep(self, s, b, outputs, results):
    """A forward's outputs of microbatch b, kept for their readers; its
    loss; its new model-state leaves (the next forward reads them)."""
    values, reads_left = self.values, self.reads_left
    for (v, readers), x in zip(self.d.outputs_read[s], outputs, strict=True):
      values[(b, v)] = x
      reads_left[(b, v)] = readers
    for r, x in zip(self.d.stages.specs[s].results, results, strict=True):
      if r == 0:
        self.losses.append(x)
      else:
        self.model_state[r - 1] = x

  def backward(self, action):
    d, s, b = self.d, action.stage, action.microbatch
    if (s, b) in self.fused_done:  # Ran with its forward's program: an
      d.hooks.before_compute(action)
      act_cots = self.fused_done.pop((s, b))  # instant at its end.
      if s not in self.stepped:  # (Else its step ran there too.)
        self.pending[s].append(b)
      if self.profiler:
        self.profiler.record(action, ())
    else:
      self.pending[s].append(b)
      act_cots = self._backward(action)
    self._input_cotangents(s, b, act_cots)

  def _backward(self, action):
    """Runs B(s, b)'s program (with the step after it, where it may):
    returns its input cotangents."""
    d, s, b = self.d, action.stage, action.microbatch
    args = self._backward_args(action)
    d.hooks.before_compute(action, args)
    if self._steps_with(s, b):
      (act_cots,) = self._backward_and_step("backward", s, [b], args)
      acc = self.params[s]  # What the profiler waits for.
    else:
      acc = self._acc(s, b)
      run = d.programs.backward(s, acc is None)
      self._before_donating(s, b)
      acc, act_cots = run(acc, *args)
      self._set_acc(s, b, acc, action)
    if self.profiler:
      self.profiler.record(action, (acc, act_cots))
    return act_cots

  def _steps_with(self, s, b) -> bool:
    """Whether B(s, b)'s program runs the stage's next step too: the
    step follows it and applies it alone (no accumulator)."""
    return (
      (s, b) in self.fused_steps
      and self.d.steps_with_backward[s]
      and self.grads[s] is None
    )

  def _backward_and_step(self, kind, s, group, args) -> tuple:
    """Runs stage s's ``kind`` program (the backward of ``group``'s one
    microbatch, which the step applies) ending with the step; the step's
    S then only passes (``stepped``). Returns the program's head and
    input cotangents."""
    d = self.d
    stale, scale, update_scale = self._step_scales(s, group)
    replicas = d.replica_leaves[s]
    # An owner's holders' gradients of its tied leaves have all arrived
    # (``Driver.fused_steps``): added in the program, as its step would.
    added = d.tied.owned_grads(s, group[-1], self.tied_grads)
    positions = tuple(sorted(added))
    run = d.programs.with_step(
      kind,
      s,
      d.optimizers[s],
      self.made_state[s],
      tuple(pos for pos, _ in replicas),
      positions,
    )
    *head, params, self.opt_states[s], replica_grads, act_cots = run(
      self.opt_states[s],
      self.params[s],
      stale,
      d.device_scalar(s, scale),
      d.device_scalar(s, update_scale),
      tuple(added[p] for p in positions),
      *args,
    )
    self.made_state[s] = True
    self._set_params(s, params)
    for (_, leaf), x in zip(replicas, replica_grads, strict=True):
      self.outbox[("tied_grad", s, group[-1], leaf)] = x
    self.pending[s] = []
    self._after_step(s, group)
    self.stepped.add(s)
    return (*head, act_cots)

  def input_grad(self, action):
    """I(s, b): the first half of a split backward; its input cotangents
    move on, what W(s, b) needs stays."""
    d, s, b = self.d, action.stage, action.microbatch
    args = self._backward_args(action)
    d.hooks.before_compute(action, args)
    act_cots, self.kept[(s, b)] = d.programs.input_grad(s)(*args)
    if self.profiler:
      self.profiler.record(action, (act_cots, self.kept[(s, b)]))
    self._input_cotangents(s, b, act_cots)

  def weight_grad(self, action):
    """W(s, b): the second half, its gradient into the accumulator."""
    d, s, b = self.d, action.stage, action.microbatch
    self.pending[s].append(b)
    kept = self.kept.pop((s, b))
    d.hooks.before_compute(action, kept)
    acc = self._acc(s, b)
    run = d.programs.weight_grad(s, acc is None)
    self._before_donating(s, b)
    acc = run(acc, kept)
    self._set_acc(s, b, acc, action)
    if self.profiler:
      self.profiler.record(action, acc)

  def _backward_args(self, action) -> tuple:
    """The arguments of B(s, b)'s (or I(s, b)'s) program but the
    accumulator: the params it differentiates at (the version policy's),
    the saved inputs or residuals, the cotangents from the next stage."""
    d, s, b = self.d, action.stage, action.microbatch
    spec = d.stages.specs[s]
    out_cots = tuple(self.cots.pop((b, v), None) for v in spec.outputs)
    if self.profiler and d.transport.multiprocess:
      self._record_remote(action, out_cots, d.remote_inputs[s][1])
    forward_theta = self.forward_params.get((s, b))
    theta = d.policy.backward_params(self.params[s], forward_theta)
    if d.placement[s].round_robin:
      theta = d.placement[s].on_replica(theta, b)
    if d.stream is not None:
      theta = d.tied.tied_values(s, b, theta, self.tied)
    if d.programs.recompute:
      local, acts = self.saved.pop((s, b))
      args = (theta, local, acts, out_cots, self._result_cots(s))
    else:  # The residuals, read with those params.
      args = (theta, self.saved.pop((s, b)), out_cots, self._result_cots(s))
    self._record("B", s, b, theta)
    return args

  def step(self, action):
    """An asynchronous step of stage s: the mean gradient of the
    backwards since its last step."""
    d, s, b = self.d, action.stage, action.microbatch
    if s in self.stepped:  # Ran in its backward's program: an instant.
      self.stepped.discard(s)
      if self.profiler:
        self.profiler.record(action, ())
      return
    group, self.pending[s] = self.pending[s], []
    stale, scale, update_scale = self._step_scales(s, group)
    # The packed accumulator, unpacked inside the step; a tied stage's
    # exchanges with its tied leaves' owners or holders go in the same
    # program where nothing reads the gradient in between, else before.
    g, packed = self._stage_gradient(s), True
    tied_in_step = s in d.tied.stages and self._plain_gradient
    if s in d.tied.stages and not tied_in_step:
      leaves = d.programs.unpack(s)(g)
      for leaf, x in d.tied.replica_grads(s, leaves).items():
        self.outbox[("tied_grad", s, b, leaf)] = x
      g = d.tied.add_owned(s, b, leaves, self.tied_grads)
      packed = False
    if d.clip_global_norm is not None:
      g = d.hooks.reduce_gradient(s, g)
      # This stage's share of the norm is this step's gradient (as
      # applied: times ``scale``); the others' their latest step's.
      own = self._grad_sq_norm(s, g) * (scale * scale)
      self.grad_sq_norms[s] = own
      device = d.placement[s].device
      total = sum(put(x, device) for x in self.grad_sq_norms if x is not None)
      scale = scale * self._clip_factor(s, total)
    self._optimizer_step(
      s,
      g,
      packed,
      stale,
      scale,
      reduced=d.clip_global_norm is not None,
      update_scale=update_scale,
      tied_microbatch=b if tied_in_step else None,
    )
    self._after_step(s, group)
    if self.profiler:
      self.profiler.record(action, self.params[s])

  def _step_scales(self, s, group):
    """(stale params, gradient scale, update scale) of stage s's stream
    step applying the microbatches of ``group``."""
    d = self.d
    opt = d.optimizers[s]
    stale = self.forward_params[(s, group[-1])] if opt.gap_aware else None
    # Each loss cotangent was 1 / step_every: a short window (at a flush)
    # is rescaled to its own mean, or (FTPipe's) kept as the sum over
    # the stage's window and its update scaled by r / window.
    window = d.stream.window(s)
    scale, update_scale = d.stream.step_every / len(group), 1.0
    if d.partial_window == "ftpipe":
      scale = d.stream.step_every / window
      update_scale = len(group) / window
    # PipeDream's rate per stage with round-robin replicas: r_s / r_0.
    update_scale *= d.replica_rate[s]
    return stale, scale, update_scale

  def _after_step(self, s, group):
    """Stage s stepped over ``group``'s microbatches: its params through
    the hooks, its new version kept, the versions and stashes no later
    action reads released."""
    d = self.d
    self._after_step_hook(s)
    self.grads[s] = None
    self.stream_steps[s] += 1
    self.versions[s][self.stream_steps[s]] = self.params[s]
    held = self.held[s]
    held.take(self.params[s])
    for m in group:
      if (s, m) in self.forward_params:
        held.drop(self.forward_params.pop((s, m)))
    d.tied.release(s, group, self.tied)
    oldest = d.policy.oldest_needed(s, self.forwards[s], self.stream_steps[s])
    for v in [v for v in self.versions[s] if v < oldest]:
      held.drop(self.versions[s].pop(v))

  def synchronous_steps(self, actions):
    """The steps of this process's stages after all backwards: tied
    leaves' gradients summed over their replicas (every process takes
    part), every replica taking the same step."""
    d = self.d
    tied = {}
    if d.tied.stages:
      tied = d.tied.sum_replicas(
        {
          a.stage: d.programs.unpack(a.stage)(self.grads[a.stage])
          for a in actions
          if a.stage in d.tied.stages
        }
      )
    grads = {
      a.stage: tied[a.stage]
      if a.stage in tied
      else self._stage_gradient(a.stage)
      for a in actions
    }
    scales = dict.fromkeys(grads, 1.0)
    clip = d.clip_global_norm is not None
    if clip:  # The gradients as applied, then their global norm.
      grads = {s: d.hooks.reduce_gradient(s, g) for s, g in grads.items()}
      scales = self._global_clip_factors(grads)
    for action in actions:
      s = action.stage
      self.pending[s] = []
      self._optimizer_step(
        s, grads[s], s not in tied, None, scales[s], reduced=clip
      )
      self._after_step_hook(s)
      if self.profiler:
        self.profiler.record(action, self.params[s])
      self.grads[s] = None
    for (s, _), params in self.forward_params.items():
      self.held[s].drop(params)
    self.forward_params.clear()

  # -- helpers -------------------------------------------------------------

  def result(self, loss) -> CallResult:
    """What the call produced (``loss``: its mean loss, shared)."""
    left = {
      "activations never read": self.values,
      "inputs never used": self.inbox,
      "values never moved": self.outbox,
      "weight gradients never run": self.kept,
    }
    for what, store in left.items():
      if store:  # A schedule or lowering bug, not a user error.
        raise RuntimeError(f"{what}: {sorted(map(str, store))[:4]}")
    storage = self.d.param_storage
    return CallResult(
      [
        st.leaves(p, remember=True)
        for st, p in zip(storage, self.params, strict=True)
      ],
      self.opt_states,
      self.model_state,
      InFlight.frozen(vars(self)),
      loss,
      self.peak,
      self.peak_bytes,
      self.used,
    )

  def _note_held(self, s):
    """Raises stage s's peaks of param versions and bytes held to now."""
    held = self.held[s]
    self.peak[s] = max(self.peak[s], held.count)
    self.peak_bytes[s] = max(self.peak_bytes[s], held.nbytes)

  def _after_step_hook(self, s):
    """The hooks' ``after_step`` on stage s's new params (as leaves; none
    runs for the default hooks)."""
    d = self.d
    if type(d.hooks).after_step is DriverHooks.after_step:
      return
    storage = d.param_storage[s]
    leaves = storage.leaves(self.params[s])
    out = d.hooks.after_step(s, leaves)
    if out is not leaves:
      self._set_params(s, storage.stored(out))

  def _set_params(self, s, params):
    """Stage s's live params are ``params`` from now."""
    self.held[s].replace(self.params[s], params)
    self.params[s] = params

  def _input_cotangents(self, s, b, act_cots):
    """B(s, b)'s (or I(s, b)'s) input cotangents, for their producers:
    added in where the producer runs on the same devices, else kept for
    their move."""
    for (v, same), c in zip(self.d.inputs_placed[s], act_cots, strict=True):
      if c is None:
        continue
      if same:
        self.add_cotangent(b, v, c)
      else:
        self.outbox[("B", s, b, v)] = c

  def _record_remote(self, action, values, remote):
    """Tells the profiler when ``action``'s values that another process
    sent (``remote[i]``) arrive; nothing if none did."""
    sent = [
      x for x, r in zip(values, remote, strict=True) if r and x is not None
    ]
    if sent:
      self.profiler.record_inputs(action, sent)

  def _record(self, kind, s, b, theta):
    if self.used is not None:
      self.used[(kind, s, b)] = self.d.param_storage[s].leaves(theta)

  def _result_cots(self, s):
    """Cotangents of stage s's results: the loss's weight in its step's
    mean (on its devices, unless a replica group deals microbatches or
    slices them: each replica's program reads its own); none for
    model-state outputs."""
    d = self.d
    results = d.stages.specs[s].results
    if not results:
      return ()
    place = d.placement[s]
    cot = self.loss_cotangent
    if not (place.round_robin or place.weighted):
      cot = d.device_scalar(s, cot)
    return tuple(cot if r == 0 else None for r in results)

  def _global_clip_factors(self, grads: dict) -> dict:
    """``{stage: its gradient's factor}`` for this process's synchronous
    steps: ``min(1, clip / global norm)``, the norm over every stage's
    gradient (``grads``: this process's, reduced), summed per process and
    then over processes (every process calls it, in step order)."""
    d = self.d
    if not grads:
      partial = None
    else:
      first = min(grads)
      device = d.placement[first].device
      partial = sum(
        put(self._grad_sq_norm(s, g), device) for s, g in sorted(grads.items())
      )
    total = d.transport.all_sum(partial)
    return {s: self._clip_factor(s, total) for s in grads}

  def _grad_sq_norm(self, s, grads):
    """Squared L2 norm of stage s's gradient (the packed accumulator or
    leaves), f32 on its device; a tied leaf counted by its owner only."""
    d = self.d
    replica = d.tied.replica_positions(s)
    if replica:
      grads = [g for p, g in enumerate(grads) if p not in replica]
    return _sq_norm(tuple(grads))

  def _clip_factor(self, s, total_sq):
    """``min(1, clip / sqrt(total_sq))`` on stage s's devices."""
    factor = _clip_factor(total_sq, self.d.clip_global_norm)
    return self.d.placement[s].put_replicated(factor)

  @property
  def _plain_gradient(self) -> bool:
    """Whether a stream's step reads its gradient as accumulated: no
    clipping and no hooks reducing it (data parallel)."""
    d = self.d
    return d.clip_global_norm is None and (
      type(d.hooks).reduce_gradient is DriverHooks.reduce_gradient
    )

  def _optimizer_step(
    self,
    s,
    grads,
    packed,
    stale,
    scale,
    reduced=False,
    update_scale=1.0,
    tied_microbatch=None,
  ):
    """Stage s's optimizer step from ``grads`` (the packed accumulator, or
    leaves): new ``params[s]`` and ``opt_states[s]``. A packed
    accumulator's own (big-leaf) buffers are donated to the step, and so
    is an optimizer state this call produced (the caller's own state is
    never consumed). ``reduced``: the hooks' ``reduce_gradient`` ran
    already. ``tied_microbatch``: a stream's tied stage steps its packed
    gradient with the holders' gradients of the leaves it owns added
    (those applying microbatches up to it) and hands its replicas'
    gradients to their owners, in the step's own program."""
    d, opt = self.d, self.d.optimizers[s]
    if not reduced:
      grads = d.hooks.reduce_gradient(s, grads)
    args = (
      grads,
      self.opt_states[s],
      self.params[s],
      stale,
      d.device_scalar(s, scale),
      d.device_scalar(s, update_scale),
    )
    if packed and tied_microbatch is not None:
      self._before_donating(s)
      b, replicas = tied_microbatch, d.replica_leaves[s]
      *new, replica_grads = opt.update_packed_tied(
        grads,
        d.tied.owned_grads(s, b, self.tied_grads),
        [pos for pos, _ in replicas],
        *args[1:],
        donate_state=self.made_state[s],
      )
      for (_, leaf), x in zip(replicas, replica_grads, strict=True):
        self.outbox[("tied_grad", s, b, leaf)] = x
    elif packed:
      self._before_donating(s)
      new = opt.update_packed(*args, donate_state=self.made_state[s])
    else:
      new = opt.update(*args)
    self._set_params(s, new[0])
    self.opt_states[s] = new[1]
    self.made_state[s] = True

  def _before_donating(self, s, b=0):
    """The accumulator B(s, b) adds to (the stage's; a round-robin
    replica's) is about to be donated: a profiler must have stamped the
    action that produced it first."""
    if not self.profiler:
      return
    producer = self.acc_producer.get((s, self._replica(s, b)))
    if producer is not None:
      self.profiler.wait_for(producer)

  def _replica(self, s, b) -> int:
    """The replica of stage s that runs microbatch b (0: not a
    round-robin group)."""
    return self.d.placement[s].replica_index(b)

  def _acc(self, s, b):
    """The gradient accumulator B(s, b) adds to (None: none yet): the
    stage's, or (round robin) its replica's, kept in ``grads[s]`` as
    ``{replica: accumulator}``."""
    acc = self.grads[s]
    if acc is None or not self.d.placement[s].round_robin:
      return acc
    return acc.get(self._replica(s, b))

  def _set_acc(self, s, b, acc, action):
    """``acc`` as what B(s, b) added to, made by ``action`` (which a
    profiler stamps before the next donates it)."""
    if self.profiler:
      self.acc_producer[(s, self._replica(s, b))] = action
    if self.d.placement[s].round_robin:  # A new dict: in-flight state
      j = self._replica(s, b)  # is shared with the last call.
      acc = {**(self.grads[s] or {}), j: acc}
    self.grads[s] = acc

  def _stage_gradient(self, s):
    """What stage s accumulated since its step: its accumulator, or a
    round-robin or weighted group's replicas' summed over the group."""
    place = self.d.placement[s]
    if place.weighted:  # A tuple per replica (None: took no examples).
      return place.sum_replicas(list(self.grads[s]))
    if not place.round_robin:
      return self.grads[s]
    accs = self.grads[s]
    return place.sum_replicas([accs.get(j) for j in range(len(place.devices))])


@jax.jit
def _mean(losses):
  """The mean of a list of scalars, as one program: eagerly, stacking m
  losses dispatched m + 2 ops (~2.5 ms a step at m = 32 on a CPU)."""
  return jnp.mean(jnp.stack(losses))


@jax.jit
def _sq_norm(leaves):
  """Sum of squares of every element of ``leaves``, in f32."""
  return sum(jnp.sum(jnp.square(x.astype(jnp.float32))) for x in leaves)


@jax.jit
def _clip_factor(total_sq, clip):
  """``optax.clip_by_global_norm``'s factor: 1 below ``clip``, else
  clip / norm."""
  norm = jnp.sqrt(total_sq)
  return jnp.where(norm < clip, 1.0, clip / norm)


def _predictor(call, s):
  """``(theta, delay) -> predicted params`` of stage s in ``call`` (a
  ``_Call``; aggmsnag uses the gradient accumulated so far, unpacked
  inside the prediction)."""
  opt = call.d.optimizers[s]

  def predict(theta, delay):
    delay = call.d.device_scalar(s, delay)
    acc = call.grads[s]
    if call.d.policy.prediction == "aggmsnag" and acc is not None:
      return opt.predict_packed(theta, call.opt_states[s], delay, acc)
    return opt.predict(theta, call.opt_states[s], delay, None)

  return predict


def local_inputs(call, spec, batch_leaves, place):
  """A stage's batch inputs on its device(s) in ``call`` (a driver's or a
  forward-only run's: ``call.d.num_batch_leaves``, ``call.model_state``):
  microbatch leaves (already there), then model-state leaves (placed
  here, whole)."""
  nb = call.d.num_batch_leaves
  leaves = spec.batch_leaves
  if not leaves or leaves[-1] < nb:  # (Sorted: model state last.)
    return tuple([batch_leaves[i] for i in leaves])
  state = [call.model_state[i - nb] for i in leaves if i >= nb]
  state = iter(place.put_replicated(state) if state else ())
  return tuple(
    batch_leaves[i] if i < nb else next(state) for i in spec.batch_leaves
  )
