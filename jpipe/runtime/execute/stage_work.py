"""One stage's share of a driver call: its compute actions F, B, I, W
and what its microbatches leave between them."""

import dataclasses
from typing import Any

from jpipe.runtime.execute import replica_state
from jpipe.runtime.execute.call_context import CallContext
from jpipe.runtime.execute.held_params import HeldParams
from jpipe.runtime.execute.in_flight import CallResult, InFlight
from jpipe.runtime.execute.stage_gradients import HeldParamsAndGradients


@dataclasses.dataclass(eq=False)
class StageWork(HeldParamsAndGradients):
  """Stage s in one call: its live params and optimizer state, its slice
  of the stream's ``InFlight`` and the call's own per-microbatch values.
  The methods named after actions run them; its optimizer steps run in
  ``UpdateRunner`` (``updates``), which changes the fields here.

  Attributes:
    s: the stage.
    d: the ``Driver`` (read only).
    ctx: the call's shared values.
    params: the live params, stored packed (``StoredParams``).
    opt_state: the stage's optimizer state.
    versions: ``{stream step: params}`` later forwards may still read.
    forward_params: ``b -> params`` F(s, b) used (the weight stash).
    saved: ``b ->`` what B(s, b) needs of its forward.
    grads: the gradient accumulator (None: none yet; per replica for a
      round-robin or weighted group).
    pending: microbatches whose backward ran, not yet applied.
    forwards, stream_steps: forwards run and steps taken in the stream.
    grad_sq_norm: the latest step's gradient's squared norm (clipping).
    held: the param versions held; updates: the call's ``UpdateRunner``.
    made_state: ``opt_state`` came from this call's steps (donatable).
    stepped: the next S ran in the program of the B before it.
    fused_done: ``b ->`` input cotangents of a B that ran with its F.
    kept: ``b ->`` what W(s, b) needs, once I(s, b) ran.
    acc_producer: ``replica ->`` the action behind its accumulator.
    peak, peak_bytes: param versions held at most, and their bytes.
    predictor: how a forward predicts its params (None: none does).
  """

  s: int
  d: Any
  ctx: CallContext
  params: Any
  opt_state: Any
  versions: dict
  forward_params: dict
  saved: dict
  grads: Any
  pending: list
  forwards: int
  stream_steps: int
  grad_sq_norm: Any
  held: HeldParams
  updates: Any = None
  made_state: bool = False
  stepped: bool = False
  fused_done: dict = dataclasses.field(default_factory=dict)
  kept: dict = dataclasses.field(default_factory=dict)
  acc_producer: dict = dataclasses.field(default_factory=dict)
  peak: int = 0
  peak_bytes: int = 0
  predictor: Any = None

  # -- compute actions -----------------------------------------------------

  def forward(self, action):
    d, ctx, s, b = self.d, self.ctx, self.s, action.microbatch
    spec, place = d.stages.specs[s], d.placement[s]
    self.forwards += 1
    own = d.policy.forward_params(
      s, b, self.params, self.versions, self.predictor
    )
    if place.round_robin:  # The replica's own copy of those params.
      own = place.on_replica(own, b)
    theta = own if d.stream is None else d.tied.record(s, b, own, ctx.tied)
    if d.policy.keeps_forward_params:
      self.forward_params[b] = theta
      self.held.take(theta)
      self.note_held()
    ctx.record("F", s, b, theta)
    acts = tuple(
      [
        ctx.take_activation(b, v) if here else ctx.inbox.pop((s, b, v))
        for v, here in d.inputs_placed[s]
      ]
    )
    if ctx.profiler and d.transport.multiprocess:
      ctx.record_remote(action, acts, d.remote_inputs[s][0])
    local = local_inputs(ctx, spec, ctx.batches[place][b], place, b)
    d.hooks.before_compute(action, (theta, local, acts))
    if (s, b) in ctx.fused and d.policy.same_backward_params(own, self.params):
      # Its backward needs only this forward: run both as one program.
      args = (theta, local, acts, self.result_cots())
      if self.steps_with(b):  # And the step after that backward.
        results, act_cots = self.updates.with_backward(
          "forward_backward", self, [b], args
        )
        acc = self.params  # What the profiler waits for.
      else:
        acc = self.acc(b)
        run = d.programs.forward_backward(s, acc is None)
        self.before_donating(b)
        results, acc, act_cots = run(acc, *args)
        self.set_acc(b, acc, action)
      outputs = ()
      self.fused_done[b] = act_cots  # Moved at B(s, b).
      ctx.record("B", s, b, theta)
    elif d.programs.recompute:
      outputs, results = d.programs.forward(s)(theta, local, acts)
      self.saved[b] = (local, acts)
    else:
      outputs, results, residuals = d.programs.forward(s)(theta, local, acts)
      self.saved[b] = residuals
    if ctx.profiler:  # A fused program ends with its accumulator.
      fused = acc if b in self.fused_done else ()
      ctx.profiler.record(action, (outputs, results, fused))
    self._keep(b, outputs, results)

  def _keep(self, b, outputs, results):
    """A forward's outputs of microbatch b, kept for their readers; its
    loss; its new model-state leaves (the next forward reads them); its
    aux outputs."""
    ctx = self.ctx
    j = self.d.placement[self.s].replica_index(b)  # Its replica's state.
    values, reads_left = ctx.values, ctx.reads_left
    for (v, readers), x in zip(
      self.d.outputs_read[self.s], outputs, strict=True
    ):
      values[(b, v)] = x
      reads_left[(b, v)] = readers
    first_aux = self.d.first_aux_result
    for r, x in zip(self.d.stages.specs[self.s].results, results, strict=True):
      if r == 0:
        ctx.losses.append(x)
      elif r < first_aux:
        ctx.keep_state(r - 1, j, x)
      else:
        ctx.aux.setdefault(r, []).append(x)

  def backward(self, action):
    b = action.microbatch
    if b in self.fused_done:  # Ran with its forward's program: an
      self.d.hooks.before_compute(action)
      act_cots = self.fused_done.pop(b)  # instant at its end.
      if not self.stepped:  # (Else its step ran there too.)
        self.pending.append(b)
      if self.ctx.profiler:
        self.ctx.profiler.record(action, ())
    else:
      self.pending.append(b)
      act_cots = self._backward(action)
    self._input_cotangents(b, act_cots)

  def _backward(self, action):
    """Runs B(s, b)'s program (with the step after it, where it may):
    returns its input cotangents."""
    d, s, b = self.d, self.s, action.microbatch
    args = self._backward_args(action)
    d.hooks.before_compute(action, args)
    if self.steps_with(b):
      (act_cots,) = self.updates.with_backward("backward", self, [b], args)
      acc = self.params  # What the profiler waits for.
    else:
      acc = self.acc(b)
      run = d.programs.backward(s, acc is None)
      self.before_donating(b)
      acc, act_cots = run(acc, *args)
      self.set_acc(b, acc, action)
    if self.ctx.profiler:
      self.ctx.profiler.record(action, (acc, act_cots))
    return act_cots

  def steps_with(self, b) -> bool:
    """Whether B(s, b)'s program runs the stage's next step too: the
    step follows it and applies it alone (no accumulator)."""
    return (
      (self.s, b) in self.ctx.fused_steps
      and self.d.steps_with_backward[self.s]
      and self.grads is None
    )

  def input_grad(self, action):
    """I(s, b): the first half of a split backward; its input cotangents
    move on, what W(s, b) needs stays."""
    d, b = self.d, action.microbatch
    args = self._backward_args(action)
    d.hooks.before_compute(action, args)
    act_cots, self.kept[b] = d.programs.input_grad(self.s)(*args)
    if self.ctx.profiler:
      self.ctx.profiler.record(action, (act_cots, self.kept[b]))
    self._input_cotangents(b, act_cots)

  def weight_grad(self, action):
    """W(s, b): the second half, its gradient into the accumulator."""
    d, b = self.d, action.microbatch
    self.pending.append(b)
    kept = self.kept.pop(b)
    d.hooks.before_compute(action, kept)
    acc = self.acc(b)
    run = d.programs.weight_grad(self.s, acc is None)
    self.before_donating(b)
    acc = run(acc, kept)
    self.set_acc(b, acc, action)
    if self.ctx.profiler:
      self.ctx.profiler.record(action, acc)

  def _backward_args(self, action) -> tuple:
    """The arguments of B(s, b)'s (or I(s, b)'s) program but the
    accumulator: the params it differentiates at (the version policy's),
    the saved inputs or residuals, the cotangents from the next stage."""
    d, ctx, s, b = self.d, self.ctx, self.s, action.microbatch
    spec = d.stages.specs[s]
    out_cots = tuple(ctx.cots.pop((b, v), None) for v in spec.outputs)
    if ctx.profiler and d.transport.multiprocess:
      ctx.record_remote(action, out_cots, d.remote_inputs[s][1])
    forward_theta = self.forward_params.get(b)
    theta = d.policy.backward_params(self.params, forward_theta)
    if d.placement[s].round_robin:
      theta = d.placement[s].on_replica(theta, b)
    if d.stream is not None:
      theta = d.tied.tied_values(s, b, theta, ctx.tied)
    if d.programs.recompute:
      local, acts = self.saved.pop(b)
      args = (theta, local, acts, out_cots, self.result_cots())
    else:  # The residuals, read with those params.
      args = (theta, self.saved.pop(b), out_cots, self.result_cots())
    ctx.record("B", s, b, theta)
    return args

  def _input_cotangents(self, b, act_cots):
    """B(s, b)'s (or I(s, b)'s) input cotangents, for their producers:
    added in where the producer runs on the same devices, else kept for
    their move."""
    ctx = self.ctx
    for (v, same), c in zip(
      self.d.inputs_placed[self.s], act_cots, strict=True
    ):
      if c is None:
        continue
      if same:
        ctx.add_cotangent(b, v, c)
      else:
        ctx.outbox[("B", self.s, b, v)] = c

  def result_cots(self):
    """Cotangents of the stage's results: the loss's weight in its step's
    mean (on its devices, unless a replica group deals microbatches or
    slices them: each replica's program reads its own); none for
    model-state outputs."""
    d = self.d
    results = d.stages.specs[self.s].results
    if not results:
      return ()
    place = d.placement[self.s]
    cot = self.ctx.loss_cotangent
    if not (place.round_robin or place.weighted):
      cot = d.device_scalar(self.s, cot)
    return tuple(cot if r == 0 else None for r in results)


def stage_works(driver, ctx, flight, stage_params, opt_states):
  """Every stage's ``StageWork``, from its slice of ``flight``: params
  stored packed while the call runs (``StoredParams``: every program
  takes and returns a few buffers instead of every leaf), as are the
  versions a new stream starts from."""
  stashed = flight.by_stage("forward_params")
  saved = flight.by_stage("saved")
  works = []
  for s, storage in enumerate(driver.param_storage):
    params = storage.stored(stage_params[s])
    versions = {k: storage.stored(v) for k, v in flight.versions[s].items()}
    held = HeldParams(
      storage.buffer_bytes, [*versions.values(), params, *stashed[s].values()]
    )
    work = StageWork(
      s,
      driver,
      ctx,
      params,
      opt_states[s],
      versions,
      stashed[s],
      saved[s],
      flight.grads[s],
      list(flight.pending[s]),
      flight.forwards[s],
      flight.stream_steps[s],
      flight.grad_sq_norms[s],
      held,
    )
    if driver.policy.prediction:  # How a forward predicts its params.
      work.predictor = predictor(work)
    work.note_held()
    works.append(work)
  return works


def call_result(driver, ctx, stages, fed, loss, aux=None) -> CallResult:
  """What the call produced (``loss``: its mean loss, ``aux``: its aux
  outputs' means (flat), shared)."""
  ctx.check_consumed({(w.s, b): k for w in stages for b, k in w.kept.items()})
  flight = InFlight(
    fed=fed,
    forwards=tuple(w.forwards for w in stages),
    stream_steps=tuple(w.stream_steps for w in stages),
    versions=tuple(w.versions for w in stages),
    forward_params={
      (w.s, b): t for w in stages for b, t in w.forward_params.items()
    },
    saved={(w.s, b): x for w in stages for b, x in w.saved.items()},
    cots=ctx.cots,
    grads=tuple(w.grads for w in stages),
    pending=tuple(tuple(w.pending) for w in stages),
    tied=ctx.tied,
    tied_grads=ctx.tied_grads,
    grad_sq_norms=tuple(w.grad_sq_norm for w in stages),
  )
  return CallResult(
    [
      storage.leaves(w.params, remember=True)
      for storage, w in zip(driver.param_storage, stages, strict=True)
    ],
    [w.opt_state for w in stages],
    ctx.model_state,
    flight,
    loss,
    [w.peak for w in stages],
    [w.peak_bytes for w in stages],
    ctx.used,
    replica_state.pack(
      ctx.replica_state, len(ctx.model_state), driver.state_replicas
    ),
    aux,
    ctx.step_skipped,
  )


def predictor(work: StageWork):
  """``(theta, delay) -> predicted params`` of ``work``'s stage (aggmsnag
  uses the gradient accumulated so far, unpacked inside the
  prediction)."""
  d, s = work.d, work.s
  opt = d.optimizers[s]

  def predict(theta, delay):
    delay = d.device_scalar(s, delay)
    acc = work.grads
    if d.policy.prediction == "aggmsnag" and acc is not None:
      return opt.predict_packed(theta, work.opt_state, delay, acc)
    return opt.predict(theta, work.opt_state, delay, None)

  return predict


def local_inputs(call, spec, batch_leaves, place, b):
  """A stage's batch inputs of microbatch b on its device(s) in ``call``
  (a driver's or a forward-only run's: ``call.d.num_batch_leaves``,
  ``call.state_leaf``): microbatch leaves (already there), then
  model-state leaves (placed here, whole; a round-robin group's on the
  replica that runs b, its own copy)."""
  nb = call.d.num_batch_leaves
  leaves = spec.batch_leaves
  if not leaves or leaves[-1] < nb:  # (Sorted: model state last.)
    return tuple([batch_leaves[i] for i in leaves])
  j = place.replica_index(b)
  if place.round_robin:
    place = place.replica(b)
  state = [call.state_leaf(i - nb, j) for i in leaves if i >= nb]
  state = iter(place.put_replicated(state) if state else ())
  return tuple(
    batch_leaves[i] if i < nb else next(state) for i in spec.batch_leaves
  )
