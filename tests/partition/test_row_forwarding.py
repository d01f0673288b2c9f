"""``forward_rows``: a slice of a concatenation read from the part it
selects -- the same values (``jax.core.eval_jaxpr``), and the
concatenations and slices left unread gone."""

import jax
import jax.numpy as jnp
import numpy as np

from jpipe.partition._row_forwarding import forward_rows


def _f(a, b, c):
  stacked = jnp.concatenate([a, b, c])  # [1, 2], [1, 2], [2, 2]
  rows = [jax.lax.slice_in_dim(stacked, r, r + 1) for r in range(2)]
  both = jax.lax.slice_in_dim(stacked, 2, 4)  # c whole
  odd = jax.lax.slice(stacked, (1, 1), (2, 2))  # Not a whole part.
  return rows[0] * 2, rows[1] + both.sum(), odd


def test_slices_of_a_concatenation_read_its_parts():
  args = [np.arange(2.0)[None], np.ones((1, 2)), np.full((2, 2), 3.0)]
  closed = jax.make_jaxpr(_f)(*args)
  jaxpr, kept = forward_rows(closed.jaxpr)
  got = jax.core.eval_jaxpr(jaxpr, closed.consts, *args)
  for x, y in zip(got, _f(*args), strict=True):
    np.testing.assert_array_equal(x, y)
  # The whole-part slices read a, b and c; the partial one keeps the
  # concatenation alive.
  names = [e.primitive.name for e in jaxpr.eqns]
  assert names.count("slice") == 1 and names.count("concatenate") == 1
  # ``kept``: each new equation's index among the original ones.
  assert list(kept) == sorted(kept) and len(kept) == len(jaxpr.eqns)
  for i, eqn in zip(kept, jaxpr.eqns, strict=True):
    assert closed.jaxpr.eqns[i].primitive == eqn.primitive
  # Nothing to forward: the same jaxpr.
  plain = jax.make_jaxpr(lambda a: a * 2)(args[0]).jaxpr
  assert forward_rows(plain)[0] is plain
