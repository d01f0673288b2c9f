"""A driver call's ends of the transfers between stages.

``jpipe.schedule.lower`` turns a call's order into this process's
compute actions and its ends of the transfers (``Transfer``: what moves,
from which stage to which); ``TransferEnds`` makes them: it takes the
value where the source's action left it and keeps it where the
destination's action reads it. What a transfer carries, by its
``what``:

- "F": an activation, before its reader's forward: from the producer's
  outputs (forgotten after its last reader) to the reader's inbox.
- "B": an input cotangent, after the backward that made it: from that
  backward's outbox, summed into the producer's cotangents.
- "state": a model-state leaf, after the forward that made it: from and
  to the process's model state.
- "tied": a tied leaf's value, before a replica holder's forward: the
  value the owner's forward of the microbatch used (``TiedParams``).
- "tied_grad": a holder's gradient of a tied leaf, after its step: from
  the step's outbox to the owner's step that applies the same
  microbatches.
"""


class TransferEnds:
  """The ops SEND, RECV and MOVE of a driver call (a base of the call,
  which holds the stores named here: ``values`` / ``reads_left``,
  ``inbox``, ``outbox``, ``cots``, ``model_state``, ``tied``,
  ``tied_grads``, and the driver ``d``)."""

  def send(self, op):
    """Sends a value of this process's stage to another process."""
    t = op.transfer
    self.d.transport.move(
      self._take(op), t.src, t.dst, seq=op.seq, **self._aval(t, op)
    )

  def receive(self, op):
    """Receives a value for this process's stage from another process."""
    t = op.transfer
    y = self.d.transport.move(
      None, t.src, t.dst, seq=op.seq, **self._aval(t, op)
    )
    self._put(op, y)

  def move(self, op):
    """Copies a value between two of this process's stages (to the
    replica that runs the microbatch, where dst is a round-robin
    group)."""
    t = op.transfer
    x = self._take(op)
    place = self.d.placement[t.dst]
    place = place.replica(op.action.microbatch) if place.round_robin else None
    self._put(
      op,
      self.d.transport.move(x, t.src, t.dst, place=place, **self._aval(t, op)),
    )

  def _aval(self, t, op) -> dict:
    """``Transport.move``'s shape and placement arguments for ``t`` (made
    at ``op``: a round-robin end's replica is its microbatch's)."""
    if t.what in ("F", "B"):  # Split like the microbatch.
      return {"aval": t.value.aval, "microbatch": op.action.microbatch}
    if t.what == "state":
      return {"aval": self.d.state_avals[t.value], "replicated": True}
    if t.what == "tied_grad":  # (In the accumulated gradient's dtype.)
      return {"aval": self.d.tied.grad_avals[t.value], "replicated": True}
    return {"aval": self.d.tied.avals[t.value], "replicated": True}

  def take_activation(self, b, v):
    """Activation ``v`` of microbatch b for one of its readers (forgotten
    after its last reader took it)."""
    key = (b, v)
    x = self.values[key]
    self.reads_left[key] -= 1
    if not self.reads_left[key]:
      del self.values[key], self.reads_left[key]
    return x

  def add_cotangent(self, b, v, y):
    """A reader's cotangent of activation ``v`` of microbatch b, summed
    over its readers in the order they arrive."""
    key = (b, v)
    self.cots[key] = y if key not in self.cots else self.cots[key] + y

  def _take(self, op):
    """The value ``op`` carries, at its source."""
    t, b = op.transfer, op.action.microbatch
    if t.what == "F":
      return self.take_activation(b, t.value)
    if t.what == "state":
      return self.model_state[t.value]
    if t.what == "tied":
      return self.tied[(t.value, b)]
    return self.outbox.pop((t.what, t.src, b, t.value))

  def _put(self, op, y):
    """Keeps the value ``op`` carried, at its destination."""
    t, b = op.transfer, op.action.microbatch
    if t.what == "F":
      self.inbox[(t.dst, b, t.value)] = y
    elif t.what == "B":  # Summed over the stages that read the value.
      self.add_cotangent(b, t.value, y)
    elif t.what == "state":
      self.model_state[t.value] = y
    elif t.what == "tied":
      self.tied[(t.value, b)] = y
    else:  # "tied_grad": for the owner's step that applies b.
      key = (t.value, b)
      old = self.tied_grads.get(key)
      self.tied_grads[key] = y if old is None else old + y
