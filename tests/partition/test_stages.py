"""The core guarantee: stages run in order = jax.value_and_grad(loss_fn)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jpipe.partition import GraphCosts, solve_contiguous
from jpipe.partition._plan import plan_traced
from jpipe.partition._profile import profile_nodes
from jpipe.partition._stages import Stages
from jpipe.partition._trace import trace
from tests import jitted, tiers
from tests.partition import flax_models


@pytest.fixture(scope="module", params=sorted(flax_models.CASES))
def case(request):
  loss_fn, params, batch, has_aux = flax_models.CASES[request.param]()
  traced = trace(loss_fn, params, batch, has_aux=has_aux)
  expected = jitted.value_and_grad(loss_fn, has_aux=has_aux)(params, batch)
  return request.param, traced, params, batch, expected


def _assert_tree_close(actual, expected):
  for a, e in zip(
    jax.tree.leaves(actual), jax.tree.leaves(expected), strict=True
  ):
    scale = float(np.max(np.abs(e))) if np.size(e) else 1.0
    np.testing.assert_allclose(a, e, rtol=1e-5, atol=1e-6 * max(scale, 1.0))


# Each mode at two stage counts and each count in the default tier; the
# other four pairs in the slow tier.
_SLOW_SPLITS = {
  (1, "residuals"),
  (2, "recompute"),
  (4, "residuals"),
  (8, "recompute"),
}


@pytest.mark.parametrize(
  "num_stages, mode",
  [
    tiers.slow(n, m) if (n, m) in _SLOW_SPLITS else (n, m)
    for n in (1, 2, 4, 8)
    for m in ("recompute", "residuals")
  ]
  # Fusion changes only the last stage: one and several stages suffice.
  + [(1, "fuse_last"), (4, "fuse_last")],
)
def test_stages_equal_value_and_grad(case, num_stages, mode):
  name, traced, params, batch, (expected_out, expected_grads) = case
  flops = traced.node_flops()
  num_stages = min(num_stages, traced.num_nodes)
  solution = solve_contiguous(
    GraphCosts(3.0 * flops, edges=traced.edges(), bandwidth=1e9), num_stages
  )
  stages = Stages(traced, solution.stage_of_node())
  out, grads = stages.run_forward_backward(
    params,
    batch,
    recompute=mode == "recompute",
    fuse_last=mode == "fuse_last",
  )
  _assert_tree_close(out, expected_out)
  _assert_tree_close(grads, expected_grads)


def test_only_a_stage_without_outputs_runs_fused():
  loss_fn, params, batch, _ = flax_models.mlp_case()
  traced = trace(loss_fn, params, batch)
  n = traced.num_nodes
  stages = Stages(traced, [0] * (n // 2) + [1] * (n - n // 2))
  first_params, _ = stages.split_params(params)
  first_batch, _ = stages.split_batch(batch)
  with pytest.raises(ValueError, match="stage 0 has outputs"):
    stages.forward_backward(0, first_params, first_batch, (), (1.0,))


def test_node_grouping_follows_module_calls():
  loss_fn, params, batch, _ = flax_models.gpt_case()
  traced = trace(loss_fn, params, batch)
  assert traced.node_names[0] == "embed"
  assert traced.node_names[-1] == "embed.attend"  # the tied head, own node
  # The embedding table is read by the first and the last node.
  leaves = traced.node_param_leaves()
  assert leaves[0] & leaves[-1]
  eqn_node = np.asarray(traced.eqn_node)
  assert np.all(np.diff(eqn_node) >= 0)


# flax_models.nnx_case's depth-1 nodes: each nnx.List item its own.
NNX_BLOCK_NODES = ("stem", *(f"blocks[{i}]" for i in range(4)), "head")


def test_nnx_modules_get_their_paths_as_nodes():
  """A level per module: an ``nnx.List``'s items are depth 1 (as linen's
  ``blocks_0`` would be), their submodules depth 2."""
  from flax import nnx

  loss_fn, params, batch, _ = flax_models.nnx_case()
  coarse = trace(loss_fn, params, batch)
  fine = trace(loss_fn, params, batch, depth=2)
  assert coarse.node_names == NNX_BLOCK_NODES
  # Depth 2: each block's submodules (its residual glue a node of its own).
  assert fine.node_names[:4] == (
    "stem",
    "blocks[0]/norm",
    "blocks[0]/linear",
    "blocks[0]",
  )
  assert "__call__" not in nnx.Linear.__dict__ or not hasattr(
    nnx.Linear.__call__, "__wrapped__"
  )  # the patch is gone after tracing


def test_a_module_called_past_its_parent_gets_its_whole_path():
  """The root calling an encoder's list items itself (not through the
  encoder): ``encoder/layers[0]``, a level per module on the path."""
  from flax import nnx

  class Encoder(nnx.Module):
    def __init__(self, rngs):
      self.layers = nnx.List([nnx.Linear(4, 4, rngs=rngs) for _ in range(2)])

  class Net(nnx.Module):
    def __init__(self, rngs):
      self.encoder = Encoder(rngs)
      self.head = nnx.Linear(4, 1, rngs=rngs)

    def __call__(self, x):
      for layer in self.encoder.layers:
        x = jnp.tanh(layer(x))
      return self.head(x)

  graphdef, params = nnx.split(Net(nnx.Rngs(0)))

  def loss_fn(params, batch):
    return jnp.mean(nnx.merge(graphdef, params)(batch) ** 2)

  traced = trace(loss_fn, params, jnp.ones((2, 4)), depth=2)
  assert traced.node_names == ("encoder/layers[0]", "encoder/layers[1]", "head")


def test_nnx_modules_inside_nnx_transforms_keep_their_paths():
  """Blocks called through ``nnx.remat`` (a copy rebuilt inside the
  transform) are nodes named as the plain calls are; split across
  stages, value and grads equal one device's."""
  loss_fn, params, batch, _ = flax_models.nnx_case(remat=True)
  traced = trace(loss_fn, params, batch)
  assert traced.node_names == NNX_BLOCK_NODES
  stages = Stages(traced, [0, 0, 1, 1, 2, 2])
  out, grads = stages.run_forward_backward(params, batch)
  want_out, want_grads = jitted.value_and_grad(loss_fn)(params, batch)
  _assert_tree_close(out, want_out)
  _assert_tree_close(grads, want_grads)


def test_tied_embedding_is_replicated_with_summed_grads():
  loss_fn, params, batch, _ = flax_models.gpt_case()
  traced = trace(loss_fn, params, batch)
  n = traced.num_nodes
  stages = Stages(traced, [0] * (n // 2) + [1] * (n - n // 2))
  shared = set(stages.specs[0].param_leaves) & set(stages.specs[1].param_leaves)
  assert len(shared) == 1  # the embedding table, on both stages
  _, grads = stages.run_forward_backward(params, batch)
  _, expected = jitted.value_and_grad(loss_fn)(params, batch)
  _assert_tree_close(grads, expected)


def test_encoder_output_feeds_every_decoder_stage():
  loss_fn, params, batch, _ = flax_models.encoder_decoder_case()
  traced = trace(loss_fn, params, batch)
  names = traced.node_names
  decoder = {
    "dec_in": 1,
    "dec_0": 1,
    "dec_1": 2,
    "dec_2": 3,
    "dec_3": 4,
    "head": 4,
  }
  stages = Stages(traced, [decoder.get(n, 0) for n in names])
  encoder_out = set(stages.specs[0].outputs)
  for spec in stages.specs[1:]:
    if any(names[traced.eqn_node[i]].startswith("dec_") for i in spec.eqns):
      assert encoder_out & set(spec.inputs)


def test_depth_two_gives_finer_nodes():
  loss_fn, params, batch, has_aux = flax_models.resnet_case()
  coarse = trace(loss_fn, params, batch, has_aux=has_aux)
  fine = trace(loss_fn, params, batch, has_aux=has_aux, depth=2)
  assert fine.num_nodes > coarse.num_nodes
  assert "block_0/BatchNorm_0" in fine.node_names


def test_bad_assignments_raise():
  loss_fn, params, batch, _ = flax_models.mlp_case()
  traced = trace(loss_fn, params, batch)
  n = traced.num_nodes
  with pytest.raises(ValueError, match="later stage"):
    Stages(traced, [1] * (n // 2) + [0] * (n - n // 2))
  with pytest.raises(ValueError, match="have no nodes"):
    Stages(traced, [0] * (n - 1) + [2])
  with pytest.raises(ValueError, match="entries for"):
    Stages(traced, [0])
  with pytest.raises(ValueError, match="scalar loss"):
    trace(lambda p, b: jax.tree.leaves(p)[0], params, batch)


def test_scan_is_one_node_per_layer_and_dropout_rng_flows():
  """A scan over stacked params (its ys stacked too) is one node per
  layer; the layers on one stage, or spread over two, compute what the
  model does."""
  loss_fn, params, batch, _ = flax_models.dropout_scan_case()
  traced = trace(loss_fn, params, batch)
  layers = ("scan[0]", "scan[1]", "scan[2]")
  assert traced.node_names == ("inp", "drop", *layers, "drop2", "head")
  for layer in layers:
    prims = [
      traced.jaxpr.eqns[i].primitive.name
      for i in traced.node_eqns(traced.node_names.index(layer))
    ]
    assert prims.count("scan") == 1
  want = jitted.value_and_grad(loss_fn)(params, batch)
  for stage_of_node in ([0, 0, 1, 1, 1, 2, 2], [0, 0, 0, 1, 1, 2, 2]):
    stages = Stages(traced, stage_of_node)
    _assert_tree_close(stages.run_forward_backward(params, batch), want)
  # The dropout key reaches two stages; masks are the same as unsplit.
  key_leaf = [i for i, p in enumerate(traced.leaf_paths) if "rng" in p][
    0
  ] - traced.num_param_leaves
  readers = [
    s for s, spec in enumerate(stages.specs) if key_leaf in spec.batch_leaves
  ]
  assert readers == [0, 2]


@pytest.mark.parametrize("method", ["mixed", "pipedream"])
@pytest.mark.parametrize("num_devices", [2, 3])
def test_every_method_keeps_value_and_grad(case, method, num_devices):
  """The mixed pipe (several stages per device) and PipeDream's antichain
  split give stages that still compute exactly the loss and gradients."""
  name, traced, params, batch, (expected_out, expected_grads) = case
  del name
  costs = profile_nodes(traced, params, batch, method="analytic")
  plan = plan_traced(
    traced, costs, min(num_devices, traced.num_nodes), method=method
  )
  stages = Stages(traced, plan.stage_of_node)
  out, grads = stages.run_forward_backward(params, batch, recompute=False)
  _assert_tree_close(out, expected_out)
  _assert_tree_close(grads, expected_grads)
