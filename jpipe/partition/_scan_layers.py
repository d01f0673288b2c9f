"""A scan over layers seen as one node per layer.

Production JAX models stack their layers' params (a leading axis of the
layer count) and run them under a scan, so XLA compiles one layer instead
of N: linen's ``nn.scan``, ``jax.lax.scan`` over stacked params. In the
jaxpr that is one ``scan`` equation whose scanned inputs (``xs``) are
param leaves of shape ``[length, ...]``: one node, one stage.

``split_layer_scans`` rewrites such an equation into ``length`` scans of
length 1, one per iteration, each reading its own rows of the stacked
params: the stacked leaf becomes ``length`` param leaves of shape
``[1, ...]`` (its rows, in order), which the solver places like any other
leaves. Scanned inputs that are not params (per-layer RNG keys) are sliced
per iteration, and the stacked outputs (``ys``) concatenated after the
last. The body is unchanged (a ``remat`` inside keeps its policy). A stage
holding iterations i..j runs them as one scan of length j - i + 1 again
(``fuse_runs``), forward and backward: compile stays one layer per stage.

A model may stack its layers on another axis than the first (MaxText's
``param_scan_axis=1``, flaxformer's ``scan_axis=1``: ``nn.scan`` with
``variable_axes={"params": 1}``); the scan then reads a transpose moving
that axis first. Such a leaf is split the same way, each row taken from
the moved leaf (shape ``[1, ...]``, the layer axis first: what the stages
and their optimizers hold), and the transpose dropped. A scan nested in
a scan (``nn.remat_scan``) reads its leaves ``[a, b, ...]`` through a
reshape to ``[a * b, ...]`` (``_nested_scans``): rows of the reshaped
leaf, the reshape dropped.

``ParamLayout`` maps the model's param leaves (stacked) to the traced
model's (rows) and back: what ``gather_params``, checkpoints and the state
dict use to keep the model's own layout.
"""

import dataclasses
from collections.abc import Sequence
from typing import Any

import jax
import jax.extend.core as jcore
import jax.numpy as jnp
import numpy as np

from jpipe.partition._row_forwarding import forward_rows


@dataclasses.dataclass(frozen=True)
class ParamLayout:
  """The traced model's param leaves as rows of the model's leaves.

  Attributes:
    source: per traced param leaf, ``(model leaf index, row)``; row -1: the
      whole model leaf; row k: ``leaf[k:k+1]`` of a stacked leaf.
    num_model_leaves: how many param leaves the model declares.
    axes: per model leaf, the axis its layers are stacked on (a row k is
      ``moveaxis(leaf, axis, 0)[k:k+1]``); empty: 0 for every leaf.
    merged: per model leaf, the leading axes its rows index when there
      are several (a nested scan's ``(a, b)``: row ``i * b + j`` is
      ``leaf[i, j]``, kept ``[1, ...]``), else ``()``; empty: ``()`` for
      every leaf.
  """

  source: tuple[tuple[int, int], ...]
  num_model_leaves: int
  axes: tuple[int, ...] = ()
  merged: tuple[tuple[int, ...], ...] = ()

  @property
  def identity(self) -> bool:
    return all(r < 0 for _, r in self.source)

  def axis(self, i: int) -> int:
    """The axis model leaf ``i``'s layers are stacked on."""
    return self.axes[i] if self.axes else 0

  def layers(self, i: int) -> tuple[int, ...]:
    """The leading axes model leaf ``i``'s rows index, when several."""
    return self.merged[i] if self.merged else ()

  def stacked(self, i: int, x):
    """Model leaf ``i`` (array, NumPy array or ``ShapeDtypeStruct``) as
    its rows stacked on axis 0."""
    return merge_leading(move_axis(x, self.axis(i), 0), self.layers(i))

  def unstacked(self, i: int, x):
    """``stacked``'s inverse: rows on axis 0 -> model leaf ``i``."""
    return move_axis(split_leading(x, self.layers(i)), 0, self.axis(i))

  def to_traced(self, leaves: Sequence[Any]) -> list:
    """The model's param leaves -> the traced model's (rows sliced)."""
    if len(leaves) != self.num_model_leaves:
      raise ValueError(
        f"expected {self.num_model_leaves} param leaves, got {len(leaves)}"
      )
    return [
      leaves[i] if r < 0 else _row(self.stacked(i, leaves[i]), r)
      for i, r in self.source
    ]

  def to_model(self, leaves: Sequence[Any]) -> list:
    """The traced model's param leaves -> the model's (rows stacked)."""
    rows: list[list] = [[] for _ in range(self.num_model_leaves)]
    for (i, _), x in zip(self.source, leaves, strict=True):
      rows[i].append(x)
    return [
      r[0] if len(r) == 1 else self.unstacked(i, _stack(r))
      for i, r in enumerate(rows)
    ]

  def traced_names(self, model_names: Sequence[str]) -> tuple[str, ...]:
    """Names of the traced leaves: a row is its leaf's name + ``[k]``."""
    return tuple(
      model_names[i] if r < 0 else f"{model_names[i]}[{r}]"
      for i, r in self.source
    )


def move_axis(x, source: int, destination: int):
  """``x`` (an array, a ``ShapeDtypeStruct`` or None) with axis ``source``
  moved to ``destination``; NumPy arrays stay on the host."""
  if source == destination or x is None:
    return x
  if isinstance(x, jax.ShapeDtypeStruct):
    shape = list(x.shape)
    shape.insert(destination, shape.pop(source))
    return jax.ShapeDtypeStruct(tuple(shape), x.dtype)
  if isinstance(x, np.ndarray):
    return np.moveaxis(x, source, destination)
  return jnp.moveaxis(x, source, destination)


def merge_leading(x, dims: tuple[int, ...]):
  """``x`` (as ``move_axis`` takes) with its leading ``len(dims)`` axes,
  of sizes ``dims``, as one (row-major); ``x`` when ``dims`` is empty."""
  if not dims or x is None:
    return x
  shape = (int(np.prod(dims)), *x.shape[len(dims) :])
  if isinstance(x, jax.ShapeDtypeStruct):
    return jax.ShapeDtypeStruct(shape, x.dtype)
  return x.reshape(shape)


def split_leading(x, dims: tuple[int, ...]):
  """``merge_leading``'s inverse: the leading axis as ``dims``."""
  if not dims or x is None:
    return x
  shape = (*dims, *x.shape[1:])
  if isinstance(x, jax.ShapeDtypeStruct):
    return jax.ShapeDtypeStruct(shape, x.dtype)
  return x.reshape(shape)


def _row(x, r: int):
  if isinstance(x, jax.ShapeDtypeStruct):
    return jax.ShapeDtypeStruct((1, *x.shape[1:]), x.dtype)
  return x[r : r + 1]


def _stack(rows):
  if any(x is None for x in rows):
    return None
  if isinstance(rows[0], jax.ShapeDtypeStruct):
    return jax.ShapeDtypeStruct((len(rows), *rows[0].shape[1:]), rows[0].dtype)
  if all(isinstance(x, np.ndarray) for x in rows) or _on_several_devices(rows):
    return np.concatenate([np.asarray(x) for x in rows])  # (On the host.)
  return jnp.concatenate(rows)


def _on_several_devices(rows) -> bool:
  """Whether ``rows`` are concrete arrays on different devices (rows that
  several stages held): joined on the host."""
  if any(isinstance(x, jax.core.Tracer) for x in rows):
    return False
  devices = {
    frozenset(x.sharding.device_set) for x in rows if isinstance(x, jax.Array)
  }
  return len(devices) > 1


@dataclasses.dataclass(frozen=True)
class Split:
  """``split_layer_scans``'s result.

  Attributes:
    closed_jaxpr: the rewritten loss (param inputs: the rows).
    layout: the traced param leaves as rows of the model's.
    scopes: per equation, its module path when the rewrite made it (an
      iteration's ``(*outer, "name[k]")``), else None (its own name stack).
    iteration: per equation, ``(scan id, k)`` for iteration k's scan of
      length 1, else None.
    slices: per equation, the scan id when it slices a non-param scanned
      input for one iteration, else None.
  """

  closed_jaxpr: jcore.ClosedJaxpr
  layout: ParamLayout
  scopes: tuple[tuple[str, ...] | None, ...]
  iteration: tuple[tuple[int, int] | None, ...]
  slices: tuple[int | None, ...]


def split_layer_scans(closed, num_param_leaves: int, name_of) -> Split:
  """Rewrites every scan over layers of ``closed`` (module doc).

  A scan qualifies when it runs forwards, carries a value, is longer than
  one, and scans at least one param input of leading size ``length`` that
  no other equation reads. ``name_of(eqn) -> (outer path, base name)``
  names an iteration's node ``(*outer, f"{base}[{k}]")``.
  """
  jaxpr = closed.jaxpr
  params = list(jaxpr.invars[:num_param_leaves])
  plans, stacked, moved = _layer_scans(jaxpr, params)
  source, invars = [], []
  axes, merged = [0] * num_param_leaves, [()] * num_param_leaves
  for i, v in enumerate(params):
    _, xs, axes[i], merged[i] = moved.get(v, (None, v, 0, ()))
    if xs in stacked:
      source.extend((i, k) for k in range(len(stacked[xs])))
      invars.extend(stacked[xs])
    else:
      source.append((i, -1))
      invars.append(v)
  layout = ParamLayout(
    tuple(source),
    num_param_leaves,
    tuple(axes) if any(axes) else (),
    tuple(merged) if any(merged) else (),
  )
  if not plans:
    none = (None,) * len(jaxpr.eqns)
    return Split(closed, layout, none, none, none)
  dropped = {e for e, *_ in moved.values()}  # (Their rows are the params.)
  eqns, scopes, iteration, slices = [], [], [], []
  for i, eqn in enumerate(jaxpr.eqns):
    if i in dropped:
      continue
    if i not in plans:
      eqns.append(eqn)
      scopes.append(None)
      iteration.append(None)
      slices.append(None)
      continue
    outer, base = name_of(eqn)
    for new, kind, k in _iterations(eqn, stacked):
      eqns.append(new)
      scopes.append((*outer, f"{base}[{k}]"))
      iteration.append((i, k) if kind == "scan" else None)
      slices.append(i if kind == "slice" else None)
  new_jaxpr = jaxpr.replace(
    invars=invars + list(jaxpr.invars[num_param_leaves:]), eqns=eqns
  )
  # Rows sliced back from the iterations' concatenation stay the rows.
  new_jaxpr, kept = forward_rows(new_jaxpr)
  scopes, iteration, slices = (
    [x[i] for i in kept] for x in (scopes, iteration, slices)
  )
  return Split(
    jcore.ClosedJaxpr(new_jaxpr, closed.consts),
    layout,
    tuple(scopes),
    tuple(iteration),
    tuple(slices),
  )


def read_counts(jaxpr) -> dict[Any, int]:
  """How many times each variable of ``jaxpr`` is read: once per equation
  input, twice as an output (a value returned is read whole)."""
  readers: dict[Any, int] = {}
  for eqn in jaxpr.eqns:
    for v in eqn.invars:
      if isinstance(v, jcore.Var):
        readers[v] = readers.get(v, 0) + 1
  for v in jaxpr.outvars:
    if isinstance(v, jcore.Var):
      readers[v] = readers.get(v, 0) + 2
  return readers


def _layer_scans(jaxpr, params) -> tuple[dict, dict, dict]:
  """``({scan eqn index: the stacked param vars it scans}, {stacked param
  var: fresh vars of its rows}, {param var stacked on another axis:
  (index of the transpose moving that axis first, the scanned var, the
  axis)})``; a stacked var is a param or such a transpose."""
  readers = read_counts(jaxpr)
  candidates = _moved_params(jaxpr, set(params), readers)
  scannable = set(params) | set(candidates)
  plans, stacked = {}, {}
  for i, eqn in enumerate(jaxpr.eqns):
    rows = _stacked_params(eqn, scannable, readers)
    if rows:
      plans[i] = rows
      for v in rows:
        stacked[v] = [
          _var((1, *v.aval.shape[1:]), v.aval.dtype)
          for _ in range(v.aval.shape[0])
        ]
  moved = {
    param: (e, xs, axis, dims)
    for xs, (e, param, axis, dims) in candidates.items()
    if xs in stacked
  }
  return plans, stacked, moved


def _moved_params(jaxpr, params: set, readers) -> dict:
  """``{var: (eqn index, param var, axis, merged dims)}`` for each
  transpose moving axis ``axis > 0`` of a param read by nothing else to
  the front (how ``nn.scan(variable_axes={"params": axis})`` reads its
  stacked params), and each reshape of such a param merging its two
  leading axes (a nested scan's, ``_nested_scans``)."""
  out = {}
  for i, eqn in enumerate(jaxpr.eqns):
    x = eqn.invars[0] if eqn.invars else None
    if not isinstance(x, jcore.Var) or x not in params or readers[x] != 1:
      continue
    if axis := axis_moved_first(eqn):
      out[eqn.outvars[0]] = (i, eqn.invars[0], axis, ())
    elif dims := leading_axes_merged(eqn):
      out[eqn.outvars[0]] = (i, eqn.invars[0], 0, dims)
  return out


def leading_axes_merged(eqn) -> tuple[int, ...]:
  """``(a, b)`` when ``eqn`` reshapes ``[a, b, ...]`` to ``[a * b, ...]``;
  ``()`` for any other equation."""
  if eqn.primitive.name != "reshape" or eqn.params.get("dimensions"):
    return ()
  shape = eqn.invars[0].aval.shape
  if len(shape) < 2:
    return ()
  merged = (shape[0] * shape[1], *shape[2:])
  return tuple(shape[:2]) if eqn.outvars[0].aval.shape == merged else ()


def axis_moved_first(eqn) -> int:
  """The axis > 0 that ``eqn``, a transpose, moves to the front keeping
  the others in order (how ``nn.scan(variable_axes={...: axis})`` reads
  a leaf stacked on that axis); 0 for any other equation."""
  if eqn.primitive.name != "transpose":
    return 0
  perm = tuple(eqn.params["permutation"])
  rest = tuple(d for d in range(len(perm)) if d != perm[0])
  return perm[0] if perm[1:] == rest else 0


def _stacked_params(eqn, params: set, readers) -> list:
  """The param vars ``eqn`` scans as layers (empty: not a layer scan)."""
  if eqn.primitive.name != "scan":
    return []
  p = eqn.params
  length = p["length"]
  if p["reverse"] or p["num_carry"] < 1 or length < 2:
    return []
  xs = eqn.invars[p["num_consts"] + p["num_carry"] :]
  return [
    v
    for v in dict.fromkeys(x for x in xs if isinstance(x, jcore.Var))
    if v in params
    and v.aval.shape[:1] == (length,)
    and readers.get(v, 0) == xs.count(v)
  ]


def _var(shape, dtype):
  return jcore.Var(jax.core.ShapedArray(shape, dtype))


def _iterations(eqn, stacked):
  """``(new eqn, "slice" | "scan" | "concat", k)``: the scan as ``length``
  scans of length 1 (each after the slices of its non-param scanned
  inputs), then the concatenation of each stacked output."""
  p = eqn.params
  nc, nk, length = p["num_consts"], p["num_carry"], p["length"]
  consts, carry = eqn.invars[:nc], list(eqn.invars[nc : nc + nk])
  xs = eqn.invars[nc + nk :]
  carry_out, ys_out = eqn.outvars[:nk], eqn.outvars[nk:]
  ys_rows = [[] for _ in ys_out]
  for k in range(length):
    row_xs = []
    for x in xs:
      if isinstance(x, jcore.Var) and x in stacked:
        row_xs.append(stacked[x][k])
        continue
      out = _var((1, *x.aval.shape[1:]), x.aval.dtype)
      yield _slice_eqn(x, out, k, eqn), "slice", k
      row_xs.append(out)
    last = k == length - 1
    outs = (
      list(carry_out)
      if last
      else [_var(v.aval.shape, v.aval.dtype) for v in carry_out]
    )
    for y, rows in zip(ys_out, ys_rows, strict=True):
      rows.append(_var((1, *y.aval.shape[1:]), y.aval.dtype))
      outs.append(rows[-1])
    yield (
      eqn.replace(
        invars=[*consts, *carry, *row_xs],
        outvars=outs,
        params={**p, "length": 1},
      ),
      "scan",
      k,
    )
    carry = outs[:nk]
  for y, rows in zip(ys_out, ys_rows, strict=True):
    if not isinstance(y, jcore.DropVar):
      yield _concat_eqn(rows, y, eqn), "concat", length - 1


def _slice_eqn(x, out, k, like):
  shape = x.aval.shape
  return jcore.new_jaxpr_eqn(
    [x],
    [out],
    jax.lax.slice_p,
    {
      "start_indices": (k,) + (0,) * (len(shape) - 1),
      "limit_indices": (k + 1, *shape[1:]),
      "strides": None,
    },
    jcore.no_effects,
    like.source_info,
  )


def _concat_eqn(rows, out, like):
  return jcore.new_jaxpr_eqn(
    list(rows),
    [out],
    jax.lax.concatenate_p,
    {"dimension": 0},
    jcore.no_effects,
    like.source_info,
  )


def fuse_runs(eqn_ids: Sequence[int], iteration, slices) -> list:
  """A stage's equations as items to evaluate in order: an equation index,
  or a tuple of the indices of consecutive iterations of one scan (to run
  as one scan). The slices feeding a run come first (they read only
  values from before the scan)."""
  items: list = []
  run: list[int] = []
  pending: list[int] = []  # slices met inside the run

  def flush():
    if run:
      items.extend(pending)
      items.append(tuple(run) if len(run) > 1 else run[0])
    else:
      items.extend(pending)
    run.clear()
    pending.clear()

  for i in eqn_ids:
    it = iteration[i]
    if it is not None:
      prev = iteration[run[-1]] if run else None
      if prev is not None and (prev[0], prev[1] + 1) != it:
        flush()
      run.append(i)
    elif slices[i] is not None and (
      not run or slices[i] == iteration[run[-1]][0]
    ):
      pending.append(i)
    else:
      flush()
      items.append(i)
  flush()
  return items


def eval_run(eqns: Sequence[Any], env) -> None:
  """Evaluates consecutive iterations (scans of length 1) of one scan as
  one scan over their rows, into ``env``."""
  first = eqns[0]
  p = first.params
  nc, nk = p["num_consts"], p["num_carry"]
  consts = [_read(env, v) for v in first.invars[:nc]]
  carry = [_read(env, v) for v in first.invars[nc : nc + nk]]
  xs = [
    jnp.concatenate([_read(env, e.invars[j]) for e in eqns])
    for j in range(nc + nk, len(first.invars))
  ]
  params = first.primitive.get_bind_params({**p, "length": len(eqns)})
  outs = first.primitive.bind(*consts, *carry, *xs, **params)
  for v, x in zip(eqns[-1].outvars[:nk], outs[:nk], strict=True):
    if not isinstance(v, jcore.DropVar):
      env[v] = x
  for j, y in enumerate(outs[nk:]):
    for k, e in enumerate(eqns):
      v = e.outvars[nk + j]
      if not isinstance(v, jcore.DropVar):
        env[v] = y[k : k + 1]


def _read(env, v):
  return v.val if isinstance(v, jcore.Literal) else env[v]
