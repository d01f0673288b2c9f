"""The weight-version policy: which params each forward and backward uses.

=====================  ===========================  =========================
                       forward of microbatch b      backward (recompute)
=====================  ===========================  =========================
synchronous            current params               current params
stale (no mitigation)  current params               current params
weight stashing (ws)   current params               the forward's params
prediction (wp)        predict(current, state, d)   current params
ws + wp                predict(current, state, d)   the forward's (predicted)
ga_jfl                 as above                     current params
ga_from_grad           as above (none kept)         as above
2bw                    W(t-1) (minibatch t)         the forward's params
=====================  ===========================  =========================

Without recomputation (FTPipe's ``nr``) the backward starts from the
forward's saved residuals: every activation is the forward's, and the
params it reads are the ones in the table -- without stashing the current
ones, so a stale stage's weight gradient comes from the forward-time
activations and its input gradient from the current weights (PipeDream
without stashing; with stashing both are the forward's). ``d`` is the
delay: steps between the forward and the step applying its gradient.
"""

from typing import Any

from jpipe.schedule import Stream


class VersionPolicy:
  """Which params F(s, b) and B(s, b) use, and which versions to keep.

  Args:
    stream: the asynchronous stream rule, or None (synchronous: every
      action uses the current params).
    weight_stashing, prediction, gap_aware: the mitigations.
    record: keep every forward's params (to report them).
    nag_with_predictor: a forward of delay 0 is predicted one step ahead.
    unpredicted: stages whose forwards are never predicted (a last stage
      with its own optimizer, FTPipe's Nesterov last partition).
  """

  def __init__(
    self,
    stream: Stream | None,
    *,
    weight_stashing: bool = False,
    prediction: str | None = None,
    gap_aware: str | None = None,
    record: bool = False,
    nag_with_predictor: bool = False,
    unpredicted: frozenset[int] = frozenset(),
  ):
    self.stream = stream
    self.prediction = prediction
    self.nag_with_predictor = nag_with_predictor
    self.unpredicted = frozenset(unpredicted)
    stash = stream is not None and stream.backward_uses_stash
    self.backward_at_forward = stash or (
      weight_stashing and gap_aware != "ga_jfl"
    )
    # A backward, a Gap-Aware step or a report may need F's params later.
    self.keeps_forward_params = (
      self.backward_at_forward or gap_aware in ("ga", "ga_jfl") or record
    )

  def forward_version(self, s: int, b: int) -> int | None:
    """The stream step whose params F(s, b) starts from (None: current)."""
    if self.stream is None or not self.stream.backward_uses_stash:
      return None
    return self.stream.forward_version(s, b)

  def forward_params(self, s, b, current, versions, predict) -> Any:
    """F(s, b)'s params: its version (current, or 2BW's pinned one),
    predicted ``delay`` steps ahead with ``predict(theta, delay)`` when
    asked (a delay of 0 as 1 with ``nag_with_predictor``)."""
    version = self.forward_version(s, b)
    theta = current if version is None else versions[version]
    if self.prediction is None or self.stream is None or s in self.unpredicted:
      return theta
    delay = self.stream.delay(s, b)
    if delay == 0 and self.nag_with_predictor:
      delay = 1
    return theta if delay == 0 else predict(theta, delay)

  def backward_params(self, current, forward_theta) -> Any:
    """The params B(s, b) differentiates at (reads, without
    recomputation)."""
    if self.backward_at_forward:
      return forward_theta
    return current

  def same_backward_params(self, forward_theta, current) -> bool:
    """Whether B(s, b), run right after F(s, b), would use F's params."""
    if self.backward_at_forward:
      return True
    # It recomputes at the current params: the same unless F's were an
    # older or predicted version (identity: no step can intervene).
    return forward_theta is current

  def oldest_needed(self, s: int, next_forward: int, steps: int) -> int:
    """The oldest stream version a later forward of stage s may read
    (older ones can be dropped unless a stash holds them)."""
    version = self.forward_version(s, next_forward)
    return steps if version is None else min(version, steps)
