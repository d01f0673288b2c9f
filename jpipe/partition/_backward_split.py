"""A stage's backward as two programs: the input gradient and the weight
gradient (zero-bubble schedules' I and W).

The backward of a stage is a function ``(args) -> (param_grads,
input_cotangents)``. Traced to a jaxpr, its equations split by what they
feed: those the input cotangents need (the recomputed forward, the
cotangents flowing back through every layer) are I; the rest, needed only
by the parameter gradients (each layer's ``x^T dy``), are W. I also
returns the values W reads that it does not compute itself -- the
activations and cotangents the weight gradients are made from, or an
argument -- and W computes the parameter gradients from them alone.
Every equation runs in exactly one of the two, so I then W computes
what the backward does, the same operations on the same values.

An equation is split whole: a call (``pjit``) whose outputs feed both
runs in I, and W then reads its gradient outputs. The split is the
finest the traced program allows, never wrong.
"""

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
from jax.extend import core as jcore

from jpipe.partition._eval import eval_eqn, read


@dataclasses.dataclass(frozen=True)
class BackwardSplit:
  """A backward's equations split into I and W.

  Attributes:
    jaxpr: the backward's jaxpr (``jax.make_jaxpr`` of it).
    consts: its constants.
    input_eqns: indices of the equations I runs, in program order.
    weight_eqns: indices of the equations W runs, in program order.
    kept: the values I hands W (variables of ``jaxpr``).
    num_grads: the backward's parameter gradients (its first outputs).
    cot_tree: the structure of its input cotangents.
  """

  jaxpr: Any
  consts: tuple
  input_eqns: tuple[int, ...]
  weight_eqns: tuple[int, ...]
  kept: tuple
  num_grads: int
  cot_tree: Any

  @property
  def kept_avals(self) -> tuple:
    """The shapes and dtypes of what I hands W."""
    return tuple(
      jax.ShapeDtypeStruct(v.aval.shape, v.aval.dtype) for v in self.kept
    )

  def input_part(self, *args) -> tuple[tuple, tuple]:
    """``(input_cotangents, kept)`` for the backward's ``args``
    (input cotangents structured as the backward returns them)."""
    env = dict(zip(self.jaxpr.constvars, self.consts, strict=True))
    env.update(zip(self.jaxpr.invars, jax.tree.leaves(args), strict=True))
    for i in self.input_eqns:
      eval_eqn(self.jaxpr.eqns[i], env)
    cots = [read(env, v) for v in self.jaxpr.outvars[self.num_grads :]]
    kept = tuple(env[v] for v in self.kept)
    return jax.tree.unflatten(self.cot_tree, cots), kept

  def weight_part(self, kept) -> tuple:
    """The parameter gradients from ``kept`` (``input_part``'s)."""
    env = dict(zip(self.jaxpr.constvars, self.consts, strict=True))
    env.update(zip(self.kept, kept, strict=True))
    for i in self.weight_eqns:
      eval_eqn(self.jaxpr.eqns[i], env)
    outvars = self.jaxpr.outvars[: self.num_grads]
    return tuple(read(env, v) for v in outvars)


def split_backward(backward: Callable, *args) -> BackwardSplit:
  """``backward(*args) -> (param_grads, input_cotangents)`` (tuples; a
  cotangent may be None) split into I and W, traced at ``args``' shapes
  (arrays, tracers or ``jax.ShapeDtypeStruct``)."""
  closed, shape = jax.make_jaxpr(backward, return_shape=True)(*args)
  jaxpr = closed.jaxpr
  num_grads = len(jax.tree.leaves(shape[0]))
  made_by = {v: i for i, eqn in enumerate(jaxpr.eqns) for v in eqn.outvars}
  grad_outs, cot_outs = jaxpr.outvars[:num_grads], jaxpr.outvars[num_grads:]
  # I: every equation an input cotangent needs; W: the rest of what the
  # gradients need.
  input_eqns = _needed(jaxpr, cot_outs, made_by, set())
  weight_eqns = _needed(jaxpr, grad_outs, made_by, input_eqns)
  defined = set(jaxpr.constvars)
  for i in weight_eqns:
    defined.update(jaxpr.eqns[i].outvars)
  kept = []
  reads = [v for i in sorted(weight_eqns) for v in jaxpr.eqns[i].invars]
  for v in reads + list(grad_outs):
    if isinstance(v, jcore.Literal) or v in defined or v in kept:
      continue
    kept.append(v)
  # A value I does not compute (an argument) is handed on from the input.
  return BackwardSplit(
    jaxpr,
    tuple(closed.consts),
    tuple(sorted(input_eqns)),
    tuple(sorted(weight_eqns)),
    tuple(kept),
    num_grads,
    jax.tree.structure(shape[1]),
  )


def _needed(jaxpr, targets, made_by, excluded) -> set[int]:
  """Indices of the equations ``targets`` depend on, less ``excluded``
  (whose outputs count as given)."""
  needed, stack = set(), list(targets)
  while stack:
    v = stack.pop()
    if isinstance(v, jcore.Literal):
      continue
    i = made_by.get(v)
    if i is None or i in needed or i in excluded:
      continue
    needed.add(i)
    stack.extend(jaxpr.eqns[i].invars)
  return needed
