"""Whether an optimizer's step keeps the rows of a scanned leaf apart.

A model whose layers run under a scan keeps each layer's params stacked
on a leading axis; a pipeline may split those rows between stages, and
each stage's optimizer then steps its own rows. That is one device's step
where the update of row r reads row r alone (adam, sgd, Adafactor's
factored moments), not where it reduces over the rows: Adafactor's
default update clipping (``clip_by_block_rms``) and parameter scale
(``scale_by_param_block_rms``) take an RMS over the whole leaf, which per
stage would be over that stage's rows -- a silently different step.

``mixed_rows`` follows the optimizer's jaxpr with, per value, the
row-split inputs it is computed from row by row (its axis 0 the rows'
axis: ``aligned``) and those whose rows it mixes (``mixed``). Elementwise
operations, reductions and contractions away from axis 0 and broadcasts
that keep it keep a value aligned; anything else (a reduction over axis
0, a transpose moving it, a slice of some rows, an unknown primitive)
mixes. The analysis is conservative: what it cannot follow, it counts as
mixing.
"""

from collections.abc import Sequence
from typing import Any

from jax.extend import core as jex_core

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
  ins = [
    (1 << i, 0) if i in set(row_inputs) else (0, 0)
    for i in range(len(jaxpr.invars))
  ]
  outs = _rows(jaxpr, [(0, 0)] * len(jaxpr.constvars), ins)
  return [
    mixed | (0 if _keeps_axis0(v) else aligned)
    for v, (aligned, mixed) in zip(jaxpr.outvars, outs, strict=True)
  ]


def _keeps_axis0(v) -> bool:
  return bool(getattr(getattr(v, "aval", None), "shape", ()))


def _rows(jaxpr, const_rows, in_rows) -> list[Rows]:
  env: dict[Any, Rows] = {}
  for v, r in zip(jaxpr.constvars, const_rows, strict=True):
    env[v] = r
  for v, r in zip(jaxpr.invars, in_rows, strict=True):
    env[v] = r

  def read(v) -> Rows:
    return env.get(v, (0, 0)) if isinstance(v, jex_core.Var) else (0, 0)

  for eqn in jaxpr.eqns:
    outs = _eqn_rows(eqn, [read(v) for v in eqn.invars])
    for v, r in zip(eqn.outvars, outs, strict=True):
      env[v] = r
  return [read(v) for v in jaxpr.outvars]


def _mix(rows: Sequence[Rows]) -> int:
  """Everything ``rows`` read, mixed."""
  out = 0
  for aligned, mixed in rows:
    out |= aligned | mixed
  return out


def _eqn_rows(eqn, ins: list[Rows]) -> list[Rows]:
  """One equation's (aligned, mixed) outputs from its inputs'."""
  name, params = eqn.primitive.name, eqn.params
  n_out = len(eqn.outvars)
  if name in _ELEMENTWISE:
    aligned = mixed = 0
    for a, m in ins:
      aligned, mixed = aligned | a, mixed | m
    return [(aligned, mixed)] * n_out
  keep = _keeps_rows(eqn)
  if keep is not None:  # One operand, axis 0 kept or not.
    a, m = ins[0]
    return [(a, m) if keep else (0, a | m)] * n_out
  if name == "dot_general":
    return [_dot_rows(eqn, ins)]
  if name == "cond":  # The branch index mixes into every output.
    index, operands = ins[0], ins[1:]
    outs = [_closed(b, operands) for b in params["branches"]]
    rows = []
    for branch_rows in zip(*outs, strict=True):
      aligned = mixed = 0
      for a, m in branch_rows:
        aligned, mixed = aligned | a, mixed | m
      rows.append((aligned, mixed | _mix([index])))
    return rows
  if name == "while":
    return _while(params, ins)
  if name == "scan":
    return _scan(params, ins)
  subs = [p for p in params.values() if _is_jaxpr(p)]
  if len(subs) == 1 and _arity(subs[0]) == (len(ins), n_out):
    # jit, custom_jvp_call, custom_vjp_call, remat, closed_call
    return _closed(subs[0], ins)
  return [(0, _mix(ins))] * n_out


def _union(a: Rows, b: Rows) -> Rows:
  return a[0] | b[0], a[1] | b[1]


def _fixed_point(step, carry: list[Rows]) -> list[Rows]:
  """The least carry rows closed under ``step`` (a loop's carries read
  what their initial values and every iteration feed them)."""
  while True:
    new = [_union(c, n) for c, n in zip(carry, step(carry), strict=True)]
    if new == carry:
      return carry
    carry = new


def _while(params, ins: list[Rows]) -> list[Rows]:
  nc, nb = params["cond_nconsts"], params["body_nconsts"]
  cond_consts, body_consts, init = ins[:nc], ins[nc : nc + nb], ins[nc + nb :]

  def step(carry):
    flow = _closed(params["body_jaxpr"], [*body_consts, *carry])
    # The trip count (the predicate's inputs) shapes every result.
    pred = _mix(_closed(params["cond_jaxpr"], [*cond_consts, *carry]))
    return [(a, m | pred) for a, m in flow]

  return _fixed_point(step, list(init))


def _scan(params, ins: list[Rows]) -> list[Rows]:
  """A scan's iterations run along axis 0 of its xs and ys: an aligned
  xs is read a row per iteration and ys stacks iterations, so both mix
  (the carries keep what the body keeps)."""
  nc, ncarry = params["num_consts"], params["num_carry"]
  consts, init, xs = ins[:nc], ins[nc : nc + ncarry], ins[nc + ncarry :]
  xs = [(0, a | m) for a, m in xs]
  body = params["jaxpr"]
  carry = _fixed_point(
    lambda c: _closed(body, [*consts, *c, *xs])[:ncarry], list(init)
  )
  ys = _closed(body, [*consts, *carry, *xs])[ncarry:]
  return [*carry, *((0, a | m) for a, m in ys)]


def _keeps_rows(eqn) -> bool | None:
  """For a one-operand shape primitive, whether output axis 0 is the
  operand's axis 0 (None: not such a primitive)."""
  name, params = eqn.primitive.name, eqn.params
  shape = tuple(getattr(eqn.invars[0].aval, "shape", ()))
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


def _is_jaxpr(p) -> bool:
  return isinstance(p, jex_core.ClosedJaxpr | jex_core.Jaxpr)


def _arity(j) -> tuple[int, int]:
  jaxpr = j.jaxpr if isinstance(j, jex_core.ClosedJaxpr) else j
  return len(jaxpr.invars), len(jaxpr.outvars)


def _closed(j, ins: Sequence[Rows]) -> list[Rows]:
  if isinstance(j, jex_core.ClosedJaxpr):
    j = j.jaxpr
  return _rows(j, [(0, 0)] * len(j.constvars), list(ins))
