"""What a driver call takes over from the last and hands to the next (an
asynchronous stream's microbatches in flight), and what it returns."""

import dataclasses
from collections.abc import Sequence
from typing import Any


@dataclasses.dataclass(frozen=True)
class InFlight:
  """An asynchronous stream between calls: what its microbatches left
  behind. Microbatch indices count from the stream's start; a drained
  stream (``fed == 0``) holds nothing. A call works on its stages'
  slices (``StageWork``) and the shared dicts' copies (``CallContext``).

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

  fed: int
  forwards: tuple[int, ...]
  stream_steps: tuple[int, ...]
  versions: tuple[dict, ...]
  forward_params: dict
  saved: dict
  cots: dict
  grads: tuple
  pending: tuple[tuple[int, ...], ...]
  tied: dict
  tied_grads: dict
  grad_sq_norms: tuple

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

  def by_stage(self, field: str) -> list[dict]:
    """``{b: value}`` per stage of a field keyed ``(stage, b)``
    (``forward_params``, ``saved``)."""
    out = [{} for _ in self.forwards]
    for (s, b), x in getattr(self, field).items():
      out[s][b] = x
    return out


@dataclasses.dataclass
class CallResult:
  """What one call of the driver produced.

  Attributes:
    stage_params, opt_states, model_state, replica_model_state: the new
      values.
    in_flight: the stream's state for the next call.
    loss: the mean loss of the microbatches whose forward ran in the
      call, on every process (None if no forward ran).
    param_versions: per stage, the most param versions held at once.
    param_bytes: per stage, the most bytes of distinct param arrays held
      at once (versions share the arrays that did not change, e.g. a tied
      replica's own leaves).
    used_params: ``(kind, stage, b) -> params`` every F and B used (when
      recording; kind "F" or "B").
    aux: the means of the loss's aux outputs over the call's forwards
      (flat, ``call_results.aux_means``), on every process, or None.
    step_skipped: whether the synchronous step skipped (a device bool;
      None: no skipping asked for, or no stage here).
  """

  stage_params: list
  opt_states: list
  model_state: list
  in_flight: InFlight
  loss: Any
  param_versions: list
  param_bytes: list
  used_params: dict | None
  replica_model_state: tuple = ()
  aux: list | None = None
  step_skipped: Any = None
