"""A loop over layers that indexes their stacked params, read as a scan
over the params' rows.

Besides ``jax.lax.scan`` over stacked params (``_scan_layers``), JAX code
runs stacked layers with a counted loop: ``jax.lax.fori_loop(0, n, lambda
i, h: layer(params["w"][i], h), x)``, or ``dynamic_index_in_dim``. With
static bounds that is a ``scan`` with no scanned inputs: the stacked
params are constants of the body, which slices row ``i`` of each, and the
counter ``i`` is a carry (or, written ``scan(body, h, jnp.arange(n))``, a
scanned ``arange``). One equation, one node: the model could not be
split.

``indexed_loops_as_scans`` rewrites such a scan so that each stacked param
the body only reads row ``i`` of becomes a scanned input (its row, the
same value the slice read), which ``split_layer_scans`` then splits per
layer. A param qualifies when the loop runs forwards with a counter (a
carry that starts at 0 and adds 1 per iteration, or a scanned ``iota`` /
constant ``arange``), no other equation reads it, and every read of it in
the body is a ``dynamic_slice`` of one row on the same axis, of the
loop's length, whose start is the counter there (checked by evaluating
the start, for every iteration, from the counter alone) and 0 elsewhere.
A layer axis other than the first (``w[:, i]``, layers stacked as MaxText
stacks them) is scanned through a transpose moving it first, which
``split_layer_scans`` reads as it reads ``nn.scan``'s over params stacked
on that axis. Anything else leaves the loop as it is.
"""

import jax
import jax.extend.core as jcore
import numpy as np

from jpipe.partition._eval import eval_eqn, read
from jpipe.partition._inline_calls import inline_calls_reading
from jpipe.partition._scan_layers import read_counts


def indexed_loops_as_scans(
  closed: jcore.ClosedJaxpr, num_param_leaves: int
) -> jcore.ClosedJaxpr:
  """``closed`` with every indexed loop over stacked params rewritten as a
  scan over their rows (the same function; ``closed`` where none is)."""
  jaxpr = closed.jaxpr
  params = set(jaxpr.invars[:num_param_leaves])
  readers = read_counts(jaxpr)
  made = {v: e for e in jaxpr.eqns for v in e.outvars}
  values = dict(zip(jaxpr.constvars, closed.consts, strict=True))
  eqns, changed = [], False
  for eqn in jaxpr.eqns:
    new = _as_scan_over_rows(eqn, params, readers, made, values)
    changed |= len(new) != 1 or new[0] is not eqn
    eqns.extend(new)
  if not changed:
    return closed
  return jcore.ClosedJaxpr(jaxpr.replace(eqns=eqns), closed.consts)


def _counter(eqn, made, values):
  """The body's variable that is ``k`` in iteration ``k``: a carry that
  starts at 0 and adds 1 (``fori_loop``), or a scanned ``arange(length)``
  (``scan(body, h, jnp.arange(n))``); None where there is none. ``made``:
  the enclosing jaxpr's equation of each variable; ``values``: its
  constants' values."""
  p = eqn.params
  nc, nk, body = p["num_consts"], p["num_carry"], p["jaxpr"].jaxpr
  inside = {v: e for e in body.eqns for v in e.outvars}
  for j in range(nk):
    start = eqn.invars[nc + j]
    if not (
      isinstance(start, jcore.Literal)
      and np.issubdtype(np.asarray(start.val).dtype, np.integer)
      and int(start.val) == 0
    ):
      continue
    inc = inside.get(body.outvars[j])
    mine = body.invars[nc + j]
    if inc is None or inc.primitive.name != "add":
      continue
    a, b = inc.invars
    one = [x for x in (a, b) if isinstance(x, jcore.Literal)]
    if mine in (a, b) and one and int(one[0].val) == 1:
      return mine
  arange = np.arange(p["length"])
  for j, x in enumerate(eqn.invars[nc + nk :]):
    if not isinstance(x, jcore.Var) or x.aval.shape != arange.shape:
      continue
    e = made.get(x)
    if e is not None and e.primitive.name == "iota":
      steps = e.params["dimension"] == 0 and not e.params.get("sharding")
    else:
      value = values.get(x)
      steps = value is not None and np.array_equal(np.asarray(value), arange)
    if steps and np.issubdtype(x.aval.dtype, np.integer):
      return body.invars[nc + nk + j]
  return None


def _as_scan_over_rows(eqn, params, readers, made, values) -> list:
  """``[eqn]`` rewritten (module doc): transposes moving a param's layer
  axis first where it is not the first, then the scan; or ``[eqn]``."""
  p = eqn.params
  if (
    eqn.primitive.name != "scan"
    or p["reverse"]
    or p["length"] < 2
    or p["num_carry"] < 1
  ):
    return [eqn]
  counter = _counter(eqn, made, values)
  if counter is None:
    return [eqn]
  nc, length = p["num_consts"], p["length"]
  candidates = [
    c
    for c, v in enumerate(eqn.invars[:nc])
    if isinstance(v, jcore.Var)
    and v in params
    and length in v.aval.shape
    and readers.get(v, 0) == 1
  ]
  if not candidates:
    return [eqn]
  body = p["jaxpr"]
  stacked = [body.jaxpr.invars[c] for c in candidates]
  inner, consts = inline_calls_reading(body.jaxpr, list(body.consts), stacked)
  rows, axes = {}, {}
  for c, v in zip(candidates, stacked, strict=True):
    axis = _row_axis(inner, v, counter, length)
    if axis is not None:
      rows[v], axes[v] = c, axis
  if not rows:
    return [eqn]
  return _over_rows(eqn, inner, consts, rows, axes)


def _over_rows(eqn, inner, consts, rows: dict, axes: dict) -> list:
  """``eqn`` scanning ``rows`` (body var -> its const position), each on
  its axis in ``axes``, that ``inner`` (the body, its calls opened) read
  by ``dynamic_slice``: transposes for axes > 0, then the scan."""
  p = eqn.params
  nc = p["num_consts"]
  row_vars = {
    v: jcore.Var(
      jax.core.ShapedArray(_without(v.aval.shape, axes[v]), v.aval.dtype)
    )
    for v in rows
  }
  body_eqns = []
  for e in inner.eqns:
    if e.primitive.name == "dynamic_slice" and e.invars[0] in rows:
      v = e.invars[0]
      body_eqns.append(_expand(row_vars[v], e, axes[v]))
    else:
      body_eqns.append(e)
  kept = [c for c in range(nc) if c not in rows.values()]
  new_body = inner.replace(
    invars=[
      *(inner.invars[c] for c in kept),
      *inner.invars[nc:],
      *row_vars.values(),
    ],
    eqns=body_eqns,
  )
  new_params = {
    **p,
    "jaxpr": jcore.ClosedJaxpr(new_body, consts),
    "num_consts": len(kept),
  }
  if "linear" in p:  # (Older JAX: one flag per input.)
    lin = p["linear"]
    new_params["linear"] = (
      *(lin[c] for c in kept),
      *lin[nc:],
      *(False for _ in rows),
    )
  # A layer axis a > 0 (w[:, i]): the scan reads the param with that axis
  # moved first (what nn.scan(variable_axes={"params": a}) reads too).
  moved = []
  scanned = []
  for v, c in rows.items():
    x = eqn.invars[c]
    if axes[v]:
      moved.append(_moved_first(x, axes[v], eqn))
      x = moved[-1].outvars[0]
    scanned.append(x)
  return [
    *moved,
    eqn.replace(
      invars=[
        *(eqn.invars[c] for c in kept),
        *eqn.invars[nc:],
        *scanned,
      ],
      params=new_params,
    ),
  ]


def _without(shape, axis: int) -> tuple:
  return (*shape[:axis], *shape[axis + 1 :])


def _row_axis(body, v, counter, length) -> int | None:
  """The axis whose row ``counter`` every read of ``v`` in ``body`` is (a
  one-row ``dynamic_slice`` starting at the counter there and at 0 on the
  other axes, for every iteration); None where there is no such axis."""
  uses = [e for e in body.eqns if v in e.invars]
  if not uses or v in body.outvars:
    return None
  made = {x: e for e in body.eqns for x in e.outvars}
  shape = v.aval.shape
  axis = None
  for e in uses:
    if e.primitive.name != "dynamic_slice" or e.invars.count(v) != 1:
      return None
    sizes = tuple(e.params["slice_sizes"])
    if e.invars[0] is not v:
      return None
    cut = [d for d in range(len(shape)) if sizes[d] != shape[d]]
    if len(cut) != 1 or sizes[cut[0]] != 1 or shape[cut[0]] != length:
      return None
    if axis is not None and cut[0] != axis:
      return None
    axis = cut[0]
    for k in range(length):
      starts = _from_counter(e.invars[1:], made, counter, k)
      want = [k if d == axis else 0 for d in range(len(shape))]
      if starts is None or [int(s) for s in starts] != want:
        return None
  return axis


def _moved_first(x, axis: int, like):
  """A transpose moving ``x``'s axis ``axis`` to the front."""
  rest = [d for d in range(x.aval.ndim) if d != axis]
  out = jcore.Var(
    jax.core.ShapedArray(
      (x.aval.shape[axis], *_without(x.aval.shape, axis)), x.aval.dtype
    )
  )
  return jcore.new_jaxpr_eqn(
    [x],
    [out],
    jax.lax.transpose_p,
    {"permutation": (axis, *rest)},
    jcore.no_effects,
    like.source_info,
  )


def _from_counter(atoms, made, counter, k):
  """The values of ``atoms`` when the counter is ``k``, evaluated from it
  and literals alone; None where they read anything else."""
  env = {counter: np.int32(k)}

  def visit(x) -> bool:
    if isinstance(x, jcore.Literal) or x in env:
      return True
    e = made.get(x)
    if e is None or list(jcore.jaxprs_in_params(e.params)):
      return False
    if not all(visit(y) for y in e.invars):
      return False
    eval_eqn(e, env)
    return True

  if not all(visit(x) for x in atoms):
    return None
  return [np.asarray(read(env, x)) for x in atoms]


def _expand(row, like, axis: int):
  """``like``'s output (a slice of size 1 on ``axis``) from ``row`` (the
  slice without that axis)."""
  (out,) = like.outvars
  return jcore.new_jaxpr_eqn(
    [row],
    [out],
    jax.lax.broadcast_in_dim_p,
    {
      "shape": out.aval.shape,
      "broadcast_dimensions": _without(tuple(range(out.aval.ndim)), axis),
      "sharding": None,
    },
    jcore.no_effects,
    like.source_info,
  )
