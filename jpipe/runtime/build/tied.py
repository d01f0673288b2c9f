"""Parameters read by several stages (tied embeddings).

Synchronous schedules replicate a tied leaf on every stage that reads it;
before the step every replica's gradient is replaced by the sum over all
of them, so every replica takes the same step.

Asynchronous ones give the leaf to the first stage that reads it (the
owner). A later stage (a replica holder) uses, for microbatch b, the value
the owner's forward of b used -- as if the version travelled with the
activations -- and hands its gradient to the owner's step that applies b.
Those two moves are the driver's transfers ("tied" and "tied_grad",
lowered to sends and receives across processes); this class says what
they carry.

``sum_replicas`` moves through the ``Transport`` itself: every process
calls it (None for values of stages it does not run), so the holders'
processes make the same moves in the same order.
"""

from jpipe.partition import Stages
from jpipe.runtime.build.grad_dtype import gradient_avals
from jpipe.runtime.build.stored_params import param_leaf, with_param_leaves


class TiedParams:
  """Who holds which tied leaf, and the exchanges between them.

  Args:
    stages: the built stages.
    transport: the pipeline's ``Transport``.
    grad_accum_dtype: the dtype gradients are summed in (None: the
      params' own), in which the tied leaves' gradients travel.
  """

  def __init__(self, stages: Stages, transport, grad_accum_dtype=None):
    self.transport = transport
    self.avals = stages.traced.closed_jaxpr.in_avals
    holders: dict[int, list[tuple[int, int]]] = {}
    for s, spec in enumerate(stages.specs):
      for pos, leaf in enumerate(spec.param_leaves):
        holders.setdefault(leaf, []).append((s, pos))
    # leaf -> [(stage, position)] for leaves several stages hold.
    self.shared = {k: v for k, v in holders.items() if len(v) > 1}
    # leaf -> its gradient's shape and dtype, for the shared leaves.
    self.grad_avals = dict(
      zip(
        self.shared,
        gradient_avals([self.avals[k] for k in self.shared], grad_accum_dtype),
        strict=True,
      )
    )
    self.stages = frozenset(s for hs in self.shared.values() for s, _ in hs)
    self.replicas = {}  # stage -> [(position, leaf, owner, owner position)]
    self.owned = {}  # owner -> [(position, leaf)]
    for leaf, ((owner, owner_pos), *others) in self.shared.items():
      self.owned.setdefault(owner, []).append((owner_pos, leaf))
      for h, pos in others:
        self.replicas.setdefault(h, []).append((pos, leaf, owner, owner_pos))

  def positions(self, s: int) -> tuple[int, ...]:
    """Positions of stage s's tied leaves (owned or replicas)."""
    return tuple(
      sorted(
        {pos for pos, _ in self.owned.get(s, ())} | self.replica_positions(s)
      )
    )

  def replica_positions(self, s: int) -> set[int]:
    """Positions of stage s's leaves that another stage owns."""
    return {pos for pos, *_ in self.replicas.get(s, ())}

  def replica_owner(self, s: int) -> int | None:
    """The earliest stage owning one of stage s's leaves (the longest
    delay a replica's value can have), or None."""
    owners = [owner for _, _, owner, _ in self.replicas.get(s, ())]
    return min(owners, default=None)

  def record(self, s, b, theta, tied):
    """Asynchronous, at F(s, b): an owner records in ``tied`` the value
    its forward of b used (a replica holder receives it: a "tied"
    transfer, owner -> holder, before the holder's F(s, b)). Returns s's
    params with the values tied (stored packed or leaves: tied leaves
    are kept apart, ``StoredParams``)."""
    for pos, leaf in self.owned.get(s, ()):
      tied.setdefault((leaf, b), param_leaf(theta, pos))
    return self.tied_values(s, b, theta, tied)

  def tied_values(self, s, b, theta, tied):
    """Stage s's params for microbatch b, tied leaves as tied at F(s, b)."""
    replicas = self.replicas.get(s)
    if not replicas:
      return theta
    place = self.transport.placement[s]
    return with_param_leaves(
      theta,
      {
        pos: place.put_replicated(tied[(leaf, b)])
        for pos, leaf, _, _ in replicas
      },
    )

  def release(self, s, microbatches, tied) -> None:
    """At stage s's step: forgets the values of applied microbatches it
    recorded (an owner) or received from another process (a holder)."""
    for b in microbatches:
      for _, leaf in self.owned.get(s, ()):
        tied.pop((leaf, b), None)
      for _, leaf, owner, _ in self.replicas.get(s, ()):
        if not self.transport.owns(owner):
          tied.pop((leaf, b), None)

  def replica_grads(self, s, grads) -> dict[int, object]:
    """Asynchronous, at stage s's step: ``{leaf: gradient}`` of the tied
    leaves s holds a replica of, for their owners (a "tied_grad"
    transfer each, holder -> owner: the owner's step that applies the
    same microbatches adds them)."""
    return {leaf: grads[pos] for pos, leaf, _, _ in self.replicas.get(s, ())}

  def replica_leaves(self, s) -> list[tuple[int, int]]:
    """``(position, leaf)`` of the tied leaves stage s holds a replica
    of (their gradients go to their owners)."""
    return [(pos, leaf) for pos, leaf, _, _ in self.replicas.get(s, ())]

  def owned_grads(self, s, b, tied_grads) -> dict[int, object]:
    """Asynchronous, at the step of owner s that applies microbatches up
    to b: ``{position: the holders' gradient}`` of its leaves, taken
    from ``tied_grads[(leaf, b)]`` (those that arrived)."""
    out = {}
    for pos, leaf in self.owned.get(s, ()):
      g = tied_grads.pop((leaf, b), None)
      if g is not None:
        out[pos] = g
    return out

  def add_owned(self, s, b, grads, tied_grads):
    """``owned_grads`` added to owner s's gradient leaves ``grads``."""
    grads = list(grads)
    for pos, g in self.owned_grads(s, b, tied_grads).items():
      grads[pos] = grads[pos] + g
    return tuple(grads)

  def sum_replicas(self, grads: dict[int, tuple]) -> dict[int, tuple]:
    """Synchronous: ``{stage: gradient leaves}`` of the tied stages this
    process runs -> the same, every replica of a tied leaf given the sum
    over all replicas (summed on the first holder, sent to the others)."""
    grads = {s: list(g) for s, g in grads.items()}
    for leaf, holders in self.shared.items():
      first = holders[0][0]
      total = None
      for s, pos in holders:
        g = self.transport.move(
          grads[s][pos] if s in grads else None,
          s,
          first,
          self.grad_avals[leaf],
          replicated=True,
        )
        if g is not None:
          total = g if total is None else total + g
      for s, pos in holders:
        y = self.transport.move(
          total, first, s, self.grad_avals[leaf], replicated=True
        )
        if s in grads:
          grads[s][pos] = y
    return {s: tuple(g) for s, g in grads.items()}
