"""The driver: what a pipeline's calls share (the lowering of each order,
the stages' inputs and transfers, device scalars); ``run`` executes one
call (``execute.dispatch``: each op to its stage's ``StageWork``, the
steps to the ``UpdateRunner``, the transfers to the ``CallContext``).

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
between two processes come in the same sequence (``build/transport.py``).

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

import math
from collections.abc import Sequence

import jax.numpy as jnp

from jpipe import schedule as schedule_lib
from jpipe.runtime.build.calls import shifted_ops
from jpipe.runtime.build.placement import StagePlacement
from jpipe.runtime.build.programs import StagePrograms
from jpipe.runtime.build.stage_optimizer import StageOptimizer
from jpipe.runtime.build.stored_params import StoredParams
from jpipe.runtime.build.tied import TiedParams
from jpipe.runtime.build.transport import Transport
from jpipe.runtime.build.versions import VersionPolicy
from jpipe.runtime.execute import replica_state, routes
from jpipe.runtime.execute.dispatch import run_call
from jpipe.runtime.execute.hooks import DriverHooks

FORWARD, BACKWARD, UPDATE, INPUT, WEIGHT = schedule_lib.ActionKind
SEND, RECV, MOVE = (
  schedule_lib.MoveKind.SEND,
  schedule_lib.MoveKind.RECV,
  schedule_lib.MoveKind.MOVE,
)
Transfer = schedule_lib.Transfer


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
    skip_nonfinite: synchronous steps whose global gradient is not
      finite are skipped (``Pipeline``'s ``skip_nonfinite_steps``).
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
    skip_nonfinite: bool = False,
    partial_window: str = "mean",
    param_storage: Sequence[StoredParams],
  ):
    """Holds the parts (Args above) and derives the routes."""
    self.clip_global_norm = clip_global_norm
    self.skip_nonfinite = skip_nonfinite
    self.param_storage = tuple(param_storage)
    self.partial_window = partial_window
    self.stages = stages
    self.programs = programs
    self.placement = tuple(placement)
    self.replica_rate = routes.replica_rates(self.placement, stream is not None)
    self.optimizers = tuple(optimizers)
    self.policy = policy
    self.tied = tied
    self.transport = transport
    self.stream = stream
    self.num_batch_leaves = num_batch_leaves
    self.record_params = record_params
    self.hooks = hooks or DriverHooks()
    # (id(base call), its shift's residue) -> (base call, ops, forwarded
    # stages, late owners' backwards).
    self._lowered = {}
    # The shifts that lower alike: those equal modulo every round-robin
    # group across processes' replica count.
    self._replica_period = math.lcm(
      *(len(r) for r in transport.replica_processes if r is not None)
    )
    self._scalars = {}  # (stage, type, number) -> it on the stage's devices
    self._derive_routes(stages, transport, stream, num_batch_leaves)

  def _derive_routes(self, stages, transport, stream, num_batch_leaves):
    """What the actions read, fixed by the stages and their placement:
    producers, remote and placed inputs, read outputs, which steps run
    with their backward, tied replicas, model-state readers and
    per-replica model-state leaves."""
    specs = stages.specs
    self.producer = {v: s for s, spec in enumerate(specs) for v in spec.outputs}
    self.remote_inputs = routes.remote_inputs(specs, self.producer, transport)
    self.inputs_placed = routes.inputs_placed(
      specs, self.placement, self.producer
    )
    self.outputs_read = routes.outputs_read(specs)
    self.steps_with_backward = routes.steps_with_backward(
      self.placement,
      stream is not None,
      plain=self.clip_global_norm is None
      and type(self.hooks).reduce_gradient is DriverHooks.reduce_gradient,
    )
    # Per stage: (position, leaf) of the tied leaves it holds a replica
    # of (read at every step).
    self.replica_leaves = tuple(
      tuple(self.tied.replica_leaves(s)) for s in range(len(specs))
    )
    avals = stages.traced.closed_jaxpr.in_avals
    first_state = stages.traced.num_param_leaves + num_batch_leaves
    self.state_avals = avals[first_state:]
    # Results: the loss, the model-state leaves, then aux outputs
    # (``build/loss_outputs.py``); each made by one stage.
    self.first_aux_result = 1 + len(self.state_avals)
    self.result_stage = {
      r: s for s, spec in enumerate(specs) for r in spec.results
    }
    self.state_readers = routes.state_readers(
      stages, transport, num_batch_leaves
    )
    # Model-state leaf -> replicas, of the leaves held per replica.
    self.state_replicas = replica_state.round_robin_leaves(
      specs, self.placement, num_batch_leaves, len(self.state_avals)
    )

  def lower(self, call) -> tuple[Sequence, frozenset]:
    """(this process's actions and moves of ``call``'s order, the stages
    with a forward in it: the last, a loss). The lowering of a
    call's ``base`` is cached (a stream repeats a few orders, shifted by
    its position): a shifted call gets the base's ops shifted, which
    costs ~1 µs an op against ~15 µs an op to lower."""
    ops, forwarded, _ = self._lowered_base(call.base, call.shift)
    return shifted_ops(ops, call.shift), forwarded

  def fused_steps(self, call) -> frozenset:
    """``call.fused_steps`` less a tied leaf owner's backwards that some
    holder's gradient (a "tied_grad" move or receive, which the owner's
    step adds) reaches only after them in this process's ops."""
    _, _, late = self._lowered_base(call.base, call.shift)
    if not late:
      return call.fused_steps
    shift = call.shift
    return call.fused_steps - {(s, b + shift) for s, b in late}

  def _lowered_base(self, base, shift=0):
    """(ops, forwarded stages, late owners' backwards) of a base call, to be
    shifted by ``shift`` microbatches (which matters only modulo the
    replicas of round-robin groups across processes: their replica of a
    microbatch runs it in its own process)."""
    residue = shift % self._replica_period
    # Keyed by identity (a call's hash would go through its whole order);
    # the entry holds its base, so the id stays its own.
    cached = self._lowered.get((id(base), residue))
    if cached is None:
      ops = schedule_lib.lower(
        base.order,
        self._transfers,
        self.transport.stage_processes,
        self.transport.process,
        made_by=_made_by if self.transport.sends_early else None,
        replica_process=(
          self.transport.replica_processes if self._replica_period > 1 else None
        ),
        shift=residue,
      )
      forwarded = frozenset(a.stage for a in base.order if a.kind == FORWARD)
      ops = [op for op in ops if not self._moves_in_place(op)]
      late = _late_tied_grads(ops, base.fused)
      cached = self._lowered[(id(base), residue)] = (
        base,
        ops,
        forwarded,
        late,
      )
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
        if 0 < r < self.first_aux_result
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

  # Runs this process's share of a call's actions (``run_call``: the
  # dispatcher; its first argument is this driver).
  run = run_call


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


def _made_by(action, transfer):
  """The action that makes a ``before`` transfer's value: an
  activation's, its producer's forward of the microbatch (a tied leaf's
  value is the owner's, sent where its reader is)."""
  if transfer.what == "F":
    return schedule_lib.Action(FORWARD, transfer.src, action.microbatch)
  return None
