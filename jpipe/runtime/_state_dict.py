"""Model-global training state: merge per-stage states, split them again.

Stage optimizer states keep their params-shaped parts as dicts keyed by
global leaf path (see ``_stage_optimizer``), so merging the stages is a
key-wise union and any partition can select its keys back.
"""

from collections.abc import Mapping, Sequence

import jax
import numpy as np

from jpipe.runtime.build.key_arrays import host_key_data, is_key, wrap_key_data


def merge_keyed(states):
  """One state from per-stage states whose params parts are keyed dicts.

  Dict nodes are merged key by key (the first stage holding a key wins);
  other leaves (step counts) come from stage 0.
  """
  first = states[0]
  if isinstance(first, dict):
    keys = []
    for st in states:
      keys += [k for k in st if k not in keys]
    return {k: merge_keyed([st[k] for st in states if k in st]) for k in keys}
  if isinstance(first, tuple) and hasattr(first, "_fields"):
    return type(first)(
      *(merge_keyed([getattr(st, f) for st in states]) for f in first._fields)
    )
  if isinstance(first, (tuple, list)):
    return type(first)(
      merge_keyed([st[i] for st in states]) for i in range(len(first))
    )
  return first


def keys_in(tree) -> frozenset:
  """Every dict key in ``tree`` (a saved optimizer state: its keyed
  parts' leaf paths among them)."""
  found = set()

  def walk(node):
    if isinstance(node, Mapping):
      found.update(k for k in node if isinstance(k, str))
      for v in node.values():
        walk(v)
    elif isinstance(node, (tuple, list)):
      for v in node:
        walk(v)

  walk(tree)
  return frozenset(found)


def select_keyed(saved, template, fresh=frozenset()):
  """``template``'s structure filled from ``saved`` (by dict key). A
  part of ``template`` holding no array (the placeholders of frozen
  leaves) needs nothing saved; keys in ``fresh`` (leaves frozen when
  saved, trained now) missing from ``saved`` keep ``template``'s values
  (a real fresh state's)."""
  if isinstance(template, dict):
    if not jax.tree.leaves(template):
      return template
    if not isinstance(saved, Mapping):
      raise ValueError("the saved optimizer state has another structure")
    missing = [k for k in template if k not in saved and k not in fresh]
    if missing:
      raise ValueError(
        f"the saved optimizer state lacks {missing[:3]}: it was saved for "
        f"another model or optimizer"
      )
    return {
      k: select_keyed(saved[k], v, fresh) if k in saved else v
      for k, v in template.items()
    }
  if isinstance(template, tuple) and hasattr(template, "_fields"):
    return type(template)(
      *(
        select_keyed(_field(saved, f, i, template), getattr(template, f), fresh)
        for i, f in enumerate(template._fields)
      )
    )
  if isinstance(template, (tuple, list)):
    if len(saved) != len(template):
      raise ValueError(
        "the saved optimizer state has another structure: it was saved for "
        "another optimizer"
      )
    return type(template)(
      select_keyed(saved[i], t, fresh) for i, t in enumerate(template)
    )
  if template is None:
    return None
  if is_key(template) and not is_key(saved):
    saved = wrap_key_data(np.asarray(saved), template)
  if np.shape(saved) != np.shape(template) and _squeezed(saved) == _squeezed(
    template
  ):
    # A stacked leaf's per-row value of one element: its rows were joined
    # as scalars or as (1,) rows, which read back alike (``_stacked``).
    saved = np.reshape(np.asarray(saved), np.shape(template))
  if np.shape(saved) != np.shape(template):
    raise ValueError(
      f"a saved optimizer leaf has shape {np.shape(saved)}, expected "
      f"{np.shape(template)}: it was saved for another model or optimizer"
    )
  dtype = getattr(template, "dtype", None) or np.asarray(template).dtype
  if getattr(saved, "dtype", None) == dtype:
    return saved  # (A leaf read when placed stays unread here.)
  return np.asarray(saved, dtype=dtype)


def _squeezed(x) -> tuple[int, ...]:
  return tuple(d for d in np.shape(x) if d != 1)


def on_host(leaf):
  """An array ``jax.device_put`` takes: arrays as they are, anything
  else (an object with ``__array__``, e.g. a checkpoint's leaf read
  when converted) converted."""
  if isinstance(leaf, (jax.Array, np.ndarray, np.generic, int, float)):
    return leaf
  return np.asarray(leaf)


def place_leaf(place, leaf):
  """``place(leaf)``, done before the next leaf is read: the host copy of
  a leaf read when converted is gone before the next is read."""
  return jax.block_until_ready(place(on_host(leaf)))


def _field(saved, name, index, template):
  """A NamedTuple field of ``saved`` (restored as a NamedTuple, a dict or
  a list, depending on the checkpoint library); a ValueError naming both
  states where ``saved`` has no such field (another optimizer's state)."""
  if isinstance(saved, Mapping):
    if name in saved or str(index) in saved:
      return saved[name] if name in saved else saved[str(index)]
  elif hasattr(saved, "_fields"):  # (Not tuple.count, tuple.index.)
    if name in saved._fields:
      return getattr(saved, name)
  elif isinstance(saved, (tuple, list)) and index < len(saved):
    return saved[index]
  found = type(saved).__name__
  if isinstance(saved, Mapping):
    found = f"a dict of {sorted(saved)[:4]}"
  raise ValueError(
    f"the saved optimizer state has {found} where this optimizer's has "
    f"{type(template).__name__} (its field {name!r}): it was saved for "
    "another optimizer"
  )


def restore_structure(tree, treedef):
  """``tree``'s leaves in ``treedef`` (a checkpoint may return lists for
  tuples); a leaf count mismatch is a clear error."""
  leaves = jax.tree.leaves(tree)
  if len(leaves) != treedef.num_leaves:
    raise ValueError(
      f"the saved model state has {len(leaves)} leaves, the model needs "
      f"{treedef.num_leaves}: it was saved for another model"
    )
  return jax.tree.unflatten(treedef, leaves)


def merge_optimizer_states(optimizers, opt_states) -> tuple[dict, dict]:
  """Stage optimizer states -> (the whole model's optimizer state, the
  Gap-Aware statistics ``{"sq_avg": {path: array}, "count",
  "max_learning_rate"}`` of Gap-Aware stages' leaves, {} without), on the
  host."""
  host = [jax.device_get(st) for st in opt_states]  # (Unpacked on the host.)
  return merge_unpacked(
    optimizers,
    [opt.state_tree(st) for opt, st in zip(optimizers, host, strict=True)],
  )


def merge_unpacked(optimizers, trees) -> tuple[dict, dict]:
  """``merge_optimizer_states`` of states already unpacked (optax's
  trees: host arrays, or abstract values)."""
  base = [
    jax.tree.map(host_key_data, opt.base_state(st))
    for opt, st in zip(optimizers, trees, strict=True)
  ]
  ga_states = [
    st for opt, st in zip(optimizers, trees, strict=True) if opt.gap_aware
  ]
  gap = {}
  if ga_states:
    gap = {
      "sq_avg": {k: v for st in ga_states for k, v in st.sq_avg.items()},
      "count": ga_states[0].count,
      "max_learning_rate": ga_states[0].max_learning_rate,
    }
  return merge_keyed(base), gap


def select_optimizer_states(
  tree: Mapping,
  optimizers,
  fresh_states: Sequence,
  places: Sequence,
  fresh_keys=frozenset(),
) -> list:
  """Each stage's optimizer state from a state dict's "opt_state" and
  "gap_aware", placed by ``places`` (per stage: a pytree -> the pytree on
  the stage's devices; applied leaf by leaf, so a leaf that is read when
  converted is on the host alone) and stored like ``fresh_states`` (a
  stage's ``StageOptimizer.init``'s, or its abstract value,
  ``jax.eval_shape``'s). Gap-Aware statistics of leaves saved off a
  Gap-Aware stage start fresh (from a real fresh state), and so do the
  leaves of ``fresh_keys`` (frozen when saved) that the saved state
  lacks."""
  out = []
  for opt, stored, place in zip(optimizers, fresh_states, places, strict=True):
    if any(
      isinstance(x, jax.ShapeDtypeStruct) for x in jax.tree.leaves(stored)
    ):
      fresh = jax.eval_shape(opt.state_tree, stored)  # (Structure only.)
    else:
      fresh = opt.state_tree(jax.device_get(stored))
    loaded = select_keyed(tree["opt_state"], opt.base_state(fresh), fresh_keys)
    if opt.gap_aware:
      gap = tree.get("gap_aware") or {}
      sq = {k: gap.get("sq_avg", {}).get(k, v) for k, v in fresh.sq_avg.items()}
      loaded = fresh._replace(
        inner_state=loaded,
        sq_avg=sq,
        count=gap.get("count", fresh.count),
        max_learning_rate=gap.get("max_learning_rate", fresh.max_learning_rate),
      )
    loaded = jax.tree.map(lambda x, place=place: place_leaf(place, x), loaded)
    out.append(place(opt.stored_like(stored, loaded)))
  return out
