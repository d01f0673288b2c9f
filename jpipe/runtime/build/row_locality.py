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
value, the row-split inputs it is computed from row by row (its axis 0
the rows' axis: ``aligned``) and those whose rows it mixes (``mixed``).
Elementwise operations, reductions and contractions away from axis 0 and
broadcasts that keep it keep a value aligned; anything else (a reduction
over axis 0, a transpose moving it, a slice of some rows, an unknown
primitive) mixes. The analysis is conservative: what it cannot follow,
it counts as mixing.
"""

from collections.abc import Sequence

from jpipe.runtime.build.jaxpr_flow import flow

# Per value: (aligned, mixed) bitsets of input indices.
Rows = tuple[int, int]

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


def mixed_rows(closed_jaxpr, row_inputs: Sequence[int]) -> list[int]:
  """Per output of ``closed_jaxpr``, the inputs among ``row_inputs``
  (indices of inputs whose axis 0 is split into rows) whose rows it
  mixes, as a bitset (bit i: input i). Zero where every row of the
  output is computed from the same row of those inputs, or from none."""
  jaxpr = closed_jaxpr.jaxpr
  rows = set(row_inputs)
  ins = [(1 << i, 0) if i in rows else (0, 0) for i in range(len(jaxpr.invars))]
  outs = flow(closed_jaxpr, ins, _Rows)
  return [
    mixed | (aligned if not _shape(v) else 0)  # (a scalar has no rows)
    for v, (aligned, mixed) in zip(jaxpr.outvars, outs, strict=True)
  ]


def _shape(v) -> tuple:
  return tuple(getattr(getattr(v, "aval", None), "shape", ()))


class _Rows:
  """``jaxpr_flow``'s lattice of (aligned, mixed) bitsets."""

  bottom: Rows = (0, 0)

  @staticmethod
  def join(a: Rows, b: Rows) -> Rows:
    return a[0] | b[0], a[1] | b[1]

  @staticmethod
  def influence(rows: Rows) -> Rows:
    """A value that only shapes another mixes all its rows into it."""
    return 0, rows[0] | rows[1]

  @staticmethod
  def equation(eqn, ins: list[Rows]) -> list[Rows] | None:
    n_out = len(eqn.outvars)
    if eqn.primitive.name in _ELEMENTWISE:
      aligned = mixed = 0
      for a, m in ins:
        aligned, mixed = aligned | a, mixed | m
      return [(aligned, mixed)] * n_out
    keep = _keeps_rows(eqn)
    if keep is not None:  # One operand, axis 0 kept or not.
      return [ins[0] if keep else _Rows.influence(ins[0])] * n_out
    if eqn.primitive.name == "dot_general":
      return [_dot_rows(eqn, ins)]
    return None


def _keeps_rows(eqn) -> bool | None:
  """For a one-operand shape primitive, whether output axis 0 is the
  operand's axis 0 (None: not such a primitive)."""
  name, params = eqn.primitive.name, eqn.params
  shape = _shape(eqn.invars[0])
  if name in _REDUCTIONS:
    return 0 not in params["axes"]
  if name in _CUMULATIVE:
    return params["axis"] != 0
  if name == "broadcast_in_dim":
    dims = params["broadcast_dimensions"]
    return bool(dims) and dims[0] == 0 and shape[0] == params["shape"][0]
  if name == "transpose":
    return params["permutation"][0] == 0
  if name == "reshape":
    new = params["new_sizes"]
    return bool(shape) and bool(new) and new[0] == shape[0]
  if name == "squeeze":
    return 0 not in params["dimensions"]
  if name == "slice":
    strides = params["strides"] or (1,) * len(shape)
    return (
      params["start_indices"][0] == 0
      and params["limit_indices"][0] == shape[0]
      and strides[0] == 1
    )
  return None


def _dot_rows(eqn, ins: list[Rows]) -> Rows:
  """``dot_general``: an operand stays aligned where its axis 0 becomes
  the output's axis 0 (a batch dimension both share first; else the
  left operand's first free dimension)."""
  (lc, rc), (lb, rb) = eqn.params["dimension_numbers"]
  keeps = [False, False]
  if lb and rb:
    keeps = [lb[0] == 0, rb[0] == 0]
  elif 0 not in lc and 0 not in lb:
    keeps = [True, False]  # lhs axis 0 is the output's first axis
  aligned = mixed = 0
  for (a, m), keep in zip(ins, keeps, strict=True):
    aligned |= a if keep else 0
    mixed |= m | (0 if keep else a)
  return aligned, mixed
