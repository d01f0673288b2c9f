"""The model's own layout of stacked params in what the user reads.

A scan over layers is traced with its stacked param leaves split into
rows (``partition._scan_layers``): the stages, their optimizers and their
states hold rows (``leaf[k:k+1]``, named ``"path[k]"``). What leaves the
pipeline -- ``gather_params``, ``state_dict``, checkpoints -- holds the
stacked arrays as the model declares them, and what comes in is split
again (model state stacked per layer too: ``model_state_of``), so a
checkpoint resumes under any split (a process holding some
of a stacked leaf's rows gives them as ``HeldRows``, for a per-process
checkpoint). Each function reads the
pipeline's ``traced`` and ``leaf_names`` (the rows' names).

A leaf stacked on another axis than the first (``nn.scan`` with
``variable_axes={"params": 1}``) has rows of the moved leaf (its layer
axis first); joined, it is moved back: the params, and the optimizer
state of the param's rank (its moments), are in the model's layout. State
of another rank (Adafactor's factored moments) stays stacked on axis 0.
A scan in a scan's leaf ``[a, b, ...]`` has rows of it reshaped ``[a * b,
...]``; joined, they are reshaped back (``ParamLayout.merged``).
"""

import dataclasses
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jpipe.partition import merge_leading, move_axis, split_leading
from jpipe.runtime.build.key_arrays import host_key_data, is_key, key_data


def model_param_avals(pipe) -> list[jax.ShapeDtypeStruct]:
  """The model's param leaves' shapes and dtypes (stacked)."""
  n = pipe.traced.num_param_leaves
  rows = [
    jax.ShapeDtypeStruct(a.shape, a.dtype)
    for a in pipe.traced.closed_jaxpr.in_avals[:n]
  ]
  return pipe.traced.model_leaves(rows)


def _rows(pipe) -> dict[str, tuple[str, int, int, int, tuple]]:
  """Row name -> (model leaf name, row, model leaf's ndim, its layer
  axis, the leading axes its rows index when several)."""
  layout = pipe.traced.param_layout
  if layout is None:
    return {}
  avals = model_param_avals(pipe)
  names = model_names(pipe)
  return {
    row_name: (
      names[i],
      r,
      len(avals[i].shape),
      layout.axis(i),
      layout.layers(i),
    )
    for row_name, (i, r) in zip(pipe.leaf_names, layout.source, strict=True)
    if r >= 0
  }


def model_names(pipe) -> list[str]:
  """The model's param leaf names (a row's name less its ``[k]``)."""
  layout = pipe.traced.param_layout
  if layout is None:
    return list(pipe.leaf_names)
  names = [None] * layout.num_model_leaves
  for name, (i, r) in zip(pipe.leaf_names, layout.source, strict=True):
    names[i] = name if r < 0 else name[: name.rindex("[")]
  return names


def join_rows(pipe, leaves: list) -> list:
  """Traced param leaves (arrays, or abstract values for another
  process's) -> the model's: a stacked leaf's rows joined by ``_join``."""
  return _joined(pipe.traced.param_layout, leaves)


def model_state_of(pipe, leaves: list) -> Any:
  """The pipeline's model-state leaves (arrays, or abstract values for
  another process's) -> the model's state pytree: the rows of a leaf
  stacked per layer (``build/state_rows.py``) joined by ``_join``."""
  rows = pipe.state_rows
  if rows is None:
    return jax.tree.unflatten(pipe.state_treedef, leaves)
  return jax.tree.unflatten(rows.treedef, _joined(rows.layout, leaves))


def _joined(layout, leaves: list) -> list:
  if layout is None:
    return list(leaves)
  rows: list[list] = [[] for _ in range(layout.num_model_leaves)]
  for (i, _), x in zip(layout.source, leaves, strict=True):
    rows[i].append(x)
  return [
    r[0] if len(r) == 1 else _moved(_join(r), layout.axis(i), layout.layers(i))
    for i, r in enumerate(rows)
  ]


def stack_keyed(pipe, tree):
  """``tree`` (an optimizer state or Gap-Aware statistics keyed by leaf
  name) with every dict's rows of a stacked leaf joined under the leaf's
  name, in the model's layout. Rows missing (another process's): the
  leaf is None, or its abstract value when all rows are abstract."""
  rows = _rows(pipe)
  if not rows:
    return tree
  return _map_dicts(tree, lambda d: _stack_dict(d, rows))


def split_keyed(pipe, tree):
  """``stack_keyed``'s inverse: every dict's stacked leaves as rows."""
  rows = _rows(pipe)
  if not rows:
    return tree
  by_model = {}
  for row_name, (name, *where) in rows.items():
    by_model.setdefault(name, []).append((row_name, *where))
  return _map_dicts(tree, lambda d: _split_dict(d, by_model))


def _map_dicts(tree, fn):
  if isinstance(tree, Mapping):
    return fn({k: _map_dicts(v, fn) for k, v in tree.items()})
  if isinstance(tree, tuple) and hasattr(tree, "_fields"):
    return type(tree)(*(_map_dicts(x, fn) for x in tree))
  if isinstance(tree, (tuple, list)):
    return type(tree)(_map_dicts(x, fn) for x in tree)
  return tree


def _stack_dict(d: dict, rows) -> dict:
  out, groups, shapes = {}, {}, {}
  for k, v in d.items():
    if k in rows:
      name, r, *layout = rows[k]
      groups.setdefault(name, {})[r] = v
      shapes[name] = layout
      out.setdefault(name, None)
    else:
      out[k] = v
  for name, parts in groups.items():
    joined = _join([parts[r] for r in sorted(parts)])
    ndim, axis, dims = shapes[name]
    # (State of the param's rank, its moments: in the param's layout.)
    if _ndim(joined) == _rows_ndim(ndim, dims):
      out[name] = _moved(joined, axis, dims)
    else:
      out[name] = joined
  return out


def _ndim(x) -> int:
  if isinstance(x, HeldRows):
    return len(x.aval.shape)
  return len(np.shape(x)) if x is not None else -1


def _rows_ndim(ndim: int, dims: tuple) -> int:
  """The rank of the rows of a leaf of rank ``ndim`` whose rows index its
  leading axes ``dims`` (one axis for them all)."""
  return ndim - max(len(dims) - 1, 0)


def _moved(x, axis: int, dims: tuple = ()):
  """A joined leaf (stacked on axis 0) in its model layout: the rows'
  axis as the leading axes ``dims`` when several, at ``axis``."""
  if (axis == 0 and not dims) or x is None:
    return x
  if isinstance(x, HeldRows):
    aval = move_axis(split_leading(x.aval, dims), 0, axis)
    return dataclasses.replace(x, aval=aval, axis=axis, layers=dims)
  return move_axis(split_leading(x, dims), 0, axis)


@dataclasses.dataclass(frozen=True)
class HeldRows:
  """The rows of a stacked leaf this process holds, where other
  processes hold the others (their stages run those layers): ``aval``
  the whole leaf; ``pieces`` ``(first row, host array of consecutive
  rows)``, the rows on axis ``axis`` (the leaf's layer axis) as in
  ``aval``; ``layers``, when the rows index several leading axes (a
  nested scan's ``(a, b)``), their sizes: row ``k`` is ``[k // b, k %
  b]``, and a piece's rows are ``[rows, ...]``. A per-process checkpoint
  writes each piece (``jpipe.train.process_arrays``); a pytree leaf, not
  a node. Rows of typed PRNG keys are held as their key data (``aval``
  too: uint32 ``[..., k]``), as a state dict holds keys."""

  aval: jax.ShapeDtypeStruct
  pieces: tuple[tuple[int, np.ndarray], ...]
  axis: int = 0
  layers: tuple[int, ...] = ()


def _join(parts: list) -> Any:
  """A stacked leaf from its rows (arrays; another process's as
  ``ShapeDtypeStruct``): an array, its abstract value when no row is
  here, ``HeldRows`` when some are."""
  if any(p is None for p in parts):
    return None
  first = parts[0]
  scalar = len(np.shape(first)) == 0  # Rows stacked from scalars.
  sizes = [1 if scalar else p.shape[0] for p in parts]
  abstract = [isinstance(p, jax.ShapeDtypeStruct) for p in parts]
  rest = () if scalar else tuple(first.shape[1:])
  aval = jax.ShapeDtypeStruct((sum(sizes), *rest), first.dtype)
  if all(abstract):
    return aval
  if not any(abstract) and jax.dtypes.issubdtype(
    first.dtype, jax.dtypes.prng_key
  ):  # (Typed keys, NumPy has no dtype for: joined by JAX.)
    join = jnp.stack if scalar else jnp.concatenate
    return join([jax.device_put(p, jax.devices("cpu")[0]) for p in parts])
  if not any(abstract):
    return _stacked([np.asarray(p) for p in parts], scalar)
  pieces, run, start, row = [], [], 0, 0
  for p, size, gone in zip(parts, sizes, abstract, strict=True):
    if gone and run:
      pieces.append((start, _stacked(run, scalar)))
      run = []
    elif not gone:
      start = start if run else row
      run.append(host_key_data(p) if is_key(p) else np.asarray(p))
    row += size
  if run:
    pieces.append((start, _stacked(run, scalar)))
  # (Typed keys' rows are held as their key data: what a file holds.)
  return HeldRows(key_data(aval), tuple(pieces))


def _stacked(host: list, scalar: bool) -> np.ndarray:
  return np.stack(host) if scalar else np.concatenate(host)


def _split_dict(d: dict, by_model) -> dict:
  out = {}
  for k, v in d.items():
    if k not in by_model:
      out[k] = v
      continue
    for row_name, r, ndim, axis, dims in by_model[k]:
      out[row_name] = _row(v, r, ndim, axis, dims)
  return out


def _row(x, r: int, ndim: int, axis: int, dims: tuple):
  # Stacked from scalars.
  per_row_scalar = len(np.shape(x)) < _rows_ndim(ndim, dims)
  if len(np.shape(x)) == ndim:  # (In the param's layout: ``_moved``.)
    x = merge_leading(move_axis(x, axis, 0), dims)
  if isinstance(x, jax.ShapeDtypeStruct):
    shape = () if per_row_scalar else (1, *x.shape[1:])
    return jax.ShapeDtypeStruct(shape, x.dtype)
  return x[r] if per_row_scalar else x[r : r + 1]
