"""The optimizer steps of a driver call: a stream's step per stage (alone
or at the end of its backward's program), the synchronous steps after
every backward, global-norm clipping and the tied leaves' gradients."""

import dataclasses
from typing import Any

from jpipe.runtime.build.placement import put
from jpipe.runtime.execute import clipping
from jpipe.runtime.execute.call_context import CallContext
from jpipe.runtime.execute.hooks import DriverHooks
from jpipe.runtime.execute.stage_work import StageWork


@dataclasses.dataclass(eq=False)
class UpdateRunner:
  """Runs the S actions of one call over its stages' ``StageWork``.

  Attributes:
    d: the ``Driver`` (read only).
    ctx: the call's shared values.
    stages: every stage's ``StageWork``, by stage.
  """

  d: Any
  ctx: CallContext
  stages: list[StageWork]

  def stream_update(self, action):
    """An asynchronous step of stage s: the mean gradient of the
    backwards since its last step."""
    d, ctx, s, b = self.d, self.ctx, action.stage, action.microbatch
    work = self.stages[s]
    if work.stepped:  # Ran in its backward's program: an instant.
      work.stepped = False
      if ctx.profiler:
        ctx.profiler.record(action, ())
      return
    group, work.pending = work.pending, []
    stale, scale, update_scale = self._scales(work, group)
    # The packed accumulator, unpacked inside the step; a tied stage's
    # exchanges with its tied leaves' owners or holders go in the same
    # program where nothing reads the gradient in between, else before.
    g, packed = work.gradient(), True
    tied_in_step = s in d.tied.stages and clipping.plain_gradient(d)
    if s in d.tied.stages and not tied_in_step:
      leaves = d.programs.unpack(s)(g)
      for leaf, x in d.tied.replica_grads(s, leaves).items():
        ctx.outbox[("tied_grad", s, b, leaf)] = x
      g = d.tied.add_owned(s, b, leaves, ctx.tied_grads)
      packed = False
    if d.clip_global_norm is not None:
      g = d.hooks.reduce_gradient(s, g)
      # This stage's share of the norm is this step's gradient (as
      # applied: times ``scale``); the others' their latest step's.
      work.grad_sq_norm = clipping.grad_sq_norm(d, s, g) * (scale * scale)
      device = d.placement[s].device
      total = sum(
        put(w.grad_sq_norm, device)
        for w in self.stages
        if w.grad_sq_norm is not None
      )
      scale = scale * clipping.clip_factor(d, s, total)
    self._optimizer_step(
      work,
      g,
      packed,
      stale,
      scale,
      reduced=d.clip_global_norm is not None,
      update_scale=update_scale,
      tied_microbatch=b if tied_in_step else None,
    )
    self._after_step(work, group)
    if ctx.profiler:
      ctx.profiler.record(action, work.params)

  def with_backward(self, kind, work: StageWork, group, args) -> tuple:
    """Runs the stage's ``kind`` program (the backward of ``group``'s one
    microbatch, which the step applies) ending with the step; the step's
    S then only passes (``stepped``). Returns the program's head and
    input cotangents."""
    d, ctx, s = self.d, self.ctx, work.s
    stale, scale, update_scale = self._scales(work, group)
    replicas = d.replica_leaves[s]
    # An owner's holders' gradients of its tied leaves have all arrived
    # (``Driver.fused_steps``): added in the program, as its step would.
    added = d.tied.owned_grads(s, group[-1], ctx.tied_grads)
    positions = tuple(sorted(added))
    run = d.programs.with_step(
      kind,
      s,
      d.optimizers[s],
      work.made_state,
      tuple(pos for pos, _ in replicas),
      positions,
    )
    *head, params, work.opt_state, replica_grads, act_cots = run(
      work.opt_state,
      work.params,
      stale,
      d.device_scalar(s, scale),
      d.device_scalar(s, update_scale),
      tuple(added[p] for p in positions),
      *args,
    )
    work.made_state = True
    work.set_params(params)
    for (_, leaf), x in zip(replicas, replica_grads, strict=True):
      ctx.outbox[("tied_grad", s, group[-1], leaf)] = x
    work.pending = []
    self._after_step(work, group)
    work.stepped = True
    return (*head, act_cots)

  def synchronous(self, actions):
    """The steps of this process's stages after all backwards: tied
    leaves' gradients summed over their replicas (every process takes
    part), every replica taking the same step."""
    d, ctx, stages = self.d, self.ctx, self.stages
    tied = {}
    if d.tied.stages:
      tied = d.tied.sum_replicas(
        {
          a.stage: d.programs.unpack(a.stage)(stages[a.stage].grads)
          for a in actions
          if a.stage in d.tied.stages
        }
      )
    grads = {
      a.stage: tied[a.stage] if a.stage in tied else stages[a.stage].gradient()
      for a in actions
    }
    unscale = 1.0 / ctx.loss_scale
    scales = dict.fromkeys(grads, unscale)
    clip = d.clip_global_norm is not None or d.skip_nonfinite
    if clip:  # The gradients as applied, then their global norm.
      grads = {s: d.hooks.reduce_gradient(s, g) for s, g in grads.items()}
      scales = clipping.global_clip_factors(d, grads, unscale)
      if d.skip_nonfinite and scales:
        ctx.step_skipped = clipping.skipped(next(iter(scales.values())))
    for action in actions:
      s = action.stage
      work = stages[s]
      work.pending = []
      self._optimizer_step(
        work, grads[s], s not in tied, None, scales[s], reduced=clip
      )
      self._after_step_hook(work)
      if ctx.profiler:
        ctx.profiler.record(action, work.params)
      work.grads = None
    for work in stages:
      for params in work.forward_params.values():
        work.held.drop(params)
      work.forward_params.clear()

  def _scales(self, work: StageWork, group):
    """(stale params, gradient scale, update scale) of a stream step
    applying the microbatches of ``group``."""
    d, s = self.d, work.s
    opt = d.optimizers[s]
    stale = None
    if opt.gap_from_grad:  # How late: the estimate applies at delay 1.
      stale = d.device_scalar(s, int(d.stream.delay(s, group[-1])))
    elif opt.gap_aware:
      stale = work.forward_params[group[-1]]
    # Each loss cotangent was 1 / step_every: a short window (at a flush)
    # is rescaled to its own mean, or (FTPipe's) kept as the sum over
    # the stage's window and its update scaled by r / window.
    window = d.stream.window(s)
    scale, update_scale = d.stream.step_every / len(group), 1.0
    if d.partial_window == "ftpipe":
      scale = d.stream.step_every / window
      update_scale = len(group) / window
    # PipeDream's rate per stage with round-robin replicas: r_s / r_0.
    update_scale *= d.replica_rate[s]
    scale /= self.ctx.loss_scale  # (The loss cotangents were times it.)
    return stale, scale, update_scale

  def _after_step(self, work: StageWork, group):
    """The stage stepped over ``group``'s microbatches: its params through
    the hooks, its new version kept, the versions and stashes no later
    action reads released."""
    d, s = self.d, work.s
    self._after_step_hook(work)
    work.grads = None
    work.stream_steps += 1
    work.versions[work.stream_steps] = work.params
    held = work.held
    held.take(work.params)
    for m in group:
      if m in work.forward_params:
        held.drop(work.forward_params.pop(m))
    d.tied.release(s, group, self.ctx.tied)
    oldest = d.policy.oldest_needed(s, work.forwards, work.stream_steps)
    for v in [v for v in work.versions if v < oldest]:
      held.drop(work.versions.pop(v))

  def _after_step_hook(self, work: StageWork):
    """The hooks' ``after_step`` on the stage's new params (as leaves;
    none runs for the default hooks)."""
    d = self.d
    if type(d.hooks).after_step is DriverHooks.after_step:
      return
    storage = d.param_storage[work.s]
    leaves = storage.leaves(work.params)
    out = d.hooks.after_step(work.s, leaves)
    if out is not leaves:
      work.set_params(storage.stored(out))

  def _optimizer_step(
    self,
    work: StageWork,
    grads,
    packed,
    stale,
    scale,
    reduced=False,
    update_scale=1.0,
    tied_microbatch=None,
  ):
    """The stage's optimizer step from ``grads`` (the packed accumulator,
    or leaves): new ``params`` and ``opt_state``. A packed accumulator's
    own (big-leaf) buffers are donated to the step, and so is an
    optimizer state this call produced (the caller's own state is never
    consumed). ``reduced``: the hooks' ``reduce_gradient`` ran already.
    ``tied_microbatch``: a stream's tied stage steps its packed gradient
    with the holders' gradients of the leaves it owns added (those
    applying microbatches up to it) and hands its replicas' gradients to
    their owners, in the step's own program."""
    d, s = self.d, work.s
    opt = d.optimizers[s]
    if not reduced:
      grads = d.hooks.reduce_gradient(s, grads)
    args = (
      grads,
      work.opt_state,
      work.params,
      stale,
      d.device_scalar(s, scale),
      d.device_scalar(s, update_scale),
    )
    if packed and tied_microbatch is not None:
      work.before_donating()
      b, replicas = tied_microbatch, d.replica_leaves[s]
      *new, replica_grads = opt.update_packed_tied(
        grads,
        d.tied.owned_grads(s, b, self.ctx.tied_grads),
        [pos for pos, _ in replicas],
        *args[1:],
        donate_state=work.made_state,
      )
      for (_, leaf), x in zip(replicas, replica_grads, strict=True):
        self.ctx.outbox[("tied_grad", s, b, leaf)] = x
    elif packed:
      work.before_donating()
      new = opt.update_packed(*args, donate_state=work.made_state)
    else:
      new = opt.update(*args)
    work.set_params(new[0])
    work.opt_state = new[1]
    work.made_state = True
