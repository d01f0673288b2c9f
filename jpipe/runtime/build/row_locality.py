"""Whether an optimizer's step keeps the rows of a scanned leaf apart.

A model whose layers run under a scan keeps each layer's params stacked
on a leading axis; a pipeline may split those rows between stages, and
each stage's optimizer then steps its own rows. That is one device's step
where the update of row r reads row r alone (adam, sgd, Adafactor's
factored moments), not where it reduces over the rows: Adafactor's
default update clipping (``clip_by_block_rms``) and parameter scale
(``scale_by_param_block_rms``) take an RMS over the whole leaf, which per
stage would be over that stage's rows -- a silently different step.

``mixed_rows`` follows the optimizer's jaxpr (``jaxpr_flow``) with, per
value, the row-split inputs it is computed from row by row, by the axis
of the value that holds their rows (``aligned``: a leaf stacked on axis
1, as ``nn.scan(variable_axes={"params": 1})`` stacks, has its rows on
axis 1), and those whose rows it mixes (``mixed``). Elementwise
operations, reductions and contractions away from the rows' axis,
transposes, broadcasts and reshapes that keep it follow that axis to
where it goes; anything else (a reduction over it, a slice of some rows,
an unknown primitive) mixes. An output whose rows end on another axis
than the one it is split on mixes too. The analysis is conservative:
what it cannot follow, it counts as mixing.
"""

from collections.abc import Mapping, Sequence

from jpipe.runtime.build.jaxpr_flow import flow

# Per value: (aligned, mixed). ``aligned[a]``: the bitset of the inputs
# whose rows are on the value's axis a (no trailing zeros); ``mixed``: a
# bitset of input indices.
Rows = tuple[tuple[int, ...], int]

# One output per operand of the same shape: row r from row r.
_ELEMENTWISE = frozenset(
  """abs acos acosh add and asin asinh atan atan2 atanh cbrt ceil clamp
  convert_element_type copy copy_p cos cosh digamma div eq erf erf_inv erfc
  exp exp2 expm1 floor ge gt igamma imag integer_pow is_finite le lgamma
  log log1p logistic lt max min mul ne neg nextafter not or pow real
  reduce_precision rem round rsqrt select_n sign sin sinh sqrt square sub
  tan tanh xor""".split()
)
_REDUCTIONS = frozenset(
  """reduce_sum reduce_max reduce_min reduce_prod reduce_and reduce_or
  argmax argmin""".split()
)
_CUMULATIVE = frozenset("cumsum cumprod cummax cummin cumlogsumexp".split())


def mixed_rows(
  closed_jaxpr,
  row_inputs: Sequence[int] | Mapping[int, int],
  out_axes: Sequence[int] | None = None,
) -> list[int]:
  """Per output of ``closed_jaxpr``, the inputs among ``row_inputs``
  whose rows it mixes, as a bitset (bit i: input i). Zero where every row
  of the output (on its axis ``out_axes[o]``, default 0) is computed from
  the same row of those inputs, or from none.

  Args:
    closed_jaxpr: the traced function.
    row_inputs: the inputs split into rows: their indices (rows on axis
      0), or ``{index: axis of the rows}``.
    out_axes: per output, the axis it is split into rows on.
  """
  jaxpr = closed_jaxpr.jaxpr
  if not isinstance(row_inputs, Mapping):
    row_inputs = dict.fromkeys(row_inputs, 0)
  ins = [
    (_on_axis(row_inputs[i], 1 << i), 0) if i in row_inputs else _Rows.bottom
    for i in range(len(jaxpr.invars))
  ]
  outs = flow(closed_jaxpr, ins, _Rows)
  out_axes = out_axes or [0] * len(outs)
  return [
    # (A scalar has no rows: whatever it is computed from, it mixes.)
    mixed | _bits(aligned, keep=axis if _shape(v) else None)
    for v, (aligned, mixed), axis in zip(
      jaxpr.outvars, outs, out_axes, strict=True
    )
  ]


def _on_axis(axis: int, bits: int) -> tuple[int, ...]:
  return (0,) * axis + (bits,) if bits else ()


def _bits(aligned: tuple[int, ...], keep: int | None = None) -> int:
  """The inputs aligned on any axis but ``keep``."""
  out = 0
  for a, bits in enumerate(aligned):
    out |= 0 if a == keep else bits
  return out


def _union(a: tuple[int, ...], b: tuple[int, ...]) -> tuple[int, ...]:
  if len(a) < len(b):
    a, b = b, a
  return tuple(x | (b[i] if i < len(b) else 0) for i, x in enumerate(a))


def _shape(v) -> tuple:
  return tuple(getattr(getattr(v, "aval", None), "shape", ()))


class _Rows:
  """``jaxpr_flow``'s lattice of (aligned, mixed) bitsets."""

  bottom: Rows = ((), 0)

  @staticmethod
  def join(a: Rows, b: Rows) -> Rows:
    return _union(a[0], b[0]), a[1] | b[1]

  @staticmethod
  def influence(rows: Rows) -> Rows:
    """A value that only shapes another mixes all its rows into it."""
    return (), _bits(rows[0]) | rows[1]

  @staticmethod
  def equation(eqn, ins: list[Rows]) -> list[Rows] | None:
    n_out = len(eqn.outvars)
    if eqn.primitive.name in _ELEMENTWISE:
      out = _Rows.bottom
      for rows in ins:
        out = _Rows.join(out, rows)
      return [out] * n_out
    moves = _axis_map(eqn)
    if moves is not None:  # One operand; each axis goes where it goes.
      return [_moved(ins[0], [moves(a) for a in range(len(ins[0][0]))])] * n_out
    if eqn.primitive.name == "dot_general":
      return [_dot_rows(eqn, ins)]
    return None


def _moved(rows: Rows, to: list[int | None]) -> Rows:
  """``rows`` with the rows on axis a moved to axis ``to[a]`` (None:
  mixed)."""
  aligned, mixed = (), rows[1]
  for bits, dest in zip(rows[0], to, strict=True):
    if dest is None:
      mixed |= bits
    else:
      aligned = _union(aligned, _on_axis(dest, bits))
  return aligned, mixed


def _axis_map(eqn):
  """For a one-operand shape primitive, the output axis each operand axis
  becomes (None: its rows are mixed); None if not such a primitive."""
  name, params = eqn.primitive.name, eqn.params
  shape = _shape(eqn.invars[0])
  if name in _REDUCTIONS:
    axes = params["axes"]
    return lambda a: None if a in axes else a - sum(x < a for x in axes)
  if name in _CUMULATIVE:
    return lambda a: None if a == params["axis"] else a
  if name == "broadcast_in_dim":
    dims, out = params["broadcast_dimensions"], params["shape"]
    return lambda a: dims[a] if shape[a] == out[dims[a]] else None
  if name == "transpose":
    return params["permutation"].index
  if name == "reshape":
    new = params["new_sizes"]
    return lambda a: a if tuple(shape[: a + 1]) == tuple(new[: a + 1]) else None
  if name == "squeeze":
    dims = params["dimensions"]
    return lambda a: None if a in dims else a - sum(d < a for d in dims)
  if name == "slice":
    strides = params["strides"] or (1,) * len(shape)
    start, limit = params["start_indices"], params["limit_indices"]
    return lambda a: (
      a if start[a] == 0 and limit[a] == shape[a] and strides[a] == 1 else None
    )
  return None


def _dot_rows(eqn, ins: list[Rows]) -> Rows:
  """``dot_general``: an operand's rows follow their axis to the output
  (its batch dimensions first, then the left operand's free dimensions,
  then the right's); on a contracted axis they are mixed."""
  (lc, rc), (lb, rb) = eqn.params["dimension_numbers"]
  nl, nr = (len(_shape(v)) for v in eqn.invars)
  free_l = [a for a in range(nl) if a not in lc and a not in lb]
  free_r = [a for a in range(nr) if a not in rc and a not in rb]

  def lhs(a):
    if a in lb:
      return list(lb).index(a)
    return None if a in lc else len(lb) + free_l.index(a)

  def rhs(a):
    if a in rb:
      return list(rb).index(a)
    return None if a in rc else len(lb) + len(free_l) + free_r.index(a)

  out = _Rows.bottom
  for rows, where in zip(ins, (lhs, rhs), strict=True):
    out = _Rows.join(out, _moved(rows, [where(a) for a in range(len(rows[0]))]))
  return out
