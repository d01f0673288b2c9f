"""ParamsView: a stage's leaves in the model's structure, its optimizer's
state keyed by name and back."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from jpipe.runtime.build.params_view import ParamsView

# A model of four leaves: "emb" (whole), "layers/w" stacked (3 rows),
# "layers/b" stacked (3 rows), "head" (whole).
MODEL = {
  "emb": np.zeros((4, 2)),
  "head": np.zeros((2, 5)),
  "layers": {"b": np.zeros((3, 2)), "w": np.zeros((3, 2, 2))},
}
TREEDEF = jax.tree.structure(MODEL)  # leaves: emb, head, layers/b, layers/w


def _stage_view():
  """A stage holding "emb" and rows 1-2 of both stacked leaves, its
  managed leaves listed out of model order."""
  names = ["layers/w[2]", "emb", "layers/b[1]", "layers/w[1]", "layers/b[2]"]
  sources = [(3, 2), (0, -1), (2, 1), (3, 1), (2, 2)]
  leaves = [
    jnp.full((1, 2, 2), 2.0),
    jnp.arange(8.0).reshape(4, 2),
    jnp.full((1, 2), 10.0),
    jnp.full((1, 2, 2), 1.0),
    jnp.full((1, 2), 20.0),
  ]
  return ParamsView(TREEDEF, names, sources), leaves


def test_the_view_is_the_models_structure_with_rows_joined_in_order():
  view, leaves = _stage_view()
  tree = view.view(leaves)
  assert tree["head"] is None
  np.testing.assert_array_equal(tree["emb"], leaves[1])
  np.testing.assert_array_equal(tree["layers"]["w"][:, 0, 0], [1.0, 2.0])
  np.testing.assert_array_equal(tree["layers"]["b"][:, 0], [10.0, 20.0])
  # A whole-model mask lines up with it (optax's masks map over the
  # mask tree first).
  mask = jax.tree.map(lambda x: x.ndim > 2, MODEL)
  masked = jax.tree.map(lambda m, p: p if m else optax.MaskedNode(), mask, tree)
  assert masked["layers"]["w"] is tree["layers"]["w"]
  # Property: leaves(view(x)) == x.
  for a, b in zip(view.leaves(tree), leaves, strict=True):
    np.testing.assert_array_equal(a, b)


def test_an_adam_state_is_stored_keyed_by_name_and_read_back():
  view, leaves = _stage_view()
  tx = optax.adam(0.1)
  state = tx.init(view.view(leaves))
  stored = view.keyed(state)
  mu = stored[0].mu
  assert set(mu) == set(view.names)
  assert mu["layers/w[1]"].shape == (1, 2, 2)
  back = view.structured(stored)
  assert jax.tree.structure(back) == jax.tree.structure(state)
  for a, b in zip(jax.tree.leaves(back), jax.tree.leaves(state), strict=True):
    np.testing.assert_array_equal(a, b)


def test_a_whole_model_mask_state_round_trips():
  """A prefix mask (False for a whole module) leaves one MaskedNode for
  the module: still a params-shaped part, rebuilt as it was."""
  view, leaves = _stage_view()
  labels = {"emb": "frozen", "head": "train", "layers": "train"}
  tx = optax.multi_transform(
    {"train": optax.adam(0.1), "frozen": optax.set_to_zero()}, labels
  )
  params = view.view(leaves)
  state = tx.init(params)
  stored = view.keyed(state)
  mu = stored.inner_states["train"].inner_state[0].mu
  assert set(mu) == set(view.names)
  assert isinstance(mu["emb"], optax.MaskedNode)
  back = view.structured(stored)
  assert jax.tree.structure(back) == jax.tree.structure(state)
  grads = jax.tree.map(jnp.ones_like, params)
  updates, _ = tx.update(grads, back, params)  # The rebuilt state steps.
  np.testing.assert_array_equal(updates["emb"], 0.0)
  assert np.all(np.asarray(updates["layers"]["w"]) != 0)


def test_one_value_for_a_stacked_leaf_is_each_rows_and_read_back_once():
  """Adafactor keeps a (1,) placeholder for an unfactored leaf: each row
  stores it, the optimizer reads it back once."""
  view, leaves = _stage_view()
  tx = optax.adafactor(0.1)
  state = tx.init(view.view(leaves))
  stored = view.keyed(state)
  assert stored[0].v_row["layers/b[1]"].shape == (1,)
  back = view.structured(stored)
  assert jax.tree.structure(back) == jax.tree.structure(state)
  for a, b in zip(jax.tree.leaves(back), jax.tree.leaves(state), strict=True):
    assert a.shape == b.shape


def test_a_state_coupling_a_stacked_leafs_rows_is_refused_by_name():
  view, leaves = _stage_view()

  def init(params):  # One value per column of the stacked leaf.
    return {"col": jax.tree.map(lambda x: x.sum(0)[None].repeat(4, 0), params)}

  with pytest.raises(ValueError, match=r"layers/[wb]\[1\].*couples the rows"):
    view.keyed(init(view.view(leaves)))


def test_states_without_params_shaped_parts_pass_as_they_are():
  view, leaves = _stage_view()
  state = optax.sgd(0.1).init(view.view(leaves))
  assert view.keyed(state) == state
  count = optax.scale_by_schedule(lambda n: n).init(view.view(leaves))
  assert view.structured(view.keyed(count)) == count


def test_rows_of_a_leaf_stacked_on_axis_1_are_seen_in_its_layout():
  """``layers/w`` stacked on axis 1 ([2, 3 layers, 2]): the stage's rows
  (``moveaxis(w, 1, 0)[k:k+1]``) are seen as ``w[:, 1:3]``, and an Adam
  state's moments are keyed as rows and read back in that layout."""
  w = np.arange(12.0).reshape(2, 3, 2)
  rows = [jnp.asarray(np.moveaxis(w, 1, 0)[k : k + 1]) for k in (1, 2)]
  model = {"emb": np.zeros((4, 2)), "layers": {"w": w}}
  treedef = jax.tree.structure(model)  # leaves: emb, layers/w
  view = ParamsView(
    treedef,
    ["layers/w[1]", "layers/w[2]"],
    [(1, 1), (1, 2)],
    axes={1: (1, 3)},
  )
  tree = view.view(rows)
  np.testing.assert_array_equal(tree["layers"]["w"], w[:, 1:3])
  for a, b in zip(view.leaves(tree), rows, strict=True):
    np.testing.assert_array_equal(a, b)
  tx = optax.adam(0.1)
  grads = jax.tree.map(lambda x: None if x is None else 2 * x, tree)
  _, state = tx.update(grads, tx.init(tree), tree)
  stored = view.keyed(state)
  np.testing.assert_allclose(  # (mu = (1 - b1) g.)
    stored[0].mu["layers/w[2]"], 0.1 * 2 * np.moveaxis(w, 1, 0)[2:3]
  )
  back = view.structured(stored)
  np.testing.assert_allclose(back[0].mu["layers"]["w"], 0.2 * w[:, 1:3])
