"""Between the whole model and its stages: a params or batch pytree as
each stage's leaves, the stages' gradients and results back as the
model's pytrees, and every stage run in order on one device (the
sequential reference schedule).

A base class of ``Stages`` (``_stages.py``), which sets ``traced``,
``specs``, ``num_stages`` and ``jitted``.
"""

from collections.abc import Sequence
from typing import Any

import jax
import jax.extend.core as jcore
import jax.numpy as jnp


class StageLayout:
  """The whole model's pytrees as stages' leaves, and back."""

  def split_params(self, params) -> list[tuple]:
    """The full params pytree as each stage's tuple of leaves (a stacked
    leaf scanned over layers: its rows, ``TracedModel.traced_params``)."""
    leaves = self.traced.traced_params(params)
    return [tuple(leaves[i] for i in spec.param_leaves) for spec in self.specs]

  def split_batch(self, batch) -> list[tuple]:
    """The batch pytree as each stage's tuple of leaves."""
    leaves = jax.tree.leaves(batch)
    return [tuple(leaves[i] for i in spec.batch_leaves) for spec in self.specs]

  def gather_grads(self, stage_grads: Sequence[Sequence[Any]], params):
    """Per-stage param gradients -> one pytree like ``params`` (summed)."""
    leaves = [None] * self.traced.num_param_leaves
    for spec, grads in zip(self.specs, stage_grads, strict=True):
      for i, g in zip(spec.param_leaves, grads, strict=True):
        leaves[i] = g if leaves[i] is None else leaves[i] + g
    flat_params = self.traced.traced_params(params)
    leaves = [
      jnp.zeros_like(p) if g is None else g
      for g, p in zip(leaves, flat_params, strict=True)
    ]
    leaves = self.traced.model_leaves(leaves)
    return jax.tree.unflatten(jax.tree.structure(params), leaves)

  def assemble_results(self, stage_results: Sequence[Sequence[Any]]):
    """Per-stage results -> the loss function's output pytree."""
    jaxpr = self.traced.jaxpr
    flat = [None] * len(jaxpr.outvars)
    for spec, res in zip(self.specs, stage_results, strict=True):
      for r, x in zip(spec.results, res, strict=True):
        flat[r] = x
    for r, v in enumerate(jaxpr.outvars):  # Outputs that are not computed.
      if flat[r] is None:
        flat[r] = v.val if isinstance(v, jcore.Literal) else None
    return jax.tree.unflatten(self.traced.out_tree, flat)

  def run_forward_backward(
    self, params, batch, *, recompute: bool = True, fuse_last: bool = False
  ):
    """All stages in order on one device: ``(output, grads)``.

    The reference schedule (sequential, one microbatch): equals
    ``jax.value_and_grad(loss_fn, has_aux=...)(params, batch)``. With
    ``fuse_last`` the last stage runs ``forward_backward``.
    """
    stage_params = self.split_params(params)
    stage_batch = self.split_batch(batch)
    values: dict[Any, Any] = {}
    saved, results = [], []
    loss_index = 0
    for s, spec in enumerate(self.specs):
      acts = tuple(values[v] for v in spec.inputs)
      if fuse_last and s == self.num_stages - 1:
        result_cots = tuple(
          1.0 if r == loss_index else None for r in spec.results
        )
        res, grads_last, act_cots_last = self.jitted("forward_backward", s)(
          stage_params[s], stage_batch[s], acts, result_cots
        )
        outputs = ()
      elif recompute:
        outputs, res = self.jitted("forward", s)(
          stage_params[s], stage_batch[s], acts
        )
        saved.append(acts)
      else:
        outputs, res, residuals = self.jitted("forward_saving", s)(
          stage_params[s], stage_batch[s], acts
        )
        saved.append(residuals)
      values.update(zip(spec.outputs, outputs, strict=True))
      results.append(res)
    cots: dict[Any, Any] = {}
    grads: list[Any] = [None] * self.num_stages
    for s in reversed(range(self.num_stages)):
      spec = self.specs[s]
      out_cots = tuple(cots.get(v) for v in spec.outputs)
      result_cots = tuple(
        1.0 if r == loss_index else None for r in spec.results
      )
      if fuse_last and s == self.num_stages - 1:
        grads[s], act_cots = grads_last, act_cots_last
      elif recompute:
        grads[s], act_cots = self.jitted("backward", s)(
          stage_params[s], stage_batch[s], saved[s], out_cots, result_cots
        )
      else:
        grads[s], act_cots = self.jitted("backward_from_residuals", s)(
          stage_params[s], saved[s], out_cots, result_cots
        )
      for v, c in zip(spec.inputs, act_cots, strict=True):
        if c is not None:
          cots[v] = c if v not in cots else cots[v] + c
    return self.assemble_results(results), self.gather_grads(grads, params)
