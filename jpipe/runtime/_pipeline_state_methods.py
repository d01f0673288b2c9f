"""``Pipeline``'s methods over its state: init, the drained state's
views (params, model state, norms) and the partition-independent state
dict; each delegates to ``_pipeline_state`` / ``_process_state``, where
the functions live."""

from collections.abc import Mapping, Sequence
from typing import Any

import jax

from jpipe.runtime import _pipeline_state, _process_state
from jpipe.runtime._pipeline_state import PipelineState
from jpipe.runtime.build.flat import PackedTree
from jpipe.runtime.build.loss_scale import DynamicLossScale
from jpipe.runtime.build.user_mesh import every_process
from jpipe.runtime.execute.in_flight import InFlight


class PipelineStateMethods:
  """A base of ``Pipeline``: what reads, writes and converts its state
  (``PipelineState``), given the built pipeline's parts."""

  @every_process
  def init(self, params: Any, model_state: Any = None) -> PipelineState:
    """Splits ``params`` per stage, places them, builds optimizer states.

    ``model_state``: the initial model state (required when the pipeline
    was built with one). With ``frozen``: the whole params. Floating
    leaves of another dtype than the params the pipeline was built with
    are cast to theirs (a float32 checkpoint into a bfloat16 pipeline;
    ``load_state_dict`` alike); another kind of dtype is refused.
    """
    if self.frozen_params is not None:
      if (model_state is None) == self.frozen_params.has_state:
        raise ValueError(
          "pass model_state to init exactly when the Pipeline was built "
          "with model_state="
        )
      params, model_state = self.frozen_params.split(params, model_state)
    return _pipeline_state.init_state(self, params, model_state)

  def with_stage_params(
    self, state: PipelineState, stage_params: Sequence[Any]
  ) -> PipelineState:
    """The drained ``state`` with other params per stage (each stage's
    leaves, placed as ``state.stage_params`` are): an asynchronous stream
    starts anew from them. E.g. a replica's params after a sync."""
    _pipeline_state.check_drained(state, "with_stage_params")
    flight = InFlight.start(stage_params) if self.stream else None
    return state._replace(stage_params=tuple(stage_params), in_flight=flight)

  def stage_params_of(self, params: Any) -> list[tuple]:
    """Per stage, its param leaves of the whole ``params`` (as ``init``
    takes them; with ``frozen``, the trained leaves only)."""
    if self.frozen_params is not None:
      params, _ = self.frozen_params.split(params)
    return self.stages.split_params(params)

  def gradient_avals(self, stage: int, params: Sequence[Any]) -> Any:
    """Shapes and dtypes of stage ``stage``'s gradient as its optimizer
    step receives it (small leaves packed into one buffer) for its param
    leaves ``params`` (arrays or ``jax.ShapeDtypeStruct``)."""
    return jax.eval_shape(self.programs.grad_layouts[stage].pack, params)

  def drained_state(
    self, stage_params, opt_states, step, model_state, loss_scale=None
  ):
    """A drained state: a new stream for asynchronous schedules; a
    dynamic loss scale's ``loss_scale`` (None: its start)."""
    flight = InFlight.start(stage_params) if self.stream else None
    if loss_scale is None and isinstance(self.loss_scale, DynamicLossScale):
      loss_scale = self.loss_scale.start()
    return PipelineState(
      tuple(stage_params),
      tuple(opt_states),
      step,
      tuple(model_state),
      flight,
      loss_scale=loss_scale,
    )

  def _own_state_signature(self) -> tuple:
    """``state_signature`` of this pipeline's states (computed once, on
    shapes: the stages' built param avals and their optimizers' init)."""
    signature = getattr(self, "_state_signature", None)
    if signature is None:
      avals = self.traced.closed_jaxpr.in_avals
      signature = []
      for s, spec in enumerate(self.stages.specs):
        if not self.transport.owns(s):
          signature.append(None)
          continue
        built = tuple(
          jax.ShapeDtypeStruct(avals[i].shape, avals[i].dtype)
          for i in spec.param_leaves
        )
        opt = jax.eval_shape(self.stage_optimizers[s].init, built)
        shapes = tuple(tuple(a.shape) for a in built)
        signature.append((shapes, _opt_structure(opt)))
      signature = self._state_signature = tuple(signature)
    return signature

  def check_own_state(self, state) -> None:
    """A ValueError where ``state`` is not one of this pipeline's (another
    pipeline's stages or optimizer): it met a cryptic IndexError or an
    optax AttributeError inside the step."""
    if not isinstance(state, PipelineState):
      raise ValueError(
        f"the state is a {type(state).__name__}, not a PipelineState: pass "
        "what this pipeline's init, load_state_dict or step returned"
      )
    want, got = self._own_state_signature(), state_signature(state)
    if got == want:
      return
    what = (
      f"{len(got)} stages, this pipeline has {len(want)}"
      if len(got) != len(want)
      else "stage "
      + ", ".join(
        str(s) for s, (a, b) in enumerate(zip(got, want, strict=True)) if a != b
      )
      + "'s params or optimizer state are laid out otherwise"
    )
    raise ValueError(
      f"the state is another pipeline's ({what}): step a state this "
      "pipeline's init or load_state_dict made (state_dict / "
      "load_state_dict move a state between pipelines)"
    )

  @every_process
  def gather_model_state(self, state: PipelineState) -> Any:
    """The model state pytree (host arrays), or None without one. Needs a
    drained pipeline (``flush``). Across processes every process must
    call it; each gets the whole state (None: a process that runs none
    of this pipeline's stages, where another process runs them all). A
    round-robin replica group's leaves are its replica 0's (PipeDream
    saves and evaluates from each stage's first rank). With ``frozen``:
    the loss's own model state (None without one)."""
    held = _pipeline_state.gather_model_state(self, state)
    if self.frozen_params is None:
      return held
    if held is None:  # (Outside this pipeline's processes.)
      return None
    return self.frozen_params.loss_state(held)

  @every_process
  def gather_params(self, state: PipelineState) -> Any:
    """The full params pytree (host arrays). Needs a drained pipeline
    (``flush``): mid-stream, every stage is at another step. Across
    processes every process must call it; each gets the whole pytree
    (None: a process that runs none of this pipeline's stages, where
    another process runs them all, as in data parallel). With
    ``frozen``: the whole params, frozen leaves as they were given."""
    params = _pipeline_state.gather_params(self, state)
    if self.frozen_params is None:
      return params
    held = _pipeline_state.gather_model_state(self, state)
    return self.frozen_params.whole(params, held)[0]

  @every_process
  def nonfinite_params(self, state: PipelineState) -> dict[int, str]:
    """``{stage: path of its first param leaf holding a NaN or an
    infinity}`` for every such stage (empty when all are finite). Works
    mid-stream. Across processes every process must call it."""
    return _pipeline_state.nonfinite_params(self, state)

  @every_process
  def param_norms(self, state: PipelineState) -> list[float]:
    """Each stage's parameter L2 norm (all its leaves together). Across
    processes every process must call it; each gets every stage's."""
    return _pipeline_state.param_norms(self, state)

  def stage_param_avals(self) -> list[tuple[Any, ...]]:
    """Per stage, the abstract values (shape, dtype) of its param leaves."""
    return _pipeline_state.stage_param_avals(self)

  @every_process
  def state_dict(self, state: PipelineState) -> dict[str, Any]:
    """The whole training state, independent of the partition (host
    arrays): ``{"params", "opt_state" (laid out as ``optimizer.init``
    does for the whole model, params-shaped parts keyed by global leaf
    path), "gap_aware", "model_state", "step"}``
    (``_pipeline_state.state_dict``); typed PRNG keys as their key data
    (``load_state_dict`` makes them keys again). Needs a drained pipeline. Across
    processes as ``gather_params`` (None where it gives None). A
    round-robin group's model state is its replica 0's. With ``frozen``:
    the whole params, and the loss's own model state."""
    tree = _pipeline_state.state_dict(self, state)
    return self._outside(tree)

  def local_state_dict(self, state: PipelineState) -> dict[str, Any]:
    """``state_dict``'s structure without gathering (no collective): the
    leaves this process writes to a checkpoint as arrays, each written by
    exactly one process, the others as ``jax.ShapeDtypeStruct``
    (``_process_state``). Needs a drained pipeline."""
    return self._outside(_process_state.local_state_dict(self, state))

  def state_dict_layout(self) -> tuple[dict[str, Any], dict[str, Any]]:
    """(``state_dict``'s structure as ``jax.ShapeDtypeStruct`` leaves, the
    same of booleans: whether this process's stages use each leaf).
    ``load_state_dict`` takes a state dict holding only the used leaves
    (the others as the layout's ``ShapeDtypeStruct``)."""
    layout, needed = _process_state.state_dict_layout(self)
    return self._outside(layout), self._outside(needed)

  @every_process
  def load_state_dict(self, tree: Mapping[str, Any]) -> PipelineState:
    """A PipelineState from ``state_dict``'s output (any partition).
    Gap-Aware statistics of leaves that were not on a Gap-Aware stage when
    saved start fresh (zeros), as they do at initialisation. Every
    replica of a round-robin group starts at the saved model state."""
    if self.frozen_params is not None:
      tree = self.frozen_params.state_dict_in(tree)
    return _pipeline_state.load_state_dict(self, tree)

  def _outside(self, tree):
    """A state dict (or its layout) as the caller sees it."""
    if self.frozen_params is None:
      return tree
    return self.frozen_params.state_dict_out(tree)


def state_signature(state) -> tuple:
  """Per stage, its param leaves' shapes and its optimizer state's
  structure (None: another process's stage)."""
  return tuple(
    None
    if params is None
    else (
      tuple(tuple(x.shape) for x in jax.tree.leaves(params)),
      _opt_structure(opt),
    )
    for params, opt in zip(state.stage_params, state.opt_states, strict=True)
  )


def _opt_structure(opt):
  """An optimizer state's structure: a packed one's unpacked tree's (its
  packing varies with what it was made from, e.g. weakly typed params)."""
  if isinstance(opt, PackedTree):
    return opt.treedef
  return jax.tree.structure(opt)
