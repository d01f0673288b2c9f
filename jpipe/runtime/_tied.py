"""Parameters read by several stages (tied embeddings).

Synchronous schedules replicate a tied leaf on every stage that reads it;
before the step every replica's gradient is replaced by the sum over all
of them, so every replica takes the same step.

Asynchronous ones give the leaf to the first stage that reads it (the
owner). A later stage (a replica holder) uses, for microbatch b, the value
the owner's forward of b used -- as if the version travelled with the
activations -- and hands its gradient to the owner's step that applies b.
"""

from jpipe.partition import Stages


class TiedParams:
  """Who holds which tied leaf, and the exchanges between them.

  Args:
    stages: the built stages.
    placement: each stage's ``StagePlacement``.
  """

  def __init__(self, stages: Stages, placement):
    self.placement = placement
    holders: dict[int, list[tuple[int, int]]] = {}
    for s, spec in enumerate(stages.specs):
      for pos, leaf in enumerate(spec.param_leaves):
        holders.setdefault(leaf, []).append((s, pos))
    # leaf -> [(stage, position)] for leaves several stages hold.
    self.shared = {k: v for k, v in holders.items() if len(v) > 1}
    self.stages = frozenset(s for hs in self.shared.values() for s, _ in hs)
    self.replicas = {}  # stage -> [(position, leaf, owner, owner position)]
    self.owned = {}  # owner -> [(position, leaf)]
    for leaf, ((owner, owner_pos), *others) in self.shared.items():
      self.owned.setdefault(owner, []).append((owner_pos, leaf))
      for h, pos in others:
        self.replicas.setdefault(h, []).append((pos, leaf, owner, owner_pos))

  def replica_positions(self, s: int) -> set[int]:
    """Positions of stage s's leaves that another stage owns."""
    return {pos for pos, *_ in self.replicas.get(s, ())}

  def tie(self, s, b, theta, tied):
    """Asynchronous: the owner records in ``tied`` the value its forward
    of b used; a replica holder gets that value for b."""
    for pos, leaf in self.owned.get(s, ()):
      tied.setdefault((leaf, b), theta[pos])
    replicas = self.replicas.get(s)
    if not replicas:
      return theta
    theta = list(theta)
    for pos, leaf, _, _ in replicas:
      theta[pos] = self.placement[s].put_replicated(tied[(leaf, b)])
    return tuple(theta)

  def release(self, s, microbatches, tied) -> None:
    """Forgets the owner's recorded values of applied microbatches."""
    for b in microbatches:
      for _, leaf in self.owned.get(s, ()):
        tied.pop((leaf, b), None)

  def exchange(self, s, step_index, grads, tied_grads):
    """Asynchronous, before stage s's step ``step_index``: a replica
    holder hands its gradient of the tied leaves to the owner (whose step
    of the same index applies the same microbatches); the owner adds the
    ones handed so far."""
    grads = list(grads)
    for pos, leaf, owner, _ in self.replicas.get(s, ()):
      g = self.placement[owner].put_replicated(grads[pos])
      key = (leaf, step_index)
      tied_grads[key] = g if key not in tied_grads else tied_grads[key] + g
    for pos, leaf in self.owned.get(s, ()):
      g = tied_grads.pop((leaf, step_index), None)
      if g is not None:
        grads[pos] = grads[pos] + g
    return tuple(grads)

  def sum_replicas(self, grads: dict[int, tuple]) -> dict[int, tuple]:
    """Synchronous: ``{stage: gradient leaves}`` of the stages holding
    tied leaves, every replica of a tied leaf given the sum over all
    replicas (placed on each holder's devices)."""
    grads = {s: list(g) for s, g in grads.items()}
    for holders in self.shared.values():
      total = None
      for s, pos in holders:
        g = self.placement[holders[0][0]].put_replicated(grads[s][pos])
        total = g if total is None else total + g
      for s, pos in holders:
        grads[s][pos] = self.placement[s].put_replicated(total)
    return {s: tuple(g) for s, g in grads.items()}
