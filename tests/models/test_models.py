"""jpipe.models: shapes, and each model split into stages = unsplit."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from jpipe import partition
from jpipe.models import gpt, mlp, resnet, t5, vgg
from tests import jitted
from tests.tiers import slow


def _classifier(model, x, labels, stats=False):
  variables = model.init(jax.random.key(0), x, train=False)
  params = variables["params"]

  def loss_fn(params, batch):
    if stats:
      logits, updates = model.apply(
        {"params": params, "batch_stats": batch["stats"]},
        batch["x"],
        mutable=["batch_stats"],
      )
    else:
      logits, updates = model.apply({"params": params}, batch["x"]), None
    loss = optax.softmax_cross_entropy_with_integer_labels(
      logits, batch["y"]
    ).mean()
    return (loss, updates["batch_stats"]) if stats else loss

  batch = {"x": x, "y": labels}
  if stats:
    batch["stats"] = variables["batch_stats"]
  return loss_fn, params, batch, stats


def _lm(model, *inputs):
  params = model.init(jax.random.key(0), *inputs, train=False)["params"]

  def loss_fn(params, batch):
    logits = model.apply({"params": params}, *batch["inputs"])
    return optax.softmax_cross_entropy_with_integer_labels(
      logits, batch["labels"]
    ).mean()

  labels = inputs[-1]
  return loss_fn, params, {"inputs": inputs, "labels": labels}, False


def _cases():
  rng = np.random.default_rng(0)
  images = jnp.asarray(rng.normal(size=(2, 16, 16, 3)), jnp.float32)
  labels = jnp.asarray([1, 7])
  tokens = jnp.asarray(rng.integers(1, 256, size=(2, 12)), jnp.int32)
  return {
    "mlp": lambda: _classifier(
      mlp.Model(hidden=(32, 32, 32)), images.reshape(2, -1), labels
    ),
    "wrn": lambda: _classifier(
      resnet.Model(depth=10, width=1), images, labels, stats=True
    ),
    "vgg": lambda: _classifier(
      vgg.Model(config=(8, "M", 16, 16, "M"), hidden=32), images, labels
    ),
    "gpt": lambda: _lm(
      gpt.Model(num_layers=2, width=32, max_length=16), tokens
    ),
    "t5": lambda: _lm(t5.Model(num_layers=2, width=32), tokens, tokens[:, :10]),
  }


@pytest.mark.parametrize(
  "name",
  [n if n in ("mlp", "vgg") else slow(n) for n in sorted(_cases())],
)
def test_three_stage_split_equals_value_and_grad(name):
  loss_fn, params, batch, has_aux = _cases()[name]()
  traced = partition.trace(loss_fn, params, batch, has_aux=has_aux)
  assert traced.num_nodes >= 3, traced.node_names
  costs = partition.profile_nodes(traced, params, batch, method="analytic")
  plan = partition.plan_traced(traced, costs, 3)
  stages = partition.Stages(traced, plan.stage_of_node)
  out, grads = stages.run_forward_backward(params, batch)
  ref_out, ref_grads = jitted.value_and_grad(loss_fn, has_aux=has_aux)(
    params, batch
  )
  for a, b in zip(
    jax.tree.leaves((out, grads)),
    jax.tree.leaves((ref_out, ref_grads)),
    strict=True,
  ):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


def test_wrn_rejects_bad_depth():
  with pytest.raises(ValueError, match="6n \\+ 4"):
    resnet.Model(depth=11).init(jax.random.key(0), jnp.ones((1, 8, 8, 3)))


@pytest.mark.slow
def test_gpt_bfloat16_compute_keeps_float32_params_and_logits():
  tokens = jax.random.randint(jax.random.key(0), (2, 16), 0, 256)
  full = gpt.Model(width=64, num_layers=2, num_heads=2)
  mixed = gpt.Model(width=64, num_layers=2, num_heads=2, dtype=jnp.bfloat16)
  params = full.init(jax.random.key(1), tokens)
  # The same params serve both: the dtype changes the compute only.
  assert jax.tree.structure(mixed.init(jax.random.key(1), tokens)) == (
    jax.tree.structure(params)
  )
  assert {x.dtype for x in jax.tree.leaves(params)} == {jnp.dtype("float32")}
  logits = mixed.apply(params, tokens)
  assert logits.dtype == jnp.float32
  # Its matmuls run in bfloat16 (the attention scores accumulate in
  # float32 for the softmax, as jax.nn.dot_product_attention makes them:
  # one such product per layer) ...
  jaxpr = jax.make_jaxpr(mixed.apply)(params, tokens)
  dots = [e for e in jaxpr.eqns if e.primitive.name == "dot_general"]
  assert dots and all(
    v.aval.dtype == jnp.bfloat16 for e in dots for v in e.invars
  )
  wide = [e for e in dots if e.outvars[0].aval.dtype != jnp.bfloat16]
  assert len(wide) == 2 and all(
    e.params["preferred_element_type"] == jnp.float32 for e in wide
  )
  # ... and agree with float32 to bfloat16's precision.
  np.testing.assert_allclose(logits, full.apply(params, tokens), atol=0.1)
