"""A stage's live params and gradient accumulators in a driver call:
the versions it holds (and their peak), and the accumulator each
backward adds to (the stage's, or a round-robin replica's), summed over
a replica group at the step.

A base class of ``StageWork`` (``stage_work.py``), whose fields are read
here: ``s``, ``d`` (the driver), ``ctx``, ``params``, ``held``,
``grads``, ``acc_producer``, ``peak`` and ``peak_bytes``.
"""

import jax


class HeldParamsAndGradients:
  """A stage's live params and gradient accumulators."""

  def note_held(self):
    """Raises the peaks of param versions and bytes held to now."""
    held = self.held
    self.peak = max(self.peak, held.count)
    self.peak_bytes = max(self.peak_bytes, held.nbytes)

  def set_params(self, params):
    """The live params are ``params`` from now."""
    self.held.replace(self.params, params)
    self.params = params

  def before_donating(self, b=0):
    """The accumulator B(s, b) adds to (the stage's; a round-robin
    replica's) is about to be donated: a profiler must have stamped the
    action that produced it first."""
    if not self.ctx.profiler:
      return
    producer = self.acc_producer.get(self._replica(b))
    if producer is not None:
      self.ctx.profiler.wait_for(producer)

  def _replica(self, b) -> int:  # (0: not a round-robin group)
    return self.d.placement[self.s].replica_index(b)

  def acc(self, b):
    """The gradient accumulator B(s, b) adds to (None: none yet): the
    stage's, or (round robin) its replica's, kept in ``grads`` as
    ``{replica: accumulator}``."""
    acc = self.grads
    if acc is None or not self.d.placement[self.s].round_robin:
      return acc
    return acc.get(self._replica(b))

  def set_acc(self, b, acc, action):
    """``acc`` as what B(s, b) added to, made by ``action`` (which a
    profiler stamps before the next donates it)."""
    if self.ctx.profiler:
      self.acc_producer[self._replica(b)] = action
    if self.d.placement[self.s].round_robin:  # A new dict: in-flight
      j = self._replica(b)  # state is shared with the last call.
      acc = {**(self.grads or {}), j: acc}
    self.grads = acc

  def gradient(self):
    """What the stage accumulated since its step: its accumulator, or a
    round-robin or weighted group's replicas' summed over the group."""
    place = self.d.placement[self.s]
    if place.weighted:  # A tuple per replica (None: took no examples).
      return place.sum_replicas(list(self.grads))
    if not place.round_robin:
      return self.grads
    accs = self.grads or {}  # (None: no replica here ran one.)
    return place.sum_replicas(
      [accs.get(j) for j in range(len(place.devices))], self._gradient_like()
    )

  def _gradient_like(self):
    """The accumulator's shapes and dtypes (its packed param leaves')."""
    d = self.d
    avals = d.stages.traced.closed_jaxpr.in_avals
    leaves = [
      jax.ShapeDtypeStruct(avals[i].shape, avals[i].dtype)
      for i in d.stages.specs[self.s].param_leaves
    ]
    return jax.eval_shape(d.programs.grad_layouts[self.s].pack, leaves)
