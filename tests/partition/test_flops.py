"""The partitioner's FLOP rule for cuDNN's fused attention (what
``jax.nn.dot_product_attention`` lowers to on an NVIDIA GPU, opaque to
the per-element rule): its two matrix products, as the XLA composition
the same call makes on a CPU counts them."""

import jax
import jax.extend.core as jcore
import jax.numpy as jnp
import numpy as np

from jpipe.partition import _flops

# A stand-in bound like cuDNN's forward primitive (the real one lowers
# only on CUDA): the same name, its output the query's shape.
_fused = jcore.Primitive("dot_product_attention_fwd_wrapper")
_fused.def_abstract_eval(lambda q, k, v: jax.core.ShapedArray(q.shape, q.dtype))


def test_fused_attention_counts_its_matrix_products():
  q = jnp.ones((2, 16, 4, 8))  # [B, T, N, H]
  k = v = jnp.ones((2, 10, 4, 8))  # [B, S, N, H]
  fused = jax.make_jaxpr(_fused.bind)(q, k, v)
  (eqn,) = fused.jaxpr.eqns
  assert _flops.eqn_flops(eqn) == 4.0 * 2 * 16 * 4 * 8 * 10
  # The XLA composition's matrix products count the same.
  xla = jax.make_jaxpr(jax.nn.dot_product_attention)(q, k, v)

  def dots(jaxpr):
    total = 0.0
    for e in jaxpr.eqns:
      if e.primitive.name == "dot_general":
        total += _flops.eqn_flops(e)
      for inner in jcore.jaxprs_in_params(e.params):
        total += dots(getattr(inner, "jaxpr", inner))
    return total

  np.testing.assert_allclose(dots(xla.jaxpr), _flops.eqn_flops(eqn))
