"""A ``fori_loop`` over stacked layers that reads row ``i`` of their params
(``partition/_indexed_loops.py``): rewritten as a scan over the rows, the
same values and gradients, for each way JAX code indexes a row; loops that
read anything but row ``i`` are left as they are; a pipeline splits such a
model per layer and trains as one device."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jpipe
from jpipe.partition._indexed_loops import indexed_loops_as_scans
from tests import jitted
from tests.runtime.test_explicit_mesh import _reference
from tests.runtime.test_pipeline_sync import _assert_tree_close

LAYERS = 6


def _params(axis=0):
  """Layer params stacked on ``axis`` (1: MaxText's layout, ``w[:, i]``
  is layer i's)."""
  keys = jax.random.split(jax.random.key(0), 3)
  params = {
    "b": jax.random.normal(keys[0], (LAYERS, 8)) * 0.1,
    "head": jax.random.normal(keys[1], (8, 8)) * 0.3,
    "w": jax.random.normal(keys[2], (LAYERS, 8, 8)) * 0.3,
  }
  for k in ("b", "w"):
    params[k] = jnp.moveaxis(params[k], 0, axis)
  return params


def _layer(w, b, h):
  return jnp.tanh(h @ w + b[None])


# Ways of reading layer i's params in a fori_loop body.
ROWS = {
  "index": lambda p, i: (p["w"][i], p["b"][i]),
  "tree_map": lambda p, i: jax.tree.map(lambda x: x[i], (p["w"], p["b"])),
  "dynamic_index_in_dim": lambda p, i: (
    jax.lax.dynamic_index_in_dim(p["w"], i, keepdims=False),
    jax.lax.dynamic_index_in_dim(p["b"], i, keepdims=False),
  ),
  "dynamic_slice_in_dim": lambda p, i: (
    jax.lax.dynamic_slice_in_dim(p["w"], i, 1)[0],
    jax.lax.dynamic_slice_in_dim(p["b"], i, 1)[0],
  ),
}
# Layer i's params stacked on axis 1 (``_params(axis=1)``).
ROWS_ON_AXIS_1 = lambda p, i: (p["w"][:, i], p["b"][:, i])  # noqa: E731


def _loop(loop, body, start, x):
  """``body(i, h)`` for i in start..LAYERS-1, as ``loop`` writes it."""
  if loop == "fori":
    return jax.lax.fori_loop(start, LAYERS, body, x)
  counts = {"arange": jnp.arange, "np.arange": np.arange}[loop]
  steps = counts(start, LAYERS)  # (iota, or a constant the loss holds.)
  return jax.lax.scan(lambda h, i: (body(i, h), None), x, steps)[0]


def _loss(rows, start=0, loop="fori"):
  def loss_fn(p, batch):
    def body(i, h):
      return _layer(*rows(p, i), h)

    h = _loop(loop, body, start, batch["x"])
    logits = h @ p["head"]
    return optax.softmax_cross_entropy_with_integer_labels(
      logits, batch["y"]
    ).mean()

  return loss_fn


def _batch():
  x = jax.random.normal(jax.random.key(1), (8, 8))
  return {"x": x, "y": jnp.arange(8) % 8}


def _scan(closed):
  (eqn,) = [e for e in closed.jaxpr.eqns if e.primitive.name == "scan"]
  return eqn


def _as_function(closed):
  return lambda *a: jax.core.eval_jaxpr(closed.jaxpr, closed.consts, *a)[0]


def _rewritten_loop(params, rows, loop="fori"):
  """(the loss over ``params`` reading ``rows`` traced, its rewrite, the
  rewrite's scan and scanned inputs), checking that the rewrite has the
  same values and gradients."""
  batch = _batch()
  flat = jax.tree.leaves((params, batch))
  loss_fn = _loss(rows, loop=loop)
  closed = jax.make_jaxpr(lambda *f: loss_fn(*jax.tree.unflatten(
    jax.tree.structure((params, batch)), f)))(*flat)  # fmt: skip
  rewritten = indexed_loops_as_scans(closed, num_param_leaves=3)
  want = jitted.value_and_grad(_as_function(closed), range(3))(*flat)
  got = jitted.value_and_grad(_as_function(rewritten), range(3))(*flat)
  for g, e in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
    np.testing.assert_allclose(g, e, rtol=1e-6, atol=1e-6)
  scan = _scan(rewritten)
  p = scan.params
  return (
    closed,
    rewritten,
    scan,
    scan.invars[p["num_consts"] + p["num_carry"] :],
  )


@pytest.mark.parametrize(
  "rows, loop",
  [(r, "fori") for r in ROWS] + [("index", "arange"), ("index", "np.arange")],
)
def test_a_row_indexed_loop_becomes_a_scan_over_the_rows(rows, loop):
  closed, _, scan, xs = _rewritten_loop(_params(), ROWS[rows], loop)
  b, w = closed.jaxpr.invars[0], closed.jaxpr.invars[2]
  assert {b, w} <= set(xs)  # The stacked params are scanned, row by row.
  assert b not in scan.invars[: scan.params["num_consts"]]


def test_a_loop_reading_layers_on_axis_1_scans_them_moved_first():
  """``w[:, i]`` (layers stacked on axis 1): the scan reads each such
  param through a transpose moving axis 1 first (what nn.scan's params on
  axis 1 are read through); the same values and gradients."""
  closed, rewritten, _, xs = _rewritten_loop(_params(axis=1), ROWS_ON_AXIS_1)
  made = {e.outvars[0]: e for e in rewritten.jaxpr.eqns}
  b, w = closed.jaxpr.invars[0], closed.jaxpr.invars[2]
  moved = {made[x].invars[0]: made[x] for x in xs if x in made}
  assert set(moved) == {b, w}
  assert moved[w].params["permutation"] == (1, 0, 2)
  assert moved[b].params["permutation"] == (1, 0)


NOT_ROW_I = {
  "next row": lambda p, i: (p["w"][(i + 1) % LAYERS], p["b"][i]),
  "a scrambled row": lambda p, i: (p["w"][(3 * i) % LAYERS], p["b"][i]),
  "all rows": lambda p, i: (p["w"].mean(0), p["b"][i]),
}


@pytest.mark.parametrize(
  "case", [*NOT_ROW_I, "from 1", "arange from 1", "read outside"]
)
def test_loops_reading_other_rows_are_left_as_they_are(case):
  params, batch = _params(), _batch()
  rows = NOT_ROW_I.get(case, ROWS["index"])
  loop = "arange" if case.startswith("arange") else "fori"
  inner = _loss(rows, start=1 if "from 1" in case else 0, loop=loop)

  def loss_fn(p, batch):
    extra = p["w"].sum() * 1e-3 if case == "read outside" else 0.0
    return inner(p, batch) + extra

  flat = jax.tree.leaves((params, batch))
  tree = jax.tree.structure((params, batch))
  closed = jax.make_jaxpr(lambda *f: loss_fn(*jax.tree.unflatten(tree, f)))(
    *flat
  )
  rewritten = indexed_loops_as_scans(closed, num_param_leaves=3)
  p = _scan(rewritten).params
  w = closed.jaxpr.invars[2]
  # (b is still read at row i where only w is read otherwise.)
  assert w in _scan(rewritten).invars[: p["num_consts"]]
  np.testing.assert_allclose(
    _as_function(rewritten)(*flat), _as_function(closed)(*flat), rtol=1e-6
  )


@pytest.mark.parametrize(
  "loop, axis", [("fori", 0), ("arange", 0), ("fori", 1)]
)
def test_a_pipeline_splits_the_loop_per_layer_and_trains_as_one_device(
  loop, axis
):
  """Layers stacked on axis 0, or on axis 1 (``w[:, i]``), each kept in
  its layout by ``gather_params``."""
  params, batch = _params(axis), _batch()
  loss_fn = _loss(ROWS_ON_AXIS_1 if axis else ROWS["index"], loop=loop)
  tx = optax.adam(1e-2)
  pipe = jpipe.Pipeline(
    loss_fn,
    params,
    batch,
    num_stages=2,
    devices=jax.devices()[:2],
    num_microbatches=2,
    optimizer=tx,
  )
  assert len(pipe.plan.node_names) == LAYERS  # (One node per layer.)
  assert set(pipe.plan.stage_of_node) == {0, 1}
  state = pipe.init(params)
  for _ in range(2):
    state, _ = pipe.step(state, batch)
  expected = _reference(loss_fn, params, [[batch]] * 2, tx)
  got = pipe.gather_params(state)
  assert got["w"].shape == params["w"].shape  # (The model's own layout.)
  _assert_tree_close(got, expected)
