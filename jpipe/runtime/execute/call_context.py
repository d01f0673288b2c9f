"""One driver call's inputs and the values its stages hand each other."""

import dataclasses
from typing import Any

from jpipe.runtime.execute.profiler import ActionProfiler
from jpipe.runtime.execute.transfer_ends import TransferEnds


@dataclasses.dataclass(eq=False)
class CallContext(TransferEnds):
  """What every stage of a call reads or leaves for another: the call's
  inputs, the values between stages (moved by the ``TransferEnds`` ops),
  and what the call gathers for its result.

  Attributes:
    d: the ``Driver`` (read only).
    batches: ``{placement: {b: {batch leaf index: array}}}``, placed.
    fused: ``(stage, b)`` whose backward may run with the forward.
    fused_steps: ``(stage, b)`` whose backward's program may end with the
      stage's next step (``Driver.fused_steps``).
    loss_cotangent: each microbatch's loss cotangent.
    loss_scale: the loss scale the cotangents hold, which each step
      divides its gradient by (1: none).
    profiler: records when each action ran, or None.
    model_state: the model-state leaves (each forward's new ones; of a
      round-robin stage's leaf, replica 0's copy).
    cots: ``(b, var) ->`` a cotangent waiting for its stage's backward.
    tied: ``(leaf, b) ->`` the tied leaf value the owner's F(b) used.
    tied_grads: ``(leaf, b) ->`` holders' gradients for the owner's step.
    values: ``(b, var) ->`` an activation, until its last reader ran
      (``reads_left``: readers still to take it).
    inbox: ``(s, b, var) ->`` an input of F(s, b), on s's devices.
    outbox: ``(what, s, b, value) ->`` what an action of stage s made for
      another stage (B's input cotangents, a step's tied gradients).
    losses: the losses of the call's last-stage forwards, in order.
    aux: ``result -> [values]``: the loss's aux outputs of the call's
      forwards, in order (``Pipeline(has_aux=True)``).
    used: ``(kind, s, b) -> params`` F and B used (None: not recorded).
    step_skipped: with ``skip_nonfinite_steps``, whether the call's
      synchronous step skipped (a device bool; None: not known here).
    replica_state: ``(leaf, j) ->`` replica j's (>= 1) copy of a
      round-robin stage's model-state leaf (``replica_state`` module).
  """

  d: Any
  batches: dict
  fused: frozenset
  fused_steps: frozenset
  loss_cotangent: float
  profiler: ActionProfiler | None
  model_state: list
  cots: dict
  tied: dict
  tied_grads: dict
  used: dict | None
  values: dict = dataclasses.field(default_factory=dict)
  reads_left: dict = dataclasses.field(default_factory=dict)
  inbox: dict = dataclasses.field(default_factory=dict)
  outbox: dict = dataclasses.field(default_factory=dict)
  losses: list = dataclasses.field(default_factory=list)
  aux: dict = dataclasses.field(default_factory=dict)
  replica_state: dict = dataclasses.field(default_factory=dict)
  step_skipped: Any = None
  loss_scale: float = 1.0

  def state_leaf(self, i: int, j: int):
    """Model-state leaf i as replica j of its stage holds it."""
    return self.model_state[i] if j == 0 else self.replica_state[(i, j)]

  def keep_state(self, i: int, j: int, x) -> None:
    """Replica j's new value of model-state leaf i."""
    if j == 0:
      self.model_state[i] = x
    else:
      self.replica_state[(i, j)] = x

  def record(self, kind, s, b, theta) -> None:
    """Notes the params ``theta`` that ``kind`` (F or B) of (s, b) used,
    when recording."""
    if self.used is not None:
      self.used[(kind, s, b)] = self.d.param_storage[s].leaves(theta)

  def record_remote(self, action, values, remote) -> None:
    """Tells the profiler when ``action``'s values that another process
    sent (``remote[i]``) arrive; nothing if none did."""
    sent = [
      x for x, r in zip(values, remote, strict=True) if r and x is not None
    ]
    if sent:
      self.profiler.record_inputs(action, sent)

  def check_consumed(self, kept: dict) -> None:
    """Every value made for a reader was read (``kept``: split
    backwards' values awaiting their W): else a schedule or lowering
    bug, not a user error."""
    left = {
      "activations never read": self.values,
      "inputs never used": self.inbox,
      "values never moved": self.outbox,
      "weight gradients never run": kept,
    }
    for what, store in left.items():
      if store:
        raise RuntimeError(f"{what}: {sorted(map(str, store))[:4]}")
