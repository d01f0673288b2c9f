"""Whether the user's optimizer steps each stage from that stage's leaves.

A pipeline runs one optimizer per stage, each over the leaves its stage
holds (``params_view``: the model's params pytree, other stages' leaves
None). That is one device's step only where every leaf's update (and
every value the optimizer keeps) is a function of leaves one stage
holds. ``optax.chain(optax.clip_by_global_norm(c), tx)`` -- the clip in
nearly every training script -- is not: its scale reads every leaf's
gradient, so per stage it would clip each stage by its own norm, a
silently different step. The same holds for ``optax.apply_if_finite``,
``optax.normalize_by_update_norm`` and the optimizers that estimate a
step size over the whole model (``optax.contrib.prodigy``,
``dadapt_adamw``, ``mechanize``).

``check_stage_local`` finds this before anything compiles: it traces the
optimizer's update once over the whole model's abstract params (nothing
is allocated) and follows, through the jaxpr, which input leaves each
output leaf is computed from (``output_dependencies``).
"""

from collections.abc import Sequence

import jax
from jax.extend import core as jex_core

from jpipe.runtime.build.jaxpr_flow import flow
from jpipe.runtime.build.row_locality import mixed_rows
from jpipe.runtime.build.stage_optimizer import leaf_names

# A value's dependencies: a bitset of input indices (bit i: input i), as
# an int -- unions over a whole model's leaves are one OR each.
Deps = int

# What the error suggests in place of a whole-model step.
_FIX = (
  "a pipeline steps each stage's leaves on that stage, so a step computed "
  "over the whole model would silently differ from one device's. For "
  "global-norm clipping pass clip_global_norm=c to jpipe.Pipeline "
  "(config.optimizer.clip_norm) and leave optax.clip_by_global_norm out of "
  "the optimizer; for optax.apply_if_finite pass skip_nonfinite_steps=True; "
  "otherwise use an optimizer whose step for a leaf reads "
  "only that leaf's values (optax's adam, adamw, sgd, lion, muon, masks "
  "and multi_transform do; lamb and adafactor too, unless a cut splits a "
  "leaf, as between a scanned stack's layers)"
)


class OptimizerError(ValueError):
  """The optimizer cannot run per stage: its step for some leaf reads
  leaves of other stages, or it needs arguments (the loss) a stage's
  update is not given."""


class _Dependencies:
  """``jaxpr_flow``'s lattice of input bitsets: what a value reads."""

  bottom = 0

  @staticmethod
  def join(a: Deps, b: Deps) -> Deps:
    return a | b

  @staticmethod
  def influence(deps: Deps) -> Deps:
    return deps

  @staticmethod
  def equation(eqn, ins):
    return None  # every primitive: each output reads every input


def output_dependencies(
  closed_jaxpr: jex_core.ClosedJaxpr,
) -> list[Deps]:
  """Per output of ``closed_jaxpr``, the inputs its value is computed
  from, as a bitset (bit i: input i) (data flow at the granularity of whole arrays;
  through jit, cond, while, scan, custom derivatives and remat; any
  other higher-order primitive counts each output as reading all its
  inputs)."""
  n = len(closed_jaxpr.jaxpr.invars)
  return flow(closed_jaxpr, [1 << i for i in range(n)], _Dependencies)


def check_pipeline_optimizer(
  optimizer, params, stage_leaves, sources, layer_axes=()
):
  """``check_stage_local`` for a pipeline's stages: ``stage_leaves``, per
  stage, the traced param leaves it reads; ``sources``, per traced leaf,
  its ``(model leaf, row)``; ``layer_axes``, per model leaf, the axis its
  rows are stacked on (empty: 0). One stage: nothing to check."""
  if len(stage_leaves) < 2:
    return
  held = [set() for _ in jax.tree.leaves(params)]
  row_stages = {}  # model leaf -> the stages holding its scanned rows
  for s, leaves in enumerate(stage_leaves):
    for i in leaves:
      leaf, row = sources[i]
      held[leaf].add(s)
      if row >= 0:
        row_stages.setdefault(leaf, set()).add(s)
  check_stage_local(
    optimizer,
    params,
    [frozenset(h) for h in held],
    leaf_names(params),
    split_rows=[m for m, ss in sorted(row_stages.items()) if len(ss) > 1],
    layer_axes=layer_axes,
  )


def check_stage_local(
  optimizer,
  params,
  leaf_stages: Sequence[frozenset[int]],
  leaf_names: Sequence[str],
  split_rows: Sequence[int] = (),
  layer_axes: Sequence[int] = (),
) -> None:
  """Raises OptimizerError if ``optimizer``'s step on the whole model reads,
  for some leaf's update or some value it keeps, leaves that no one stage
  holds together.

  Args:
    optimizer: an optax ``GradientTransformation`` written for the whole
      model.
    params: the model's params (arrays or ``jax.ShapeDtypeStruct``s; only
      shapes and dtypes are read).
    leaf_stages: per model leaf (flatten order), the stages holding it (a
      tied leaf's owner and holders; a scanned leaf's rows' stages).
    leaf_names: per model leaf, its path (for the message).
    split_rows: the model leaves whose rows (a scanned layer's, stacked
      on axis 0, or ``layer_axes[m]``) run on several stages: each stage
      steps its own rows, so a step that mixes a leaf's rows (an RMS over
      the whole leaf) is refused too (``row_locality``).
    layer_axes: per model leaf, the axis its rows are stacked on (empty:
      0 for every leaf).

  A leaf no stage holds is left out (a pipeline holds every leaf: one its
  loss never reads on the last stage).
  """
  abstract = jax.tree.map(
    lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), params
  )
  n = len(leaf_stages)
  state = jax.eval_shape(optimizer.init, abstract)
  try:
    traced = jax.make_jaxpr(lambda g, s, p: optimizer.update(g, s, p))(
      abstract, state, abstract
    )
  except TypeError as e:
    if "required keyword-only argument" not in str(e):
      raise
    raise OptimizerError(
      f"the optimizer's update needs arguments a pipeline's stage cannot "
      f"give it ({e}): optax.contrib.reduce_on_plateau, polyak_sgd and "
      "lbfgs read the loss (value=) or the loss function, which a stage "
      "steps without. Use a learning-rate schedule, or an optimizer whose "
      "update takes (updates, state, params)"
    ) from None
  state_flat = jax.tree_util.tree_flatten_with_path(state)[0]
  num_state = len(state_flat)
  # What each output is, for messages: the updates, then the state.
  whats = [f"the update of {name!r}" for name in leaf_names] + [
    f"the optimizer state's {jax.tree_util.keystr(path)}"
    for path, _ in state_flat
  ]

  # Inputs: gradients (n), state, params (n); only leaves are labelled.
  def model_leaf(i):
    if i < n:
      return i
    if i >= n + num_state:
      return i - n - num_state
    return None

  def read(deps: Deps) -> set[int]:  # the model leaves a bitset reads
    return {model_leaf(i) for i in _bits(deps)} - {None}

  outputs = output_dependencies(traced)
  for i, (what, deps) in enumerate(zip(whats, outputs, strict=True)):
    at = leaf_stages[i] if i < n else None  # (a state value: any stage)
    _check_output(what, at, read(deps), leaf_stages, leaf_names)
  if split_rows:
    _check_rows(
      traced,
      params,
      state_flat,
      whats,
      (split_rows, layer_axes),
      leaf_stages,
      leaf_names,
    )


def _check_rows(
  traced, params, state_flat, whats, rows, leaf_stages, leaf_names
):
  """Raises unless every update and kept value (``whats``: each output
  named) computes each row of a row-split leaf from that row alone.
  ``rows``: (the row-split model leaves, each model leaf's layer axis or
  ()). The row inputs: the gradient and params of each such leaf (rows
  on its layer axis), and the state leaves (``state_flat``: with their
  paths) that mirror it (their path ends with its path; their rows on its
  layer axis if they have its rank, as ``ParamsView`` splits them, else
  on axis 0); each output is split on the axis its leaf's rows are."""
  split_rows, layer_axes = rows
  param_paths = [
    (jax.tree_util.keystr(path), x.shape)
    for path, x in jax.tree_util.tree_flatten_with_path(params)[0]
  ]
  n, num_state = len(param_paths), len(state_flat)
  of_input = {}  # row input -> the model leaf it is (or mirrors)
  axis_of = {}  # row input -> the axis of its rows
  for m in split_rows:
    path, shape = param_paths[m]
    axis = layer_axes[m] if layer_axes else 0
    for i in (m, n + num_state + m):
      of_input[i], axis_of[i] = m, axis
    for j, (spath, x) in enumerate(state_flat):
      mirrors = jax.tree_util.keystr(spath).endswith(path)
      on = axis if len(x.shape) == len(shape) else 0
      if mirrors and x.shape and x.shape[on] == shape[axis]:
        of_input[n + j], axis_of[n + j] = m, on
  # (Output i -- an update, then the state -- is split as input i is.)
  out_axes = [axis_of.get(i, 0) for i in range(len(whats))]
  outputs = mixed_rows(traced, axis_of, out_axes)
  for what, mixed in zip(whats, outputs, strict=True):
    if not mixed:
      continue
    m = of_input[_bits(mixed)[0]]
    raise OptimizerError(
      f"the optimizer mixes the rows of {_where(m, leaf_stages, leaf_names)}"
      f", a scanned layer's stacked leaf whose rows run on several stages: "
      f"{what} reads all its rows (e.g. an RMS or a norm over the whole "
      "leaf), which each stage would compute over its own rows alone, a "
      "silently different step. Use an update that reads each row on its "
      "own (optax.adafactor(..., clipping_threshold=None, "
      "multiply_by_parameter_scale=False); adam, adamw, sgd), or a plan "
      "that keeps the scan's rows on one stage"
    )


def _bits(deps: Deps) -> list[int]:
  out = []
  while deps:
    low = deps & -deps  # the lowest set bit
    out.append(low.bit_length() - 1)
    deps ^= low
  return out


def _check_output(what, at, read, leaf_stages, leaf_names) -> None:
  """Raises unless one stage (one of ``at``'s, where given: the stages
  holding the updated leaf) holds every leaf in ``read``."""
  common = set(at) if at is not None else None
  first = None  # the leaf that set ``common`` (a state value's)
  if at is not None and not at:
    return  # A leaf no stage holds: nobody steps it.
  for m in sorted(read):
    held = set(leaf_stages[m])
    if not held:
      continue
    if common is None:
      common, first = held, m
    elif common & held:
      common &= held
    else:
      if at is not None:
        what += f" (stage {', '.join(map(str, sorted(at)))})"
      also = (
        ""
        if first is None
        else f" and {_where(first, leaf_stages, leaf_names)}"
      )
      raise OptimizerError(
        "the optimizer couples leaves of different stages: "
        f"{what} reads {_where(m, leaf_stages, leaf_names)}{also}: {_FIX}"
      )


def _where(m, leaf_stages, leaf_names) -> str:
  stages = sorted(leaf_stages[m])
  return f"{leaf_names[m]!r} (stage {', '.join(map(str, stages))})"
