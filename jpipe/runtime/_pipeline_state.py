"""A pipeline's training state: made, gathered, checked, saved.

``PipelineState`` (per-stage params and optimizer states, the stream in
flight) and functions of a built ``Pipeline`` and its state (the
pipeline's methods of the same names call them): the initial state
placed on the stages, the full params and model state gathered from the
stages (a collective across processes), per-stage health (non-finite
leaves, norms), and the partition-independent state dict a checkpoint
holds, with its inverse. Each reads
the pipeline's public attributes: ``stages``, ``traced``, ``transport``,
``placement``, ``stage_optimizers``, ``driver``, ``params_treedef``,
``state_treedef``, ``leaf_names``.
"""

from collections.abc import Mapping
from typing import Any, NamedTuple

import jax
import numpy as np

from jpipe.runtime._gather import trees_everywhere
from jpipe.runtime._stacked import (
  model_names,
  model_param_avals,
  model_state_of,
  split_keyed,
  stack_keyed,
)
from jpipe.runtime._state_dict import (
  keys_in,
  merge_optimizer_states,
  on_host,
  place_leaf,
  restore_structure,
  select_optimizer_states,
)
from jpipe.runtime.build.grad_dtype import cast_floating
from jpipe.runtime.build.key_arrays import host_key_data, keys_from_data
from jpipe.runtime.build.loss_scale import (
  LossScaleState,
  from_state_dict,
  state_dict_entry,
)
from jpipe.runtime.build.stage_optimizer import leaf_names
from jpipe.runtime.build.user_mesh import own_type
from jpipe.runtime.execute.in_flight import InFlight


@own_type
class PipelineState(NamedTuple):
  """Per-stage parameter leaves and optimizer states, on their devices.

  An optimizer state is keyed by the leaves' global paths (see
  ``Pipeline.state_dict``); on a Gap-Aware stage it is Gap-Aware's state
  around the optimizer's. ``in_flight``: an asynchronous pipeline's
  stream (microbatches between their forward and their step); None for
  synchronous ones. ``step`` / ``flush`` leave the state they are given
  as it was (they donate only buffers a call made itself: gradient sums,
  the optimizer states it stepped): stepping it again repeats the step;
  continue from the one they return.

  A round-robin replica group (1F1B-RR) keeps a model-state leaf per
  replica, as PipeDream's replicas (each its own model copy) do:
  ``model_state`` holds replica 0's copy, ``replica_model_state`` the
  others' (``jpipe.runtime.execute.replica_state``).
  """

  stage_params: tuple[tuple[jax.Array, ...], ...]
  opt_states: tuple[Any, ...]
  step: int
  # Leaves of the model state (BatchNorm statistics), when there is one.
  model_state: tuple[jax.Array, ...] = ()
  in_flight: InFlight | None = None
  # Per model-state leaf of a round-robin stage, its replicas 1..k-1's
  # own copies (replica_state); empty: every replica at model_state's.
  replica_model_state: tuple = ()
  # A dynamic loss scale's state (``build/loss_scale.py``: host numbers);
  # None without one.
  loss_scale: LossScaleState | None = None


def init_state(
  pipe, params: Any, model_state: Any = None, *, fresh_optimizer=None
) -> PipelineState:
  """``Pipeline.init``: ``params`` split per stage and placed, with their
  optimizer states (and the model state's leaves). ``fresh_optimizer``:
  per stage, whether to make its optimizer state (else its abstract
  value, for a restore to fill: nothing allocated twice); None: all."""
  if (model_state is None) != (pipe.state_treedef is None):
    raise ValueError(
      "pass model_state to init exactly when the Pipeline was built with "
      "model_state="
    )
  check_model_params(pipe, params)
  state_leaves = ()
  if model_state is not None:
    if jax.tree.structure(model_state) != model_state_treedef(pipe):
      raise ValueError("model_state has another structure than at build")
    state_leaves = tuple(
      jax.tree.leaves(model_state)
      if pipe.state_rows is None
      else pipe.state_rows.to_rows(model_state)  # (Stacked per layer: rows.)
    )
  stage_params, opt_states = [], []
  avals = pipe.traced.closed_jaxpr.in_avals
  for s, leaves in enumerate(pipe.stages.split_params(params)):
    if not pipe.transport.owns(s):  # Another process runs it.
      stage_params.append(None)
      opt_states.append(None)
      continue
    place = pipe.placement[s]
    built = [avals[i] for i in pipe.stages.specs[s].param_leaves]
    names = [pipe.leaf_names[i] for i in pipe.stages.specs[s].param_leaves]
    # Leaf by leaf: a lazily read checkpoint (leaves that read themselves
    # when converted, e.g. jpipe.train.hf_checkpoint's) is never whole on
    # the host, one leaf at a time on its way to its stage.
    placed = type(leaves)(
      place_leaf(
        lambda y, a=a, n=n, p=place: p.put_replicated(as_built(y, a, n)), x
      )
      for x, a, n in zip(leaves, built, names, strict=True)
    )
    stage_params.append(placed)
    init = pipe.stage_optimizers[s].init
    if fresh_optimizer is None or fresh_optimizer[s]:
      opt_states.append(place.put_replicated(init(placed)))
    else:
      opt_states.append(jax.eval_shape(init, placed))
  return pipe.drained_state(stage_params, opt_states, 0, state_leaves)


def check_model_params(pipe, params, whose: str = "the params given") -> None:
  """A ValueError where ``params`` do not have the structure and shapes
  of the params the pipeline was built with, naming the leaves that
  differ. (Unchecked, a transposed kernel of a packed leaf trained as a
  reshape of itself, silently; a leaf sorting last was dropped.)"""
  if jax.tree.structure(params) != pipe.params_treedef:
    given = set(leaf_names(params))
    built = set(model_names(pipe))
    extra, missing = sorted(given - built), sorted(built - given)
    raise ValueError(
      f"{whose} have another structure than the params the pipeline was "
      f"built with: "
      + "; ".join(
        f"{what} {names[:3]}{' ...' if len(names) > 3 else ''}"
        for what, names in (("not in the model:", extra), ("missing:", missing))
        if names
      )
      + ("" if extra or missing else "the same paths in other containers")
    )
  for name, given, built in zip(
    model_names(pipe),
    jax.tree.leaves(params),
    model_param_avals(pipe),
    strict=True,
  ):
    shape = tuple(np.shape(given))
    if shape != tuple(built.shape):
      transposed = len(shape) == 2 and shape[::-1] == tuple(built.shape)
      raise ValueError(
        f"{whose}: param {name} has shape {shape}, the pipeline was built "
        f"with {tuple(built.shape)}"
        + (" (transposed: a PyTorch Linear's [out, in]?)" if transposed else "")
      )


def as_built(x, aval, name: str):
  """Param leaf ``x`` in the dtype the pipeline was built with (``aval``'s):
  a floating leaf of another width is cast (a float32 checkpoint into a
  bfloat16 pipeline, as HuggingFace's ``torch_dtype`` loads); any other
  mismatch is refused naming the leaf. (Left as they came, the stages'
  programs met other dtypes than they were built for: a reshape error
  where leaves are packed, else a silent 2x of the predicted memory.)"""
  if not hasattr(x, "dtype"):  # (A Python number.)
    x = np.asarray(x)
  cast = cast_floating(x, aval.dtype)
  if cast.dtype == aval.dtype:
    return cast
  raise ValueError(
    f"param {name} is {x.dtype}, the pipeline was built with "
    f"{aval.dtype}: pass params of the dtypes it was built with (those "
    "of the params given to jpipe.Pipeline)"
  )


def state_avals(pipe) -> list[jax.ShapeDtypeStruct]:
  """The pipeline's model-state leaves' abstract values (a leaf held as
  rows, ``build/state_rows.py``, as its rows)."""
  return [
    jax.ShapeDtypeStruct(a.shape, a.dtype) for a in pipe.driver.state_avals
  ]


def model_state_treedef(pipe):
  """The model state's structure as the model declares it (a leaf held
  as rows, ``build/state_rows.py``, as the one stacked leaf)."""
  if pipe.state_rows is not None:
    return pipe.state_rows.treedef
  return pipe.state_treedef


def check_drained(state, what: str) -> None:
  """``what`` needs a drained pipeline: refused mid-stream, naming the
  fix."""
  flight = state.in_flight
  if flight is not None and flight.fed:
    raise ValueError(
      f"{what} needs a drained pipeline, but {flight.fed} microbatches "
      "of the asynchronous stream have not all been applied: call "
      "`state, _ = pipe.flush(state)` first"
    )


def gather_model_state(pipe, state) -> Any:
  """The model state pytree (host arrays), or None without one. Needs a
  drained pipeline (``flush``). Across processes every process must
  call it; each gets the whole state. A round-robin group's leaves are
  its replica 0's copies (PipeDream saves and evaluates from each
  stage's first rank)."""
  check_drained(state, "gather_model_state")
  if pipe.state_treedef is None:
    return None
  # Each leaf from the process of the stage that updates it (any
  # process holds a leaf no stage updates: its initial value).
  producer = {
    r: s for s, spec in enumerate(pipe.stages.specs) for r in spec.results
  }
  # (A leaf no stage updates: the pipeline's first process's.)
  first = pipe.transport.processes[0]
  holders = [
    pipe.transport.stage_process[producer[i + 1]]
    if i + 1 in producer
    else first
    for i in range(len(state.model_state))
  ]
  me = pipe.transport.process
  leaves = trees_everywhere(
    [
      x if h == me else None
      for x, h in zip(state.model_state, holders, strict=True)
    ],
    pipe.driver.state_avals,
    holders,
    to_every_process=bool(pipe.transport.spanning),
  )
  if leaves and leaves[0] is None:  # Outside this pipeline's processes.
    return None
  return model_state_of(pipe, leaves)


def gather_params(pipe, state) -> Any:
  """The full params pytree (host arrays). Needs a drained pipeline
  (``flush``): mid-stream, every stage is at another step. Across
  processes every process must call it; each gets the whole pytree."""
  check_drained(state, "gather_params")
  stage_params = trees_everywhere(
    state.stage_params,
    stage_param_avals(pipe),
    _holders(pipe),
    to_every_process=bool(pipe.transport.spanning),
  )
  if stage_params[0] is None:  # Outside this pipeline's processes.
    return None
  leaves = [None] * pipe.traced.num_param_leaves
  for spec, values in zip(pipe.stages.specs, stage_params, strict=True):
    for i, v in zip(spec.param_leaves, values, strict=True):
      if leaves[i] is None:
        leaves[i] = v
  leaves = pipe.traced.model_leaves(leaves)  # Stacked leaves as declared.
  return jax.tree.unflatten(pipe.params_treedef, leaves)


def nonfinite_params(pipe, state) -> dict[int, str]:
  """``{stage: path of its first param leaf holding a NaN or an
  infinity}`` for every such stage (empty when all are finite). Works
  mid-stream (each stage's current params). Across processes every
  process must call it; each gets the answer for all stages."""

  def first_nonfinite(leaves):
    finite = [bool(jax.numpy.isfinite(x).all()) for x in leaves]
    return finite.index(False) if False in finite else -1

  firsts = _per_stage_scalar(pipe, state, first_nonfinite, np.int32)
  return {
    s: pipe.leaf_names[pipe.stages.specs[s].param_leaves[int(i)]]
    for s, i in enumerate(firsts)
    if int(i) >= 0
  }


def param_norms(pipe, state) -> list[float]:
  """Each stage's parameter L2 norm (all its leaves together). Across
  processes every process must call it; each gets every stage's."""

  def norm(leaves):
    return np.sqrt(float(_sum_of_squares(leaves)))

  return [float(n) for n in _per_stage_scalar(pipe, state, norm, np.float32)]


@jax.jit
def _sum_of_squares(leaves):
  """Sum of squares of all ``leaves`` (float32 []), as one program on
  the stage's devices: op by op, each leaf's shape compiled a program of
  its own and waited for the host (31 of each for a 4-stage T5)."""
  return sum(
    jax.numpy.sum(jax.numpy.square(jax.numpy.abs(x).astype(np.float32)))
    for x in leaves
  )


def _per_stage_scalar(pipe, state, fn, dtype) -> list:
  """``fn(stage's param leaves)`` of every stage, computed by the process
  that runs it and known to all (a collective across processes)."""
  values = [
    None if leaves is None else dtype(fn(leaves))
    for leaves in state.stage_params
  ]
  template = jax.ShapeDtypeStruct((), dtype)
  return trees_everywhere(
    values,
    [template] * len(values),
    _holders(pipe),
    to_every_process=bool(pipe.transport.spanning),
  )


def _holders(pipe):
  """Per stage, the process that runs it (its lead, where it spans
  processes: every process of a pipeline with such a stage takes part
  in gathering its trees, ``to_every_process``)."""
  return list(pipe.transport.stage_process)


def stage_opt_avals(pipe) -> list:
  """Per stage, its optimizer state's abstract values as its ``init``
  lays them out (nothing allocated)."""
  return [
    jax.eval_shape(opt.init, avals)
    for opt, avals in zip(
      pipe.stage_optimizers, stage_param_avals(pipe), strict=True
    )
  ]


def stage_param_avals(pipe) -> list[tuple[Any, ...]]:
  """Per stage, the abstract values (shape, dtype) of its param leaves."""
  avals = pipe.traced.closed_jaxpr.in_avals
  return [
    tuple(avals[i] for i in spec.param_leaves) for spec in pipe.stages.specs
  ]


def state_dict(pipe, state) -> dict[str, Any]:
  """The whole training state, independent of the partition (host arrays).

  Returns:
    ``{"params": the full params pytree, "opt_state": the optimizer's
    state as ``optimizer.init(params)`` lays it out for the whole model,
    its params-shaped parts (Adam's moments, a mask's inner state) dicts
    keyed by global leaf path (``runtime/build/params_view.py``),
    "gap_aware": {"sq_avg": {path: array}, "count", "max_learning_rate"}
    for the leaves of Gap-Aware stages ({} without Gap-Aware),
    "model_state": the model state pytree or None, "step": int}``, and
    with a dynamic loss scale ``"loss_scale": {"scale": float,
    "good_steps": int}``. It needs a drained pipeline (``flush``), so no
    stash or in-flight microbatch needs saving.
  """
  check_drained(state, "state_dict")
  opt_states = trees_everywhere(
    state.opt_states,
    stage_opt_avals(pipe),
    _holders(pipe),
    to_every_process=bool(pipe.transport.spanning),
  )
  if opt_states[0] is None:  # Outside this pipeline's processes.
    return None
  merged, gap = merge_optimizer_states(pipe.stage_optimizers, opt_states)
  merged, gap = stack_keyed(pipe, merged), stack_keyed(pipe, gap)
  tree = {
    "params": gather_params(pipe, state),
    "opt_state": merged,
    "gap_aware": gap,
    # (Typed PRNG keys as their key data: a state dict holds arrays.)
    "model_state": jax.tree.map(host_key_data, gather_model_state(pipe, state)),
    "step": int(state.step),
  }
  if state.loss_scale is not None:
    tree["loss_scale"] = state_dict_entry(state.loss_scale)
  return tree


def load_state_dict(pipe, tree: Mapping[str, Any]) -> Any:
  """A PipelineState from ``state_dict``'s output (any partition).

  Gap-Aware statistics of leaves that were not on a Gap-Aware stage when
  saved start fresh (zeros), as they do at initialisation.
  """
  missing = {"params", "opt_state", "step"} - set(tree)
  if missing:
    raise ValueError(f"state dict lacks {sorted(missing)}")
  params = tree["params"]
  check_model_params(pipe, params, "the saved params (another model's?)")
  model_state = tree.get("model_state")
  if (model_state is None) != (pipe.state_treedef is None):
    raise ValueError(
      "the saved state and this pipeline disagree on having a model "
      "state (e.g. BatchNorm statistics): it was saved for another model"
    )
  if model_state is not None:
    model_state = restore_structure(model_state, model_state_treedef(pipe))
    model_state = jax.tree.map(
      keys_from_data,
      jax.tree.map(on_host, model_state),
      model_state_of(pipe, state_avals(pipe)),
    )
  # Only a Gap-Aware stage's fresh state is used (statistics not saved),
  # and that of a stage training leaves frozen when saved (no keyed part
  # of the saved optimizer state holds them: theirs starts fresh, as at
  # init).
  tree = {
    **tree,
    "opt_state": split_keyed(pipe, tree["opt_state"]),
    "gap_aware": split_keyed(pipe, tree.get("gap_aware") or {}),
  }
  was_frozen = frozenset(pipe.leaf_names) - keys_in(tree["opt_state"])
  base = init_state(
    pipe,
    params,
    model_state,
    fresh_optimizer=[
      opt.gap_aware
      or any(pipe.leaf_names[i] in was_frozen for i in spec.param_leaves)
      for opt, spec in zip(
        pipe.stage_optimizers, pipe.stages.specs, strict=True
      )
    ],
  )
  stage_params = base.stage_params
  opt_states = list(base.opt_states)  # None where another process runs it
  owned = [s for s in range(len(opt_states)) if pipe.transport.owns(s)]
  loaded = select_optimizer_states(
    tree,
    [pipe.stage_optimizers[s] for s in owned],
    [opt_states[s] for s in owned],
    [pipe.placement[s].put_replicated for s in owned],
    was_frozen,
  )
  for s, opt_state in zip(owned, loaded, strict=True):
    opt_states[s] = opt_state
  # A dynamic loss scale goes on from the saved one (from its start
  # where the state was saved without one).
  loss_scale = base.loss_scale
  if loss_scale is not None and "loss_scale" in tree:
    loss_scale = from_state_dict(tree["loss_scale"])
  return pipe.drained_state(
    stage_params, opt_states, int(tree["step"]), base.model_state, loss_scale
  )
