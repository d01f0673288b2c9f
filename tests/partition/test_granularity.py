"""Automatic granularity: models that are 1-3 nodes at depth 1 split into
2, 4 and 8 stages with no depth argument, and train as one device does."""

import itertools
import warnings

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jpipe
from jpipe import partition
from tests import jitted
from tests.partition import flax_models
from tests.tiers import slow


def _brute_force(costs, num_stages):
  """min over every contiguous split into exactly num_stages runs."""
  n, best = len(costs), np.inf
  for cuts in itertools.combinations(range(1, n), num_stages - 1):
    bounds = (0, *cuts, n)
    best = min(
      best, max(sum(costs[a:b]) for a, b in itertools.pairwise(bounds))
    )
  return best


def test_min_max_split_is_the_exact_optimum():
  rng = np.random.default_rng(0)
  for _ in range(40):
    n = int(rng.integers(1, 9))
    stages = int(rng.integers(1, n + 1))
    costs = rng.uniform(0.0, 10.0, n)
    found = partition.min_max_split(costs, stages)
    assert found == pytest.approx(_brute_force(costs, stages), rel=1e-9)
    # Property: no split beats an even share or the largest node.
    assert found >= max(costs.max(), costs.sum() / stages) * (1 - 1e-9)
  assert partition.min_max_split([1.0, 2.0], 3) == np.inf


CASES = {
  "methods_encoder_decoder": flax_models.methods_encoder_decoder_case,
  "stack_in_submodule": flax_models.stack_in_submodule_case,
  "nnx_list": flax_models.nnx_case,
}


# (An nnx.List's items are depth 1 already: test_stages.)
@pytest.mark.parametrize("name", sorted(set(CASES) - {"nnx_list"}))
def test_depth_one_is_too_coarse_and_auto_goes_deeper(name):
  loss_fn, params, batch, _ = CASES[name]()
  traced = partition.trace(loss_fn, params, batch)
  assert traced.num_nodes < 4  # What a new user hit at the default.
  cut, granularity = partition.choose_depth(traced, 8)
  assert cut.num_nodes >= 8 and granularity.depth > 1
  assert granularity.balance[1] == np.inf
  assert f"depth {granularity.depth} ({cut.num_nodes} nodes)" in (
    granularity.reason
  )
  # Explicit depths still work, and regrouping equals tracing at it.
  again = partition.trace(loss_fn, params, batch, depth=granularity.depth)
  assert again.node_names == cut.node_names
  assert again.eqn_node == cut.eqn_node


@pytest.mark.parametrize(
  "name",
  [slow(n) if n == "methods_encoder_decoder" else n for n in sorted(CASES)],
)
@pytest.mark.parametrize("num_stages", [2, slow(4), slow(8)])
def test_splits_with_no_depth_and_trains_as_one_device(name, num_stages):
  loss_fn, params, batch, _ = CASES[name]()
  lr = 0.1
  pipe = jpipe.Pipeline(
    loss_fn,
    params,
    batch,
    num_stages=num_stages,
    devices=jax.devices()[:num_stages],
    schedule="1f1b",
    num_microbatches=2,
    optimizer=optax.sgd(lr),
  )
  assert pipe.plan.num_stages == num_stages
  assert pipe.granularity.depth == pipe.traced.depth
  if num_stages >= 4 and name != "nnx_list":  # Depth 1: too few nodes.
    assert pipe.traced.depth > 1
  state, metrics = pipe.step(pipe.init(params), batch)
  # The reference: the mean of the two microbatches' gradients, one step.
  halves = [
    jax.tree.map(lambda x, i=i: x[i * 4 : (i + 1) * 4], batch) for i in (0, 1)
  ]
  losses, grads = zip(
    *(jitted.value_and_grad(loss_fn)(params, h) for h in halves), strict=True
  )
  expected = jax.tree.map(lambda p, a, b: p - lr * (a + b) / 2, params, *grads)
  assert float(metrics["loss"]) == pytest.approx(np.mean(losses), rel=1e-5)
  for got, want in zip(
    jax.tree.leaves(pipe.gather_params(state)),
    jax.tree.leaves(expected),
    strict=True,
  ):
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


def test_stages_without_params_are_warned_about():
  """Two residual blocks of one Dense each cut into 4 stages: two stages
  hold only a residual add (they train nothing); the warning names them
  and points at the user's line. Two stages: one block each, no warning."""

  class Block(nn.Module):
    @nn.compact
    def __call__(self, x):
      return x + nn.Dense(4)(x)

  class Model(nn.Module):
    @nn.compact
    def __call__(self, x):
      return Block()(Block()(x))

  model, x = Model(), jnp.ones((4, 4))
  params = model.init(jax.random.key(0), x)

  def build(stages):
    return jpipe.Pipeline(
      lambda p, b: model.apply(p, b["x"]).sum(),
      params,
      {"x": x},
      num_stages=stages,
      devices=jax.devices()[:stages],
      optimizer=optax.sgd(0.1),
    )

  with pytest.warns(UserWarning, match=r"stage\(s\) \[1, 3\] of 4 hold no"):
    pipe = build(4)
  assert [len(s.param_leaves) for s in pipe.stages.specs] == [2, 0, 2, 0]
  with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    build(2)
  assert not [w for w in caught if "hold no params" in str(w.message)]
