"""A stage's params as its optimizer sees them: the model's own structure.

A stage stores the leaves it steps as a tuple, and their optimizer state
keyed by global path (``{"dense_0/kernel": ...}``: what merges into one
checkpoint, ``runtime/_state_dict.py``). The optimizer itself must see
them where the model declares them: optax's masks and labels are pytrees
shaped like the params (``optax.adamw(mask=tree)``,
``optax.multi_transform(..., labels)``) or functions reading their paths
(HuggingFace's Flax examples skip weight decay for ``path[-1] ==
"bias"``); over a ``{path: leaf}`` dict the first fail and the second
silently decay or freeze the wrong leaves.

So the optimizer is handed the model's params pytree with this stage's
leaves in place and None at every other stage's (None is an empty
subtree: ``jax.tree.map`` skips it, a mask or label tree of the whole
model still lines up, and a leaf's path is the one-device path). A leaf
stacked by a scan over layers, of which the stage holds some rows
(``leaf[k:k+1]``, named ``"path[k]"``), is seen as those rows
concatenated, in row order, on the leaf's layer axis (``nn.scan`` with
``variable_axes={"params": 1}`` stacks on axis 1: the optimizer sees the
leaf as the model lays it out, so its axes mean what they mean on one
device). State of the param's rank is split into rows on that axis;
state of another rank (Adafactor's factored moments) on axis 0. The
optimizer's state comes back in the same structure; ``keyed`` turns each params-shaped part of it (a subtree laid
out like the params: Adam's moments, a mask's inner state, Gap-Aware's
statistics) into the stored ``{path: leaf}`` dict, and ``structured``
turns it back, at the paths ``keyed`` found (a state's structure never
changes between steps).
"""

import math
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp

from jpipe.partition import move_axis


class ParamsView:
  """Moves a stage's managed leaves between its stored layout (a tuple;
  state keyed by name) and the model's params structure.

  Args:
    treedef: the model's params pytree structure (stacked leaves as the
      model declares them).
    names: the stored name of each managed leaf (a stacked leaf's row:
      ``"path[k]"``), in the stage optimizer's order.
    sources: per managed leaf, ``(model leaf index, row)``; row -1 for a
      leaf that is not a stacked leaf's row.
    axes: ``{model leaf index: (layer axis, ndim)}`` for each stacked leaf
      whose layers are not on axis 0 (its rows are ``[1, ...]`` slices of
      the leaf with that axis moved first).
  """

  def __init__(
    self,
    treedef,
    names: Sequence[str],
    sources: Sequence[tuple[int, int]],
    axes: Mapping[int, tuple[int, int]] | None = None,
  ):
    self.treedef = treedef
    self.names = tuple(names)
    self._axes = dict(axes or {})
    if len(sources) != len(self.names):
      raise ValueError("a ParamsView needs one source per managed leaf")
    # model leaf -> [(row, managed index)] in row order (row -1: whole).
    slots: dict[int, list[tuple[int, int]]] = {}
    for k, (i, r) in enumerate(sources):
      slots.setdefault(i, []).append((r, k))
    self._slots = {i: sorted(v) for i, v in slots.items()}
    for i, held in self._slots.items():
      if len(held) > 1 and any(r < 0 for r, _ in held):
        raise ValueError(f"model leaf {i} is managed twice")
    # The model's structure with each leaf's index at it.
    self._template = jax.tree.unflatten(treedef, range(treedef.num_leaves))
    self.keyed_paths = None  # paths of the state's params-shaped parts
    self._parts = {}  # path -> that part's structure
    self._shared = {}  # (path, model leaf) -> one value for all its rows

  # -- params, gradients, updates --------------------------------------

  def view(self, leaves: Sequence[Any]):
    """The managed ``leaves`` (in ``names``' order) as the model's pytree,
    None at the leaves other stages hold (traceable)."""
    out = [None] * self.treedef.num_leaves
    for i, held in self._slots.items():
      if held[0][0] < 0:
        out[i] = leaves[held[0][1]]
      else:
        out[i] = self._laid_out(i, _concat([leaves[k] for _, k in held]))
    return jax.tree.unflatten(self.treedef, out)

  def _laid_out(self, i: int, rows):
    """Rows of model leaf ``i`` joined on axis 0 -> its layout (state of
    another rank than the leaf's stays as it is)."""
    axis, ndim = self._axes.get(i, (0, 0))
    if axis and getattr(rows, "ndim", None) == ndim:
      return move_axis(rows, 0, axis)
    return rows

  def leaves(self, tree) -> list:
    """``view``'s inverse: the managed leaves of a tree in the model's
    structure (a stacked leaf's rows split off again)."""
    entries = self.treedef.flatten_up_to(tree)
    out = [None] * len(self.names)
    for i, held in self._slots.items():
      for part, (_, k) in zip(
        self._split(entries[i], i, held), held, strict=True
      ):
        out[k] = part
    return out

  # -- optimizer state -------------------------------------------------

  def keyed(self, state):
    """An optimizer state in the model's structure -> as stored: every
    params-shaped part a ``{name: value}`` dict (traceable)."""
    if self.keyed_paths is None:
      found = _find(state, lambda node: self._entries(node) is not None)
      # Each part's own structure, to rebuild it: a whole-model mask
      # leaves None or optax.MaskedNode (empty subtrees, perhaps standing
      # for a whole module) where this stage's leaves are not.
      self._parts = {
        path: jax.tree.structure(_at(state, path)) for path in found
      }
      self.keyed_paths = frozenset(found)
    return _convert(state, self.keyed_paths, self._to_keyed)

  def structured(self, stored):
    """``keyed``'s inverse (``keyed`` must have seen this optimizer's
    state once: ``StageOptimizer.init`` traces it)."""
    if self.keyed_paths is None:
      raise ValueError("ParamsView.structured before any keyed state")
    return _convert(stored, self.keyed_paths, self._from_keyed)

  def _entries(self, node) -> dict[int, Any] | None:
    """``{model leaf: what node holds there}`` for the managed leaves if
    ``node`` is laid out like the params -- the model's structure, an
    empty subtree (None, ``optax.MaskedNode``) standing for any part of
    it -- with nothing at other stages' leaves; else None."""
    if self.treedef.num_leaves < 2 or not jax.tree.leaves(node):
      return None  # (A one-leaf model's params match any leaf.)
    found = _match(node, self._template)
    if found is None:
      return None
    entries = {}
    for i, entry in found:
      if i not in self._slots:
        if jax.tree.leaves(entry):
          return None
      elif entry is None:
        return None
      else:
        entries[i] = entry
    return entries if len(entries) == len(self._slots) else None

  def _to_keyed(self, node, path) -> dict:
    entries = self._entries(node)
    out = {}
    for i, held in self._slots.items():
      parts = self._split(entries[i], i, held)
      # (Static: one value given to each row is read back from the first.)
      self._shared[path, i] = len(held) > 1 and parts[0] is parts[-1]
      out.update(
        (self.names[k], p) for (_, k), p in zip(held, parts, strict=True)
      )
    return out

  def _from_keyed(self, stored: dict, path):
    # The part's leaves in its flatten order: by model leaf, which is the
    # template's order (both flatten dict keys sorted).
    leaves = []
    for i in sorted(self._slots):
      held = self._slots[i]
      parts = [stored[self.names[k]] for _, k in held]
      one = held[0][0] < 0 or self._shared[path, i]
      leaves += jax.tree.leaves(
        parts[0] if one else self._laid_out(i, _concat(parts))
      )
    return jax.tree.unflatten(self._parts[path], leaves)

  def _split(self, entry, i: int, held) -> list:
    """Model leaf ``i``'s entry as its managed leaves: itself, or (a
    stacked leaf) one row each."""
    if held[0][0] < 0:
      return [entry]
    axis, ndim = self._axes.get(i, (0, 0))
    if axis and getattr(entry, "ndim", None) == ndim:
      entry = move_axis(entry, axis, 0)  # (``_laid_out``'s inverse.)
    shape = getattr(entry, "shape", None)
    if shape is None or math.prod(shape) == 1 != len(held):
      # A subtree without rows (optax.MaskedNode), or one value for the
      # leaf (Adafactor's placeholder of an unfactored leaf): each row's
      # (the rows' are equal; ``_concat`` takes the first).
      return [entry] * len(held)
    if shape[0] != len(held):
      raise ValueError(
        f"the optimizer keeps a value of shape {tuple(shape)} for "
        f"the {len(held)} rows of a scanned layer's leaf "
        f"({self.names[held[0][1]]}...) that this stage holds: it "
        "couples the rows (it is not one value per row), so the leaf's "
        "rows cannot be split between stages; use an optimizer whose "
        "state is per element or per row, or keep the scan's layers on "
        "one stage"
      )
    return [entry[j : j + 1] for j in range(len(held))]


class KeyedLeaves:
  """``ParamsView``'s interface for an optimizer that sees the
  ``{name: leaf}`` dict itself (its state is stored as it is)."""

  keyed_paths = frozenset()

  def __init__(self, names: Sequence[str]):
    self.names = tuple(names)

  def view(self, leaves: Sequence[Any]) -> dict:
    return dict(zip(self.names, leaves, strict=True))

  def leaves(self, tree: dict) -> list:
    return [tree[n] for n in self.names]

  def keyed(self, state):
    return state

  def structured(self, stored):
    return stored


def _match(node, template) -> list[tuple[int, Any]] | None:
  """``(model leaf, node's subtree there)`` for each leaf of
  ``template`` (the model's structure, leaf indices at its leaves), in
  its order, if ``node`` has that structure down to its leaves or to an
  empty subtree standing for a part of it (then each leaf under it has
  that subtree); else None."""
  if isinstance(template, int):
    return [(template, node)]
  if not jax.tree.leaves(node) and jax.tree.structure(node).num_nodes == 1:
    return [(i, node) for i in jax.tree.leaves(template)]
  mine, theirs = _children(node), _children(template)
  if mine is None or mine[2].node_data() != theirs[2].node_data():
    return None
  out = []
  for child, sub in zip(mine[1], theirs[1], strict=True):
    found = _match(child, sub)
    if found is None:
      return None
    out += found
  return out


def _at(tree, path):
  """The subtree of ``tree`` at ``path`` (keys as ``_children`` gives)."""
  for key in path:
    keys, children, _ = _children(tree)
    tree = children[keys.index(key)]
  return tree


def _concat(rows: list):
  """Rows ``(1, ...)`` as one ``(n, ...)`` leaf; one row as itself;
  subtrees without arrays (``optax.MaskedNode``) as the first."""
  if len(rows) == 1 or not hasattr(rows[0], "shape"):
    return rows[0]
  return jnp.concatenate(rows, axis=0)


def _children(node):
  """``node``'s immediate children with their keys, and how to rebuild
  it: ``(keys, children, treedef)``; None for a leaf (or None)."""
  if jax.tree.structure(node).num_nodes == 1:
    return None
  flat, treedef = jax.tree_util.tree_flatten_with_path(
    node, is_leaf=lambda x: x is not node
  )
  return [p[0] for p, _ in flat], [c for _, c in flat], treedef


def _find(tree, match, path=()) -> list[tuple]:
  """Paths (tuples of keys) of the outermost subtrees where ``match``."""
  if match(tree):
    return [path]
  node = _children(tree)
  if node is None:
    return []
  keys, children, _ = node
  found = []
  for key, child in zip(keys, children, strict=True):
    found += _find(child, match, (*path, key))
  return found


def _convert(tree, paths: frozenset, fn, path=()):
  """``tree`` with ``fn`` applied to the subtree at each of ``paths``."""
  if path in paths:
    return fn(tree, path)
  node = None
  if any(p[: len(path)] == path for p in paths):
    node = _children(tree)
  if node is None:
    return tree
  keys, children, treedef = node
  return jax.tree.unflatten(
    treedef,
    [
      _convert(c, paths, fn, (*path, k))
      for k, c in zip(keys, children, strict=True)
    ],
  )
