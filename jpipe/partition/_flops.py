"""Analytic forward FLOP counts of jaxpr equations.

A cost model for partitioning, not an exact count: matrix products and
convolutions count 2 FLOPs per multiply-add; other primitives count one per
output element; sub-jaxprs (custom_jvp, pjit, remat, cond) are summed, and
``scan`` multiplies its body by its length; cuDNN's fused attention
counts its two matrix products.
"""

import math
from typing import Any

import jax.extend.core as jcore

# The forward primitives of cuDNN's fused attention ("..._fwd_wrapper",
# fp8's too): opaque to the rules below, which would count its output.
FUSED_ATTENTION = "dot_product_attention_fwd"


def _size(aval) -> int:
  return math.prod(getattr(aval, "shape", ()))


def eqn_flops(eqn: Any) -> float:
  """Forward FLOPs of one equation (float)."""
  name = eqn.primitive.name
  if name == "dot_general":
    (lhs_contract, _), _ = eqn.params["dimension_numbers"]
    lhs = eqn.invars[0].aval
    k = math.prod(lhs.shape[d] for d in lhs_contract)
    return 2.0 * _size(eqn.outvars[0].aval) * k
  if name == "conv_general_dilated":
    rhs = eqn.invars[1].aval
    dims = eqn.params["dimension_numbers"]
    out_feature_dim = dims.rhs_spec[0]
    per_output = math.prod(rhs.shape) / rhs.shape[out_feature_dim]
    return 2.0 * _size(eqn.outvars[0].aval) * per_output
  if name.startswith(FUSED_ATTENTION):
    # cuDNN's kernel (jax.nn.dot_product_attention on an NVIDIA GPU; its
    # layout [B, T, N, H]): scores and values, 2 x 2 per q-k-d triple.
    query, key = eqn.invars[0].aval, eqn.invars[1].aval
    return 4.0 * _size(query) * key.shape[1]
  inner = [j for j in jcore.jaxprs_in_params(eqn.params)]
  if inner:
    total = sum(jaxpr_flops(j) for j in inner)
    if name == "scan":
      total *= eqn.params["length"]
    if name == "cond":  # One branch runs.
      total /= max(len(inner), 1)
    return float(total)
  return float(sum(_size(v.aval) for v in eqn.outvars))


def jaxpr_flops(jaxpr: Any) -> float:
  """Forward FLOPs of a (closed) jaxpr."""
  jaxpr = getattr(jaxpr, "jaxpr", jaxpr)
  return float(sum(eqn_flops(e) for e in jaxpr.eqns))
