"""The state dict without gathering it: each process's own part.

``Pipeline.state_dict`` brings every stage's state to every process (a
collective, the whole training state in each host's memory). A
checkpoint across processes needs less: each process writes the leaves
its stages hold and reads back the leaves its (new) stages use. Both
functions here give ``state_dict``'s structure, path for path:

- ``local_state_dict``: the leaves this process writes (arrays: a
  stage's params as they are on its devices, its optimizer state on the
  host), every other leaf as its ``jax.ShapeDtypeStruct``. Where several
  stages hold a leaf (tied weights), the one ``state_dict`` would take it
  from (the first) writes it: every leaf is written by exactly one
  process, chosen alike in every process, with no communication.
- ``state_dict_layout``: every leaf's ``ShapeDtypeStruct`` and whether
  this process's stages use it (to read only those).
"""

from typing import Any

import jax
import numpy as np

from jpipe.runtime._pipeline_state import (
  check_drained,
  stage_opt_avals,
  stage_param_avals,
  state_avals,
)
from jpipe.runtime._stacked import (
  join_rows,
  model_param_avals,
  model_state_of,
  stack_keyed,
)
from jpipe.runtime._state_dict import merge_unpacked
from jpipe.runtime.build.key_arrays import host_key_data, key_data
from jpipe.runtime.build.loss_scale import DynamicLossScale
from jpipe.runtime.build.placement import local_copy


def _abstract_opt_trees(pipe) -> list:
  """Per stage, its optimizer state as optax's tree of abstract values."""
  return [
    jax.eval_shape(opt.state_tree, avals)
    for opt, avals in zip(
      pipe.stage_optimizers, stage_opt_avals(pipe), strict=True
    )
  ]


def _first_holders(pipe) -> list[int]:
  """Per param leaf, the first stage that holds it."""
  first = [None] * pipe.traced.num_param_leaves
  for s, spec in enumerate(pipe.stages.specs):
    for i in spec.param_leaves:
      if first[i] is None:
        first[i] = s
  return first


def _aval(a) -> jax.ShapeDtypeStruct:
  return jax.ShapeDtypeStruct(a.shape, a.dtype)


def _step_aval():
  return jax.ShapeDtypeStruct((), np.int64)


def _loss_scale_avals(pipe) -> dict | None:
  """A dynamic loss scale's state-dict entry as avals (None without
  one)."""
  if not isinstance(pipe.loss_scale, DynamicLossScale):
    return None
  return {
    "scale": jax.ShapeDtypeStruct((), np.float64),
    "good_steps": _step_aval(),
  }


def _with_loss_scale(tree: dict, entry) -> dict:
  """``tree`` with a dynamic loss scale's entry (none without one)."""
  return tree if entry is None else {**tree, "loss_scale": entry}


def local_state_dict(pipe, state) -> dict[str, Any]:
  """``state_dict``'s structure: the leaves this process writes as
  arrays, the others as ``jax.ShapeDtypeStruct``. Needs a drained
  pipeline; no collective."""
  check_drained(state, "local_state_dict")
  # (A replica group across processes: its lead writes it.)
  owns = pipe.transport.leads
  avals = stage_param_avals(pipe)
  params = []
  for i, s in enumerate(_first_holders(pipe)):
    j = pipe.stages.specs[s].param_leaves.index(i)
    params.append(
      local_copy(state.stage_params[s][j]) if owns(s) else _aval(avals[s][j])
    )
  abstract = _abstract_opt_trees(pipe)
  trees = [
    opt.state_tree(
      jax.device_get(jax.tree.map(local_copy, state.opt_states[s]))
    )
    if owns(s)
    else abstract[s]
    for s, opt in enumerate(pipe.stage_optimizers)
  ]
  opt_state, gap = merge_unpacked(pipe.stage_optimizers, trees)
  tree = {
    "params": jax.tree.unflatten(pipe.params_treedef, join_rows(pipe, params)),
    "opt_state": stack_keyed(pipe, opt_state),
    "gap_aware": stack_keyed(pipe, gap),
    "model_state": _local_model_state(pipe, state),
    "step": np.int64(state.step) if owns(0) else _step_aval(),
  }
  entry = _loss_scale_avals(pipe)
  if entry is not None and owns(0):  # (Every process's is the same.)
    scale = state.loss_scale
    entry = {
      "scale": np.float64(scale.scale),
      "good_steps": np.int64(scale.good_steps),
    }
  return _with_loss_scale(tree, entry)


def _local_model_state(pipe, state):
  """The model state leaves this process writes (each by the process of
  the stage that updates it; one no stage updates by stage 0's)."""
  if pipe.state_treedef is None:
    return None
  producer = {
    r: s for s, spec in enumerate(pipe.stages.specs) for r in spec.results
  }
  leaves = [
    x if pipe.transport.leads(producer.get(i + 1, 0)) else aval
    for i, (x, aval) in enumerate(
      zip(state.model_state, state_avals(pipe), strict=True)
    )
  ]
  # (A leaf stacked per layer: rows here and elsewhere are HeldRows;
  # typed PRNG keys as their key data, as ``state_dict`` gives them.)
  return jax.tree.map(host_key_data, model_state_of(pipe, leaves))


def state_dict_layout(pipe) -> tuple[dict[str, Any], dict[str, Any]]:
  """(``state_dict``'s structure with ``jax.ShapeDtypeStruct`` leaves,
  the same structure of booleans: whether this process's stages use the
  leaf). Step counts, Gap-Aware's scalars and the model state are used
  everywhere."""
  owned = [s for s in range(len(pipe.stages.specs)) if pipe.transport.owns(s)]
  abstract = _abstract_opt_trees(pipe)
  opt_state, gap = merge_unpacked(pipe.stage_optimizers, abstract)
  opt_state, gap = stack_keyed(pipe, opt_state), stack_keyed(pipe, gap)
  params = jax.tree.unflatten(pipe.params_treedef, model_param_avals(pipe))
  model_state = None
  if pipe.state_treedef is not None:
    model_state = jax.tree.map(
      key_data, model_state_of(pipe, state_avals(pipe))
    )
  layout = {
    "params": params,
    "opt_state": opt_state,
    "gap_aware": gap,
    "model_state": model_state,
    "step": _step_aval(),
  }
  used = {i for s in owned for i in pipe.stages.specs[s].param_leaves}
  # (A stacked leaf is needed where any of its rows is.)
  used_rows = [i in used for i in range(pipe.traced.num_param_leaves)]
  if pipe.traced.param_layout is not None:
    used_model = [False] * pipe.traced.param_layout.num_model_leaves
    for (i, _), u in zip(
      pipe.traced.param_layout.source, used_rows, strict=True
    ):
      used_model[i] = used_model[i] or u
    used_rows = used_model
  local_opt = _paths(
    [
      stack_keyed(pipe, pipe.stage_optimizers[s].base_state(abstract[s]))
      for s in owned
    ]
  )
  local_gap = _paths(
    [
      stack_keyed(pipe, abstract[s].sq_avg)
      for s in owned
      if pipe.stage_optimizers[s].gap_aware
    ]
  )
  any_gap = any(pipe.stage_optimizers[s].gap_aware for s in owned)
  needed = {
    "params": jax.tree.unflatten(pipe.params_treedef, used_rows),
    "opt_state": _marked(opt_state, local_opt),
    "gap_aware": {
      k: _marked(v, local_gap) if k == "sq_avg" else any_gap
      for k, v in gap.items()
    },
    "model_state": jax.tree.map(lambda _: True, model_state),
    "step": True,
  }
  entry = _loss_scale_avals(pipe)
  return _with_loss_scale(layout, entry), _with_loss_scale(
    needed, None if entry is None else {"scale": True, "good_steps": True}
  )


def _paths(trees) -> set[str]:
  """The ``keystr`` of every leaf of ``trees``."""
  return {
    jax.tree_util.keystr(path)
    for tree in trees
    for path, _ in jax.tree_util.tree_flatten_with_path(tree)[0]
  }


def _marked(tree, paths: set[str]):
  """``tree``'s structure: whether each leaf's path is in ``paths``."""
  return jax.tree_util.tree_map_with_path(
    lambda path, _: jax.tree_util.keystr(path) in paths, tree
  )
