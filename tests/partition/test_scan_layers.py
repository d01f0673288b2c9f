"""A scan over layers traced as one node per layer, cut into stages that
each run their layers as one scan (``partition._scan_layers``)."""

import jax
import jax.extend
import numpy as np
import pytest

from jpipe import partition
from jpipe.partition._flops import eqn_flops
from jpipe.partition._plan import INDIVISIBLE_FACTOR
from tests import jitted, tiers
from tests.partition import scan_models

CASES = {
  "nn.scan": lambda: scan_models.linen_case(),
  "nn.scan(nn.remat)": lambda: scan_models.linen_case(remat=True),
  # (MaxText's and flaxformer's layout: the layer axis second.)
  "nn.scan, layers on axis 1": lambda: scan_models.linen_case(scan_axis=1),
  # (A scan in a scan, params [2, 4, ...]: one node per layer too.)
  "nn.remat_scan": lambda: scan_models.linen_case(remat_scan=(2, 4)),
  "lax.scan": scan_models.plain_case,
  "nnx.scan": scan_models.nnx_case,
}
BASE = {
  "nn.scan": "blocks",
  "nn.scan(nn.remat)": "blocks",
  "nn.scan, layers on axis 1": "blocks",
  "nn.remat_scan": "blocks",
  "lax.scan": "scan",
  "nnx.scan": "blocks",  # The module the body runs, as nn.scan's.
}


SLOW_CASES = ("nn.scan, layers on axis 1", "nn.remat_scan")


def _plan(traced, params, batch, num_stages):
  costs = partition.profile_nodes(traced, params, batch, method="analytic")
  return partition.plan_traced(traced, costs, num_stages)


@pytest.mark.parametrize("case", list(CASES))
def test_one_node_per_layer_with_its_rows(case):
  loss_fn, params, batch = CASES[case]()
  traced = partition.trace(loss_fn, params, batch)
  layers = [f"{BASE[case]}[{k}]" for k in range(scan_models.LAYERS)]
  assert [n for n in traced.node_names if n in layers] == layers
  index = [traced.node_names.index(n) for n in layers]
  # Each layer its own cost: one iteration of the body (the whole scan's
  # count over its length, traced apart), plus glue joining the node.
  whole = jax.make_jaxpr(loss_fn)(params, batch)
  (scan,) = [e for e in whole.eqns if e.primitive.name == "scan"]
  if case == "nn.remat_scan":  # The inner scan, under the checkpoint.
    (remat,) = scan.params["jaxpr"].eqns
    scan = remat.params["jaxpr"].eqns[-1]
  per_layer = eqn_flops(scan) / scan.params["length"]
  iterations = [
    (it[1], eqn_flops(e))
    for e, it in zip(traced.jaxpr.eqns, traced.eqn_iteration, strict=True)
    if it is not None
  ]
  assert [k for k, _ in iterations] == list(range(scan_models.LAYERS))
  np.testing.assert_allclose([f for _, f in iterations], per_layer)
  assert (traced.node_flops()[index] >= per_layer).all()
  # Each layer reads its own row of every stacked leaf, no other layer's.
  reads = [traced.node_param_leaves()[i] for i in index]
  for a in range(len(reads)):
    for b in range(a):
      assert not reads[a] & reads[b]
  # Stacked leaves become rows, and back.
  leaves = jax.tree.leaves(params)
  rows = traced.traced_params(params)
  paths = [
    jax.tree_util.keystr(p) for p, _ in jax.tree.leaves_with_path(params)
  ]
  stacked = sum(1 for p in paths if "'blocks'" in p or "'layers'" in p)
  assert len(rows) == len(leaves) + (scan_models.LAYERS - 1) * stacked
  for a, b in zip(traced.model_leaves(rows), leaves, strict=True):
    np.testing.assert_array_equal(a, b)
  # A row: the leaf's slice at its layer axis, that axis first; nested,
  # row i * b + j is layer [i, j].
  axis = 1 if "axis 1" in case else 0
  layer_paths = [p for p in paths if "'blocks'" in p or "'layers'" in p]
  leaf = leaves[paths.index(layer_paths[0])]
  row_names = traced.leaf_paths[: len(rows)]
  k = row_names.index(f"[0]{layer_paths[0]}[5]")  # (Of (params, batch).)
  if case == "nn.remat_scan":
    np.testing.assert_array_equal(rows[k], leaf[1, 1][None])
  else:
    np.testing.assert_array_equal(rows[k], np.moveaxis(leaf, axis, 0)[5:6])


@pytest.mark.parametrize("num_stages", [2, tiers.slow(4)])
@pytest.mark.parametrize(
  "case",  # (Axis 1 and nested run as axis 0 once traced: the test above.)
  [tiers.slow(c) if c in SLOW_CASES else c for c in CASES],
)
def test_stages_run_their_layers_as_one_scan(case, num_stages):
  loss_fn, params, batch = CASES[case]()
  traced = partition.trace(loss_fn, params, batch)
  plan = _plan(traced, params, batch, num_stages)
  # Balanced: the slowest stage within 1.3x of the mean.
  seconds = np.asarray(plan.stage_seconds)
  assert seconds.max() / seconds.mean() <= INDIVISIBLE_FACTOR
  assert plan.indivisible_note is None
  stages = partition.Stages(traced, plan.stage_of_node)
  want_loss, want_grads = jitted.value_and_grad(loss_fn)(params, batch)
  for recompute in (True, False):
    loss, grads = stages.run_forward_backward(
      params, batch, recompute=recompute
    )
    np.testing.assert_allclose(loss, want_loss, rtol=1e-5)
    for a, b in zip(
      jax.tree.leaves(grads), jax.tree.leaves(want_grads), strict=True
    ):
      assert a.shape == b.shape  # The model's stacked layout.
      np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)
  # Compile stays one layer per stage: one scan over the stage's layers.
  layers_of = [0] * num_stages
  for name, s in zip(traced.node_names, plan.stage_of_node, strict=True):
    layers_of[s] += name.startswith(BASE[case] + "[")
  stage_params = stages.split_params(params)
  stage_batch = stages.split_batch(batch)
  acts = _stage_inputs(stages, stage_params, stage_batch)
  for s in range(num_stages):
    jaxpr = jax.make_jaxpr(lambda p, b, a, s=s: stages.forward(s, p, b, a))(
      stage_params[s], stage_batch[s], acts[s]
    )
    lengths = [
      e.params["length"] for e in jaxpr.eqns if e.primitive.name == "scan"
    ]
    assert lengths == ([layers_of[s]] if layers_of[s] else [])


def _stage_inputs(stages, stage_params, stage_batch):
  values, acts = {}, []
  for s, spec in enumerate(stages.specs):
    acts.append(tuple(values[v] for v in spec.inputs))
    outputs, _ = stages.forward(s, stage_params[s], stage_batch[s], acts[-1])
    values.update(zip(spec.outputs, outputs, strict=True))
  return acts


def test_abstract_params_trace_and_plan():
  """Shapes only (nothing allocated): the rows are shapes too."""
  loss_fn, params, batch = scan_models.plain_case()
  shapes = jax.tree.map(
    lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), params
  )
  traced = partition.trace(loss_fn, shapes, batch)
  rows = traced.traced_params(shapes)
  assert all(isinstance(r, jax.ShapeDtypeStruct) for r in rows)
  assert [r.shape for r in rows] == [
    v.aval.shape for v in traced.jaxpr.invars[: traced.num_param_leaves]
  ]
  plan = _plan(traced, shapes, batch, 4)
  assert plan.indivisible_note is None


def test_a_shared_scan_stays_one_node_and_the_plan_says_so():
  """Blocks sharing one set of params (``variable_broadcast``) are not
  stacked: one node, over the even share of 4 stages; the plan names it."""
  loss_fn, params, batch = scan_models.linen_case(shared=True)
  traced = partition.trace(loss_fn, params, batch)
  assert "blocks" in traced.node_names
  assert not any("[" in n for n in traced.node_names)
  plan = _plan(traced, params, batch, 4)
  note = plan.indivisible_note
  share = plan.stage_seconds[plan.stage_of["blocks"]] / (
    plan.sequential_seconds / 4
  )
  assert share > INDIVISIBLE_FACTOR
  assert note is not None and "'blocks'" in note and f"{share:.1f}x" in note
  assert "\n" not in note


BODIES = {
  "moe soft": dict(moe="soft"),
  "moe top1 + dot_product_attention": dict(moe="top1", fused=True),
  "checkpoint policy": dict(policy=scan_models.POLICY),
}


def _checkpoints(jaxpr):
  """The checkpoint (remat) equations anywhere in ``jaxpr``, with the
  scans they sit in: [(policy, inside a scan)]."""
  found = []

  def walk(jaxpr, in_scan):
    for e in jaxpr.eqns:
      if e.primitive.name in ("checkpoint", "remat2"):  # (jax's name)
        found.append((e.params["policy"], in_scan))
      for sub in jax.extend.core.jaxprs_in_params(e.params):
        walk(sub, in_scan or e.primitive.name == "scan")

  walk(jaxpr.jaxpr if hasattr(jaxpr, "jaxpr") else jaxpr, False)
  return found


@pytest.mark.parametrize(
  "body",
  [
    tiers.slow("moe soft", id="moe soft"),
    "moe top1 + dot_product_attention",
    "checkpoint policy",
  ],
)
def test_scan_bodies_split_per_layer(body):
  """Experts under a router, fused attention, a checkpoint policy in the
  body: one node per layer, 4 balanced stages, each stage's gradients
  the model's; the policy stays on the body of every stage's scan."""
  loss_fn, params, batch = scan_models.body_case(**BODIES[body])
  traced = partition.trace(loss_fn, params, batch)
  layers = [f"scan[{k}]" for k in range(scan_models.LAYERS)]
  assert [n for n in traced.node_names if n in layers] == layers
  plan = _plan(traced, params, batch, 4)
  seconds = np.asarray(plan.stage_seconds)
  assert seconds.max() / seconds.mean() <= INDIVISIBLE_FACTOR
  stages = partition.Stages(traced, plan.stage_of_node)
  want_loss, want_grads = jitted.value_and_grad(loss_fn)(params, batch)
  loss, grads = stages.run_forward_backward(params, batch, recompute=False)
  np.testing.assert_allclose(loss, want_loss, rtol=1e-5)
  for a, b in zip(
    jax.tree.leaves(grads), jax.tree.leaves(want_grads), strict=True
  ):
    np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)
  if "policy" not in BODIES[body]:
    return
  stage_params = stages.split_params(params)
  stage_batch = stages.split_batch(batch)
  acts = _stage_inputs(stages, stage_params, stage_batch)
  for s in range(4):
    jaxpr = jax.make_jaxpr(lambda p, b, a, s=s: stages.forward(s, p, b, a))(
      stage_params[s], stage_batch[s], acts[s]
    )
    assert _checkpoints(jaxpr) == [(scan_models.POLICY, True)]
