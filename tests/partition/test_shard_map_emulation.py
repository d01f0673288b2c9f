"""A ``shard_map`` in a traced loss, retyped for one device
(``partition/_plain_types.py``, ``partition/_shard_map_emulation.py``):
the same values and gradients as JAX's own SPMD run of it on 8 devices,
for every collective, sharded and replicated specs, multi-axis specs,
partial manual axes, collectives inside a scan in the body, and unchecked
(``check_vma=False``) collectives of replicated values."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P

from jpipe.partition._plain_types import plain_types


def _ring(n):
  return [(j, (j + 1) % n) for j in range(n)]


def _every_collective(x, w):
  """Each collective once (x: [rows/data, cols/model], w: [cols/model,
  8]); the result replicated over "model"."""
  z = x @ w  # (Partial sums over "model".)
  y = jax.lax.psum(z, "model")
  g = jax.lax.all_gather(z, "model", tiled=True)  # [4 * rows, 8]
  stacked = jax.lax.all_gather(z, "model")  # [4, rows, 8]
  s = jax.lax.psum_scatter(g, "model", tiled=True)
  p = jax.lax.ppermute(s, "model", _ring(4))
  p = p + jax.lax.pcast(y, "model", to="varying")
  # (pmax and pmin have no derivative: taken of constants.)
  top = jax.lax.pmax(jax.lax.stop_gradient(p), "data")
  m = top + jax.lax.pmean(p, ("data", "model"))
  a = jax.lax.all_to_all(m, "model", 0, 0, tiled=True)
  i = jax.lax.axis_index("model").astype(jnp.float32)
  out = jax.lax.psum(a * (1.0 + i) + stacked[1], "model")
  low = jax.lax.pmin(jax.lax.stop_gradient(z).sum(), ("data", "model"))
  return out + jax.lax.axis_size("model") + low


def _scanned_ring(x, w):
  """Collectives inside a scan in the body (ring attention's shape)."""

  def step(c, _):
    c = jax.lax.ppermute(c, "model", _ring(4))
    i = jax.lax.axis_index("model").astype(jnp.float32)
    return c, jax.lax.psum((c @ w) * (1.0 + 0.1 * i), "model")

  _, ys = jax.lax.scan(step, x, None, length=3)
  return ys.sum(0)


def _case(name, mesh):
  """A function of (x [16, 8], w [8, 8]) that calls shard_map on ``mesh``."""
  if name == "partial":  # Manual over "model" only; "data" stays automatic.
    return jax.shard_map(
      _scanned_ring,
      mesh=mesh,
      in_specs=(P(None, "model"), P("model", None)),
      out_specs=P(),
      axis_names={"model"},
    )
  if name == "multi_axis":  # Rows over both axes, data-major.

    def body(x, w):
      i = jax.lax.axis_index("data") * 4 + jax.lax.axis_index("model")
      own = (x @ w) * (1.0 + i.astype(jnp.float32))  # (Which shard is which.)
      return own + jax.lax.psum(x, ("data", "model")) @ w

    return jax.shard_map(
      body,
      mesh=mesh,
      in_specs=(P(("data", "model")), P()),
      out_specs=P(("data", "model")),
    )
  if name == "unchecked":  # check_vma=False: collectives of replicated values.

    def body(x, w):
      total = jax.lax.psum(w, "model")  # (4 w: w is the same on each.)
      copies = jax.lax.all_gather(w, "model", tiled=True)
      i = jax.lax.axis_index("model").astype(jnp.float32)
      return x @ total + copies[8:16].sum() + jax.lax.pmax(i, "model")

    return jax.shard_map(
      body,
      mesh=mesh,
      in_specs=(P("data"), P()),
      out_specs=P("data"),
      check_vma=False,
    )
  body = {"every": _every_collective, "scan": _scanned_ring}[name]
  return jax.shard_map(
    body,
    mesh=mesh,
    in_specs=(P("data", "model"), P("model", None)),
    out_specs=P("data", None),
  )


@pytest.mark.parametrize(
  "name", ["every", "scan", "partial", "multi_axis", "unchecked"]
)
def test_values_and_gradients_equal_the_mesh(name):
  mesh = jax.make_mesh(
    (2, 4), ("data", "model"), axis_types=(AxisType.Auto,) * 2
  )
  fn = _case(name, mesh)
  rng = np.random.RandomState(0)
  x = rng.randn(16, 8).astype(np.float32)
  w = rng.randn(8, 8).astype(np.float32) * 0.3

  weights = np.linspace(-1.0, 1.0, 16 * 8, dtype=np.float32).reshape(16, 8)

  def loss(x, w):  # (Weighted: rows in the wrong order would show.)
    return jnp.sum(jnp.sin(fn(x, w)) * weights)

  want = jax.jit(jax.value_and_grad(loss, (0, 1)))(x, w)  # JAX's own SPMD.
  closed = plain_types(jax.make_jaxpr(loss)(x, w))
  names = {e.primitive.name for e in closed.jaxpr.eqns}
  assert "shard_map" not in names and "closed_call" in names

  def retyped(x, w):
    return jax.core.eval_jaxpr(closed.jaxpr, closed.consts, x, w)[0]

  # (On one device, with no mesh: as a stage runs it.)
  x, w = jax.device_put((x, w), jax.devices()[0])
  got = jax.jit(jax.value_and_grad(retyped, (0, 1)))(x, w)
  assert got[0].devices() == {jax.devices()[0]}
  for g, e in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
    np.testing.assert_allclose(g, e, rtol=2e-5, atol=2e-5)
  assert np.abs(np.asarray(got[1][0])).sum() > 0  # (Gradients reach x.)
