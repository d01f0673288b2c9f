"""A scan nested in a scan (``nn.remat_scan``, a scan in a scan's body)
read as one scan over every layer (``partition._nested_scans``): the same
function, one scan of ``a * b`` over the params reshaped ``[a * b, ...]``;
what does not qualify is left as it is."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jpipe.partition._nested_scans import nested_scans_as_one
from tests import jitted

A, B, D = 2, 3, 4


def _flat_params(params):
  leaves, tree = jax.tree.flatten(params)
  return leaves, tree


def _rewritten(fn, params, x):
  """(the traced ``fn(params, x)``, its rewrite) over flat param leaves
  then ``x``."""
  leaves, tree = _flat_params(params)
  closed = jax.make_jaxpr(
    lambda *a: fn(jax.tree.unflatten(tree, a[:-1]), a[-1])
  )(*leaves, x)
  return closed, nested_scans_as_one(closed, len(leaves))


def _scans(closed):
  return [e for e in closed.jaxpr.eqns if e.primitive.name == "scan"]


def _same_function(closed, new, params, x):
  """The rewrite's value and gradient (params and x) are the original's."""
  leaves, _ = _flat_params(params)

  def run(c):
    return lambda *a: jax.core.eval_jaxpr(c.jaxpr, c.consts, *a)[0]

  args = (*leaves, x)
  argnums = tuple(range(len(args)))
  want = jitted.value_and_grad(run(closed), argnums)(*args)
  got = jitted.value_and_grad(run(new), argnums)(*args)
  # (Another program for XLA: its CPU kernels' rounding differs across
  # machines, 2.4e-6 on an AMD EPYC.)
  for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)


class _Layer(nn.Module):
  @nn.compact
  def __call__(self, h):
    return h + jnp.tanh(nn.Dense(D)(h))


def test_remat_scan_is_one_scan_of_every_layer_under_its_checkpoint():
  """flax's own example: ``nn.remat_scan(Layer, lengths=(a, b))`` with a
  policy. One scan of length a * b over each stacked leaf reshaped to
  ``[a * b, ...]`` (row i * b + j: layer [i, j]); its body the layer
  under a checkpoint with the same policy; the same value and
  gradients."""
  policy = jax.checkpoint_policies.nothing_saveable
  model = nn.remat_scan(_Layer, lengths=(A, B), policy=policy)()
  x = jnp.linspace(-1.0, 1.0, 2 * D).reshape(2, D)
  params = model.init(jax.random.key(0), x)
  closed, new = _rewritten(lambda p, x: model.apply(p, x).sum(), params, x)
  (outer,) = _scans(closed)
  assert outer.params["length"] == A
  (scan,) = _scans(new)
  assert scan.params["length"] == A * B
  (checkpoint,) = scan.params["jaxpr"].jaxpr.eqns
  assert checkpoint.primitive.name == "remat2"
  (original,) = outer.params["jaxpr"].jaxpr.eqns
  assert checkpoint.params["policy"] is original.params["policy"] is policy
  # The scanned params: reshapes of the [a, b, ...] leaves.
  made = {e.outvars[0]: e for e in new.jaxpr.eqns}
  xs = scan.invars[scan.params["num_consts"] + scan.params["num_carry"] :]
  for v in xs:
    reshape = made[v]
    assert reshape.primitive.name == "reshape"
    assert reshape.invars[0] in new.jaxpr.invars
    assert reshape.invars[0].aval.shape[:2] == (A, B)
    assert v.aval.shape == (A * B, *reshape.invars[0].aval.shape[2:])
  _same_function(closed, new, params, x)


def _lax_nested(w, x, *, per_row=None, reverse=False, ys=True):
  """``w`` [a, b, D, D] as a lax.scan in a lax.scan (no checkpoint),
  returning each layer's mean as stacked outputs [a, b] beside the carry;
  ``per_row(h, i_row)``: an extra reading of the outer row the inner scan
  does not scan (not flattenable)."""

  def outer(h, wa):
    def inner(h, wb):
      h = jnp.tanh(h @ wb)
      if per_row is not None:
        h = per_row(h, wa)
      return h, h.mean() if ys else None

    h, y = jax.lax.scan(inner, h, wa)
    return h, y

  h, y = jax.lax.scan(outer, x, w, reverse=reverse)
  return h.sum() + (0.5 * y.sum() if ys else 0.0)


def _stack():
  w = jax.random.normal(jax.random.key(1), (A, B, D, D)) / 2
  x = jax.random.normal(jax.random.key(2), (3, D))
  return w, x


def test_a_plain_scan_in_a_scan_with_stacked_outputs():
  """No checkpoint: the flat scan's body is the inner body; the stacked
  outputs [a * b] are reshaped back to [a, b]."""
  w, x = _stack()
  closed, new = _rewritten(lambda p, x: _lax_nested(p, x), w, x)
  (scan,) = _scans(new)
  assert scan.params["length"] == A * B
  names = [e.primitive.name for e in scan.params["jaxpr"].jaxpr.eqns]
  assert "remat2" not in names and "scan" not in names
  _same_function(closed, new, w, x)


@pytest.mark.parametrize(
  "variant",
  [
    # The inner body reads the outer row whole (not as its scanned rows).
    dict(per_row=lambda h, wa: h + wa.sum() * 1e-2),
    dict(reverse=True),
  ],
  ids=["outer row read whole", "reversed"],
)
def test_what_does_not_qualify_is_left_as_it_is(variant):
  w, x = _stack()
  closed, new = _rewritten(lambda p, x: _lax_nested(p, x, **variant), w, x)
  assert new is closed


@pytest.mark.parametrize("checkpoint", [False, True])
def test_a_body_that_works_on_the_carry_first_is_left_as_it_is(checkpoint):
  """The outer body scales its carry before the inner scan (under a
  checkpoint or not): not one scan of layers (the scaling runs once per
  outer row, unlike what a checkpoint's body computes from constants
  alone, which moves out)."""
  w, x = _stack()

  def fn(w, x):
    def outer(h, wa):
      h, _ = jax.lax.scan(lambda h, wb: (jnp.tanh(h @ wb), None), h * 2, wa)
      return h, None

    body = jax.checkpoint(outer) if checkpoint else outer
    return jax.lax.scan(body, x, w)[0].sum()

  closed, new = _rewritten(fn, w, x)
  assert new is closed


def test_model_state_scanned_by_layer_is_left_as_it_is():
  """A nested scan over params and a model input that is not a param
  (model state stacked by layer): the state's rows stay on the outer axis
  (``build/state_rows.py``), so the pair is left as it is."""
  w, x = _stack()

  def fn(w, x, s):
    def outer(h, rows):
      def inner(h, row):
        wb, sb = row
        return jnp.tanh(h @ wb) + sb[:1], None

      return jax.lax.scan(inner, h, rows)[0], None

    return jax.lax.scan(outer, x, (w, s))[0].sum()

  closed = jax.make_jaxpr(fn)(w, x, w)
  assert nested_scans_as_one(closed, 1) is closed  # (s: not a param.)
  assert len(_scans(nested_scans_as_one(closed, 3))) == 1  # (All params.)


class _DropoutLayer(nn.Module):
  """``(h, mask) -> (h, mask)``: EasyLM's carry of an attention mask the
  layers pass on unchanged, and dropout."""

  @nn.compact
  def __call__(self, carry):
    h, mask = carry
    update = nn.Dropout(0.5, deterministic=False)(jnp.tanh(nn.Dense(D)(h)))
    return h + update * mask, mask


def test_a_carry_passed_on_and_each_layers_dropout_key():
  """A carry every layer passes on unchanged (the inner scan reads it as
  a constant; the outer scan's output is its input) and dropout keys
  split per outer row into the inner rows' (batched over the outer rows,
  then scanned [a * b]): one scan, the same function."""
  stack = nn.remat_scan(
    _DropoutLayer,
    lengths=(A, B),
    split_rngs={"params": True, "dropout": True},
  )()
  x = jnp.linspace(-1.0, 1.0, 2 * D).reshape(2, D)
  params = stack.init(jax.random.key(0), (x, jnp.ones_like(x)))

  def fn(params, x):
    rngs = {"dropout": jax.random.key(3)}
    h, mask = stack.apply(params, (x, jnp.ones_like(x)), rngs=rngs)
    return h.sum() + mask.sum()

  closed, new = _rewritten(fn, params, x)
  (scan,) = _scans(new)
  assert scan.params["length"] == A * B
  xs = scan.invars[scan.params["num_consts"] + scan.params["num_carry"] :]
  keys = [
    v for v in xs if jax.dtypes.issubdtype(v.aval.dtype, jax.dtypes.prng_key)
  ]
  assert [k.aval.shape for k in keys] == [(A * B,)]
  _same_function(closed, new, params, x)


def test_stacks_one_after_another_each_flatten():
  """Four stacks one after the other (an encoder's, a decoder's...):
  each pair is one scan (the rewrite goes on past the equations the
  first ones became)."""
  w, x = _stack()
  params = {"t": w * 0.3, "u": w * 0.5, "v": w[::-1] * 0.5, "w": w}

  def fn(params, x):
    for k in ("t", "u", "v"):
      x = x * _lax_nested(params[k], x, ys=False)
    return _lax_nested(params["w"], x, ys=False)

  closed, new = _rewritten(fn, params, x)
  assert len(_scans(closed)) == 4
  assert [s.params["length"] for s in _scans(new)] == [A * B] * 4
  _same_function(closed, new, params, x)
