"""A ``shard_map`` in a loss run on one device: its body vmapped over the
mesh axes it maps, its collectives over vmap's named axes.

Production JAX code writes kernels per shard with ``jax.shard_map``
(an expert-parallel MoE's ``all_to_all``, a row-parallel matmul's
``psum``, ring attention's ``ppermute``). A stage runs on one device with
no mesh, and the traced body has the shapes of one shard. ``emulated``
turns such an equation into the same function of the global arrays:
each input is cut into its shards along its ``in_specs`` (stacked on
leading axes, one per manual mesh axis), the body runs under one
``jax.vmap(axis_name=...)`` per manual axis, so every collective means
what it meant across the mesh (``psum`` sums the shards, ``all_gather``
stacks them, ``axis_index`` is the shard's index), and the shards are
put back along the ``out_specs``. Results equal the mesh's (the same
arithmetic, in one program); a value replicated over an axis is taken
from its first shard, as ``out_specs`` asserts they are equal.
"""

import math
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.extend.core as jcore
from jax.extend.core import primitives

# A body's collectives that check manual-axis types (which a vmap's values
# have none of), as the same collectives without the check: primitive,
# its parameters from the checked one's. (``pvary``, a type-only cast, is
# dropped by ``_plain_types``.)
UNCHECKED: dict[str, tuple[Any, Callable[[dict], dict]]] = {
  "psum_invariant": (
    primitives.psum_p,
    lambda p: {"axes": p["axes"], "axis_index_groups": None},
  ),
  "all_gather_invariant": (
    primitives.all_gather_p,
    lambda p: {**p, "axis_index_groups": None},
  ),
}


def emulated(eqn: jcore.JaxprEqn, body: jcore.Jaxpr) -> jcore.JaxprEqn:
  """``eqn`` (a ``shard_map``) as a ``closed_call`` of the same function
  of the global arrays on one device; ``body``: its body on plain types
  (``_plain_types``), evaluated per shard under named vmaps."""
  params = eqn.params
  mesh = params["mesh"]
  axes = [a for a in mesh.axis_names if a in params["newly_manual_axes"]]
  sizes = {a: mesh.shape[a] for a in axes}
  in_avals = [v.aval for v in eqn.invars]

  def per_shard(*args):
    return jax.core.eval_jaxpr(body, [], *args)

  def function(*args):
    cut = [
      _shards(x, s, axes, sizes)
      for x, s in zip(args, params["in_specs"], strict=True)
    ]
    fn = per_shard
    for k in reversed(range(len(axes))):
      fn = jax.vmap(
        fn,
        in_axes=[0 if axes[k] in held else None for _, held in cut],
        axis_name=axes[k],
        axis_size=sizes[axes[k]],
      )
    outs = fn(*[x for x, _ in cut])
    return [
      _whole(x, s, axes, sizes)
      for x, s in zip(outs, params["out_specs"], strict=True)
    ]

  closed = jax.make_jaxpr(function)(
    *[jax.ShapeDtypeStruct(a.shape, a.dtype) for a in in_avals]
  )
  return jcore.new_jaxpr_eqn(
    eqn.invars,
    eqn.outvars,
    primitives.closed_call_p,
    {"call_jaxpr": closed},
    closed.effects,
    eqn.source_info,
    eqn.ctx,
  )


def _names(entry) -> tuple:
  """The mesh axes one ``PartitionSpec`` entry shards its dimension on."""
  if entry is None:
    return ()
  return tuple(entry) if isinstance(entry, tuple) else (entry,)


def _shards(x, spec, axes: Sequence[str], sizes: dict):
  """``x`` cut along ``spec``: its shards stacked on leading axes, one per
  mesh axis it is sharded on (in ``axes``' order); (array, those axes)."""
  shape, lead, kept = [], [], []
  for d, size in enumerate(x.shape):
    names = _names(spec[d] if d < len(spec) else None)
    for a in names:  # (Major to minor, as the mesh lays them out.)
      lead.append((a, len(shape)))
      shape.append(sizes[a])
    kept.append(len(shape))
    shape.append(size // math.prod(sizes[a] for a in names))
  held = [a for a in axes if a in dict(lead)]
  order = [dict(lead)[a] for a in held] + kept
  return jax.numpy.transpose(x.reshape(shape), order), held


def _whole(x, spec, axes: Sequence[str], sizes: dict):
  """The shards ``x`` (leading axes: one per mesh axis) put together along
  ``spec``; over an axis ``spec`` does not name, the first shard's."""
  used = {a for entry in spec for a in _names(entry)}
  x = x[tuple(slice(None) if a in used else 0 for a in axes)]
  held = [a for a in axes if a in used]
  order, shape = [], []
  for d, size in enumerate(x.shape[len(held) :]):
    names = _names(spec[d] if d < len(spec) else None)
    order += [held.index(a) for a in names] + [len(held) + d]
    shape.append(size * math.prod(sizes[a] for a in names))
  return jax.numpy.transpose(x, order).reshape(shape)
