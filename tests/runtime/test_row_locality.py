"""A scanned layer's stacked leaf may have its rows on several stages,
each stepping its own rows: an optimizer whose step mixes a leaf's rows
(Adafactor's default block-RMS clip, LAMB's trust ratio, SM3's
accumulators) is refused; the row-wise ones run and equal one device
(``runtime/build/row_locality.py``)."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from optax import contrib

import jpipe
from jpipe.runtime.build.row_locality import mixed_rows
from tests import jitted, tiers
from tests.partition import scan_models

L = 6  # rows (layers) of the stacked leaves below


def _mixed(fn, *args, rows=(0,)):
  """Per output of ``fn(*args)``, whether it mixes the rows of the
  inputs at positions ``rows``."""
  traced = jax.make_jaxpr(fn)(*args)
  return [bool(m) for m in mixed_rows(traced, rows)]


def test_which_operations_keep_the_rows_apart():
  """Each case stated by hand: row r of the output from row r alone, or
  not."""
  x = jnp.ones((L, 3, 4))
  m = jnp.ones((L, 4, 5))
  cases = {
    "elementwise": (lambda a: jnp.sqrt(a * 2 + 1), False),
    "mean over the last axes": (lambda a: jnp.mean(a, axis=(1, 2)), False),
    "mean over everything": (lambda a: jnp.mean(a), True),
    "rms broadcast back": (lambda a: a / jnp.sqrt(jnp.mean(a**2)), True),
    "max over rows": (lambda a: jnp.max(a, axis=0), True),
    "per-row norm": (
      lambda a: a / jnp.linalg.norm(a, axis=(1, 2), keepdims=True),
      False,
    ),
    "transpose keeping axis 0": (lambda a: jnp.swapaxes(a, 1, 2), False),
    "transpose moving axis 0": (lambda a: jnp.swapaxes(a, 0, 1), True),
    "reshape keeping rows": (lambda a: a.reshape(L, 12), False),
    "reshape merging rows": (lambda a: a.reshape(-1), True),
    "batched matmul": (lambda a: jnp.einsum("lij,ljk->lik", a, m), False),
    "contracting the rows": (lambda a: jnp.einsum("lij,lij->ij", a, a), True),
    "first rows": (lambda a: a[:2], True),
    "a row rolled": (lambda a: jnp.roll(a, 1, axis=0), True),
    "cumsum along rows": (lambda a: jnp.cumsum(a, axis=0), True),
    "cumsum along a row": (lambda a: jnp.cumsum(a, axis=2), False),
    "jit": (lambda a: jax.jit(lambda b: b * 3)(a), False),
    "fori_loop, row-wise body": (
      lambda a: jax.lax.fori_loop(
        0, 3, lambda _, b: b @ jnp.swapaxes(b, 1, 2) @ b, a
      ),
      False,
    ),
    "fori_loop mixing": (
      lambda a: jax.lax.fori_loop(0, 3, lambda _, b: b + jnp.sum(b), a),
      True,
    ),
    "cond on a row's value": (
      lambda a: jax.lax.cond(a[0, 0, 0] > 0, lambda b: b, lambda b: -b, a),
      True,
    ),
  }
  for name, (fn, mixes) in cases.items():
    assert _mixed(fn, x) == [mixes], name


def test_only_row_inputs_count():
  """A scalar (a step count) or an unsplit leaf mixed in is no row
  mixing."""
  fn = lambda a, count, w: a * count + jnp.sum(w)  # noqa: E731
  assert _mixed(fn, jnp.ones((L, 2)), jnp.float32(2), jnp.ones((L, 2))) == [
    False
  ]
  assert _mixed(
    fn, jnp.ones((L, 2)), jnp.float32(2), jnp.ones((L, 2)), rows=(0, 2)
  ) == [True]


_ROW_WISE = {
  "adamw": lambda: optax.adamw(1e-2),
  "muon": lambda: contrib.muon(1e-3),
  "sgd momentum": lambda: optax.sgd(0.1, momentum=0.9),
  "lion": lambda: optax.lion(1e-3),
  "adafactor, no block rms": lambda: optax.adafactor(
    1e-2, clipping_threshold=None, multiply_by_parameter_scale=False
  ),
  "schedule-free": lambda: contrib.schedule_free_adamw(1e-3),
  "adan": lambda: optax.adan(1e-3),
}
_ROW_MIXING = {
  "adafactor": lambda: optax.adafactor(1e-2),
  "lamb": lambda: optax.lamb(1e-3),
  "novograd": lambda: optax.novograd(1e-3),
  "sm3": lambda: optax.sm3(1e-2),
  # A stacked [L, d] leaf is one matrix to muon (a [L, d, e] one gets its
  # adam, row-wise).
  "muon, a stacked vector": lambda: contrib.muon(1e-3),
}


def _update_fn(tx):
  def update(grad, param):
    state = tx.init(param)
    for _ in range(2):  # Twice: state carried over (SM3's accumulators).
      u, state = tx.update(grad, state, param)
      param = param + u
    return param

  return update


@pytest.mark.parametrize("axis", [0, 1])
@pytest.mark.parametrize("name", [*_ROW_WISE, *_ROW_MIXING])
def test_the_analysis_agrees_with_running_the_rows_apart(name, axis):
  """Numerically: two steps on all rows against two steps on rows 0..1
  and 2..5 apart -- equal exactly where the analysis sees no mixing; the
  rows on axis 0, or on axis 1 (``nn.scan(variable_axes={"params": 1})``)."""
  tx = {**_ROW_WISE, **_ROW_MIXING}[name]()
  rng = np.random.default_rng(0)
  shape = (L, 4) if "vector" in name else (L, 4, 3)
  shape = (*shape[1 : axis + 1], L, *shape[axis + 1 :])  # Rows on axis.
  grad = jnp.asarray(rng.normal(size=shape), jnp.float32)
  param = jnp.asarray(rng.normal(size=shape), jnp.float32)
  update = _update_fn(tx)
  traced = jax.make_jaxpr(update)(grad, param)
  mixes = bool(mixed_rows(traced, {0: axis, 1: axis}, [axis])[0])
  whole = update(grad, param)
  rows = lambda x, a, b: jax.lax.slice_in_dim(x, a, b, axis=axis)  # noqa: E731
  apart = jnp.concatenate(
    [
      update(rows(grad, 0, 2), rows(param, 0, 2)),
      update(rows(grad, 2, L), rows(param, 2, L)),
    ],
    axis=axis,
  )
  assert mixes == (name in _ROW_MIXING)
  assert bool(np.allclose(whole, apart, rtol=1e-5, atol=1e-6)) != mixes


def test_rows_on_another_axis_are_followed_where_they_go():
  """Rows on axis 1: each case stated by hand, for an output split on
  axis 1 (or, given, another)."""
  x = jnp.ones((3, L, 4))
  w = jnp.ones((4, 5))
  cases = {
    "elementwise": (lambda a: a * 2 + 1, 1, False),
    "mean over axis 1": (lambda a: jnp.mean(a, axis=1), 1, True),
    "mean over the others": (lambda a: jnp.mean(a, axis=(0, 2)), 0, False),
    "... split on the wrong axis": (lambda a: jnp.mean(a, (0, 2)), 1, True),
    "swapped to axis 0": (lambda a: jnp.swapaxes(a, 0, 1), 1, True),
    "swapped there and back": (
      lambda a: jnp.swapaxes(jnp.swapaxes(a, 0, 1) * 2, 0, 1),
      1,
      False,
    ),
    "a matmul on the last axis": (lambda a: a @ w, 1, False),
    "contracting the rows": (
      lambda a: jnp.einsum("ilj,ilj->ij", a, a),
      1,
      True,
    ),
    "a batched contraction": (
      lambda a: jnp.einsum("ilj,ilj->l", a, a),
      0,
      False,
    ),
    "rows of the right operand": (
      lambda a: jnp.einsum("ij,kl->ijkl", w, a[0]),
      2,
      False,
    ),
    "the first rows": (lambda a: a[:, :2], 1, True),
    "a slice of another axis": (lambda a: a[:2], 1, False),
    "reshape keeping axes 0-1": (lambda a: a.reshape(3, L, 2, 2), 1, False),
    "reshape merging axes 0-1": (lambda a: a.reshape(3 * L, 4), 1, True),
    "rms over everything": (lambda a: a / jnp.sqrt(jnp.mean(a**2)), 1, True),
  }
  for name, (fn, out_axis, mixes) in cases.items():
    traced = jax.make_jaxpr(fn)(x)
    assert bool(mixed_rows(traced, {0: 1}, [out_axis])[0]) == mixes, name


@pytest.mark.parametrize(
  "make, leaf",
  [
    pytest.param(scan_models.plain_case, "layers/", id="axis 0"),
    tiers.slow(  # (Rows on axis 1: the analysis's own tests above.)
      lambda: scan_models.linen_case(scan_axis=1, attention_bias=False),
      "params/blocks/",
      id="axis 1",
    ),
  ],
)
def test_a_pipeline_refuses_a_row_mixing_step_on_split_scanned_rows(make, leaf):
  loss_fn, params, batch = make()

  def pipeline(tx):
    return jpipe.Pipeline(
      loss_fn,
      params,
      batch,
      num_stages=2,
      devices=jax.devices()[:2],
      num_microbatches=2,
      optimizer=tx,
    )

  with pytest.raises(jpipe.OptimizerError, match=f"mixes the rows of '{leaf}"):
    pipeline(optax.adafactor(0.01))
  tx = optax.adafactor(
    0.01, clipping_threshold=None, multiply_by_parameter_scale=False
  )
  pipe = pipeline(tx)
  assert pipe.plan.num_stages == 2
  state, _ = pipe.step(pipe.init(params), batch)
  g = jitted.grad(loss_fn)(params, batch)
  u, _ = tx.update(g, tx.init(params), params)
  want = optax.apply_updates(params, u)
  jax.tree.map(
    lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6),
    pipe.gather_params(state),
    want,
  )
