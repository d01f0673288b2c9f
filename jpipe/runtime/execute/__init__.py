"""Executing a built pipeline's calls: the dispatcher issues each lowered
op to its stage's ``StageWork`` (F, B, I, W), the ``UpdateRunner`` (S) or
the ``CallContext`` (transfer ends); what a stream leaves between calls
is an ``InFlight``."""
