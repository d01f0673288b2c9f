"""The compiled programs of a pipeline's stages, built once and cached.

Stage forwards come jitted from ``jpipe.partition.Stages``; this adds the
programs that also carry the stage's gradient accumulator (one flat buffer
per dtype, ``build/flat.py``): a backward that adds its gradient to it, the
last stage's forward and backward as one program, either of those ending
with the stage's optimizer step (a stream's step after the backward that
is its only gradient: ``with_step``), and the unpacking of the
accumulator into leaves. An accumulator passed back in is donated (updated
in place), so profiling must not hold it past its next use (the driver
waits for the profiler before it donates, ``execute/driver.py``).
"""

from typing import Any

import jax
import jax.numpy as jnp

from jpipe.partition import Stages
from jpipe.runtime.build.flat import FlatLayout
from jpipe.runtime.build.stored_params import leaves_of
from jpipe.runtime.build.weighted import WeightedStage

GPU_PLATFORMS = ("gpu", "cuda", "rocm")


def compiler_options(platform: str, gpu_command_buffers: bool) -> dict:
  """XLA options of the per-action programs (stage programs, optimizer
  steps) on ``platform``: on GPUs without command buffers (CUDA graphs)
  unless ``gpu_command_buffers``. A recorded graph is updated for every
  argument buffer that moved since its last run; where they all move
  each call, that update cost an H100's host more than launching the
  kernels (``Partitioning.gpu_command_buffers``)."""
  if platform in GPU_PLATFORMS and not gpu_command_buffers:
    return {"xla_gpu_enable_command_buffer": ""}
  return {}


def jit(fn, options: dict[str, Any], **kwargs):
  """``jax.jit(fn, **kwargs)`` compiled with XLA ``options`` (if any)."""
  return jax.jit(fn, compiler_options=options or None, **kwargs)


class StagePrograms:
  """Jitted accumulate-and-differentiate programs of every stage.

  Args:
    stages: the built stages.
    grad_layouts: each stage's ``FlatLayout`` of its param leaves.
    recompute: backwards recompute the forward (else they start from the
      residuals a saving forward returned).
    options: XLA options of its programs (``compiler_options``); the
      stages' own programs take ``stages.compiler_options``.
    placement: each stage's ``StagePlacement``; a weighted replica group's
      programs run each replica's slice (``_weighted.WeightedStage``).
    stages_at: ``stages_at(n)`` -> the stages cut from the model traced
      on n examples (a slice's programs are compiled from them).
  """

  def __init__(
    self,
    stages: Stages,
    grad_layouts: tuple[FlatLayout, ...],
    recompute,
    options: dict[str, Any] | None = None,
    placement=(),
    stages_at=None,
  ):
    self.stages = stages
    self.options = dict(options or {})
    self.grad_layouts = grad_layouts
    self.recompute = recompute
    self._cache: dict[tuple, object] = {}
    self._stages_at = stages_at
    self._at_rows: dict[int, StagePrograms] = {}
    self.weighted = {
      s: WeightedStage(s, place, stages.specs[s], self)
      for s, place in enumerate(placement)
      if place.weighted
    }

  def forward(self, s: int):
    """``(params, batch, acts) -> (outputs, results)`` of stage s (with
    ``recompute``), or ``-> (outputs, results, residuals)``."""
    kind = "forward" if self.recompute else "forward_saving"
    if s in self.weighted:
      return getattr(self.weighted[s], kind)
    return self.stage_program(kind, s)

  def stage_program(self, kind: str, s: int):
    """The stages' program ``kind`` of stage s (e.g. "forward"), jitted,
    taking its params as the driver stores them (``_stored_params``:
    packed, unpacked at its start) or as leaves."""
    key = (kind, s)
    if key not in self._cache:
      run = getattr(self.stages, kind)
      self._cache[key] = jit(
        lambda theta, *args: run(s, leaves_of(theta), *args),
        self.stages.compiler_options,
      )
    return self._cache[key]

  def backward(self, s: int, first: bool):
    """``(acc, params, batch, acts, out_cots, result_cots)`` (with
    recompute) or ``(acc, params, residuals, out_cots, result_cots)`` ->
    ``(acc + grads, act_cots)``; ``first``: no accumulator yet (acc is
    None; a weighted group's accumulator is a tuple per replica)."""
    if s in self.weighted:
      kind = "backward" if self.recompute else "backward_from_residuals"
      return getattr(self.weighted[s], kind)
    return self.plain_backward(s, first)

  def forward_backward(self, s: int, first: bool):
    """``(acc, params, batch, acts, result_cots) -> (results, acc + grads,
    act_cots)`` of an output-free stage: its forward and backward as one
    program."""
    if s in self.weighted:
      return self.weighted[s].forward_backward
    return self.plain_forward_backward(s, first)

  def at_rows(self, n: int) -> "StagePrograms":
    """The one-device programs of a microbatch slice of n examples (the
    model traced again on n examples, cut by the same plan), cached."""
    if n not in self._at_rows:
      self._at_rows[n] = StagePrograms(
        self._stages_at(n), self.grad_layouts, self.recompute, self.options
      )
    return self._at_rows[n]

  def plain_backward(self, s: int, first: bool):
    """``backward``'s one-device program (a weighted group's replicas
    each run it on their slice)."""
    kind = "backward" if self.recompute else "backward_from_residuals"
    return self._accumulating(kind, s, first)

  def plain_forward_backward(self, s: int, first: bool):
    """``forward_backward``'s one-device program."""
    return self._accumulating("forward_backward", s, first)

  def input_grad(self, s: int):
    """A zero-bubble schedule's I of stage s: ``backward``'s arguments but
    the accumulator -> ``(act_cots, kept)``, its input cotangents and what
    ``weight_grad`` needs."""
    if s in self.weighted:
      raise ValueError(
        f"stage {s} is a weighted replica group: its backward does not "
        "split into I and W (zero-bubble schedules); use another schedule "
        "or replica_routing='split'"
      )
    kind = (
      "input_gradient" if self.recompute else "input_gradient_from_residuals"
    )
    return self.stage_program(kind, s)

  def weight_grad(self, s: int, first: bool):
    """W of stage s: ``(acc, kept) -> acc + grads`` (``first``: acc is
    None). The kept values are not donated: they may be buffers other
    stages read (a batch leaf)."""
    key = ("weight_gradient", s, first)
    if key not in self._cache:
      layout = self.grad_layouts[s]

      def fn(acc, kept):
        grads = self.stages.weight_gradient(s, kept)
        return _accumulate(acc, layout.pack(grads), first)

      self._cache[key] = jit(
        fn, self.options, donate_argnums=() if first else (0,)
      )
    return self._cache[key]

  def unpack(self, s: int):
    """A packed accumulator of stage s -> its tuple of gradient leaves."""
    key = ("unpack", s)
    if key not in self._cache:
      self._cache[key] = jit(self.grad_layouts[s].unpack, self.options)
    return self._cache[key]

  def _accumulating(self, kind, s, first):
    key = (kind, s, first)
    if key not in self._cache:
      run = getattr(self.stages, kind)
      layout = self.grad_layouts[s]

      def fn(acc, theta, *args):
        *head, grads, act_cots = run(s, leaves_of(theta), *args)
        return (*head, _accumulate(acc, layout.pack(grads), first), act_cots)

      self._cache[key] = jit(
        fn, self.options, donate_argnums=() if first else (0,)
      )
    return self._cache[key]

  def with_step(
    self,
    kind: str,
    s: int,
    optimizer,
    donate_state: bool,
    replicas=(),
    added=(),
  ):
    """``backward`` (kind "backward") or ``forward_backward`` (kind
    "forward_backward") of stage s, first since the stage's last step (no
    accumulator), ending with its optimizer's step (a
    ``StageOptimizer``): ``(opt_state, params, stale_params, scale,
    update_scale, added_grads, *args) -> (*head, new params, new
    opt_state, replica gradients, act_cots)``, ``args`` and ``head`` as
    that program's, the replica gradients those of the leaves at
    positions ``replicas`` (tied leaves another stage owns and steps),
    ``added_grads`` a gradient for each position of ``added`` (the
    holders' gradients of the tied leaves stage s owns), added to the
    stage's own before the step. The gradient goes into
    the step inside the program, never to the host. Consumes
    (``donate_state``) ``opt_state``. The results are those of the two
    programs to the bit on a CPU (tested). (After an accumulating
    backward they were not: Adam's moments differed in the last bit, so
    a window of several microbatches steps in its own program.)"""
    if kind == "backward" and not self.recompute:
      kind = "backward_from_residuals"
    replicas, added = tuple(replicas), tuple(added)
    key = (f"{kind}_step", s, optimizer, bool(donate_state), replicas, added)
    if key not in self._cache:
      run = getattr(self.stages, kind)
      layout = self.grad_layouts[s]

      def fn(
        opt_state, params, stale, scale, update_scale, added_grads, theta, *a
      ):
        *head, grads, act_cots = run(s, leaves_of(theta), *a)
        # The step reads the gradient as the separate step program reads
        # the accumulator, the update fused with its unpacking: without
        # the barrier XLA drops the pack and unpack, and the packed small
        # leaves' momentum and Adam steps round differently (last bit).
        flat = jax.lax.optimization_barrier(layout.pack(grads))
        new_params, new_state, out = optimizer.apply_tied(
          layout.unpack(flat),
          added,
          added_grads,
          replicas,
          opt_state,
          params,
          stale,
          scale,
          update_scale,
        )
        return (*head, new_params, new_state, out, act_cots)

      self._cache[key] = jit(
        fn, self.options, donate_argnums=(0,) if donate_state else ()
      )
    return self._cache[key]

  def compiled_kinds(self) -> set[str]:
    """The kinds of program compiled so far (for tests)."""
    return {k[0] for k in self._cache}


def _accumulate(acc, flat, first: bool):
  """``flat`` (packed gradients) added to the accumulator ``acc`` (None
  when ``first``)."""
  return flat if first else tuple(map(jnp.add, acc, flat))
