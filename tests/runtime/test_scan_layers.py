"""Pipelines of models whose layers run under a scan: each stage holds its
rows of the stacked params, and what leaves the pipeline is stacked."""

import jax
import numpy as np
import optax
import pytest

import jpipe
from tests import jitted, tiers
from tests.partition import scan_models
from tests.partition.scan_models import LAYERS, D

SGD = optax.sgd(0.1)


def _close(a, b, rtol=2e-5, atol=1e-6):
  la, lb = jax.tree.leaves(a), jax.tree.leaves(b)
  assert jax.tree.structure(a) == jax.tree.structure(b)
  for x, y in zip(la, lb, strict=True):
    assert np.shape(x) == np.shape(y)
    np.testing.assert_allclose(x, y, rtol=rtol, atol=atol)


def _pipe(case, num_stages, **options):
  loss_fn, params, batch = case
  pipe = jpipe.Pipeline(
    loss_fn,
    params,
    batch,
    num_stages=num_stages,
    devices=jax.devices()[:num_stages],
    num_microbatches=2,
    **options,
  )
  return pipe, params, batch


@pytest.mark.parametrize(
  "make",
  [
    scan_models.plain_case,
    tiers.slow(  # (nn.scan(nn.remat) splits in tests/partition too.)
      lambda: scan_models.linen_case(remat=True), id="nn.scan(nn.remat)"
    ),
    pytest.param(scan_models.nnx_case, id="nnx.scan"),
  ],
)
def test_1f1b_step_equals_the_single_device_step(make):
  loss_fn, params, batch = make()
  pipe, _, _ = _pipe(
    (loss_fn, params, batch), 4, schedule="1f1b", optimizer=SGD
  )
  layer_stages = {s for n, s in pipe.plan.stage_of.items() if "[" in n}
  assert len(layer_stages) == 4  # The layers spread over every stage.
  state, _ = pipe.step(pipe.init(params), batch)
  grads = jitted.grad(loss_fn)(params, batch)
  want = jax.tree.map(lambda p, g: p - 0.1 * g, params, grads)
  _close(pipe.gather_params(state), want)  # Stacked, as the model declares.


@pytest.mark.parametrize(
  "options",
  [
    pytest.param(
      dict(optimizer=optax.sgd(0.1, momentum=0.9), prediction="msnag"),
      id="ws+wp",
    ),
    tiers.slow(
      dict(
        optimizer=optax.sgd(0.1),
        gap_aware="ga",
        gap_aware_options={"optimizer": "sgd", "learning_rate": 0.1},
      ),
      id="ws+gap_aware",
    ),
  ],
)
def test_async_equals_the_unrolled_model(options):
  """Asynchronous with weight stashing and prediction or Gap-Aware (SGD:
  Adam's normalisation would magnify summation-order noise in its tiny
  gradients): the scanned model's pipeline gives the unrolled model's,
  step for step (same split, per-layer leaves both)."""
  options = dict(options, schedule="async", weight_stashing=True)
  scanned, params, batch = _pipe(
    scan_models.plain_case(batch_size=4), 4, **options
  )
  loss_fn, uparams, _ = scan_models.unrolled_case()
  unrolled = jpipe.Pipeline(
    loss_fn,
    uparams,
    batch,
    partition=scanned.plan,
    num_stages=4,
    devices=jax.devices()[:4],
    num_microbatches=2,
    **options,
  )
  a, b = scanned.init(params), unrolled.init(uparams)
  for _ in range(3):
    a, ma = scanned.step(a, batch)
    b, mb = unrolled.step(b, batch)
    np.testing.assert_allclose(ma["loss"], mb["loss"], rtol=1e-5)
  a, _ = scanned.flush(a)
  b, _ = unrolled.flush(b)
  _close(
    scanned.gather_params(a),
    scan_models.stack_unrolled(unrolled.gather_params(b)),
    rtol=1e-4,
  )


def test_state_dict_is_stacked_and_resumes_under_another_split():
  case = scan_models.plain_case()
  four, params, batch = _pipe(
    case, 4, schedule="1f1b", optimizer=optax.adam(1e-2)
  )
  state, _ = four.step(four.init(params), batch)
  saved = four.state_dict(state)
  mu = saved["opt_state"][0].mu
  assert np.shape(mu["layers/w1"]) == params["layers"]["w1"].shape
  assert not any("[" in k for k in mu)
  # A per-process checkpoint's parts (one process: all of it) alike.
  _close(four.local_state_dict(state), saved)
  layout, needed = four.state_dict_layout()
  _close(
    jax.tree.map(lambda x: np.zeros(x.shape), layout["params"]),
    jax.tree.map(np.zeros_like, params),
  )
  assert all(jax.tree.leaves(needed["params"]))
  # A metrics function cut by the plan reads the stages' rows.
  loss_fn = case[0]
  metrics = four.evaluate(state, batch, lambda p, b: {"loss": loss_fn(p, b)})
  np.testing.assert_allclose(
    metrics["loss"] / 2, loss_fn(saved["params"], batch), rtol=1e-5
  )
  two, _, _ = _pipe(case, 2, schedule="1f1b", optimizer=optax.adam(1e-2))
  resumed = two.load_state_dict(saved)
  _close(two.gather_params(resumed), saved["params"])
  a, _ = four.step(state, batch)
  b, _ = two.step(resumed, batch)
  _close(four.gather_params(a), two.gather_params(b), rtol=1e-5)
  _close(four.state_dict(a)["opt_state"], two.state_dict(b)["opt_state"])


def _one_step_equals_one_device(case, num_stages, atol=1e-6):
  """One 1F1B step of ``case`` through ``num_stages`` stages (every stage
  holding layers, balanced in the plan) equals the single-device SGD step."""
  loss_fn, params, batch = case
  pipe, _, _ = _pipe(case, num_stages, schedule="1f1b", optimizer=SGD)
  layer_stages = {s for n, s in pipe.plan.stage_of.items() if "[" in n}
  assert len(layer_stages) == num_stages
  seconds = np.asarray(pipe.plan.stage_seconds)
  assert seconds.max() / seconds.mean() <= 1.3
  state, _ = pipe.step(pipe.init(params), batch)
  grads = jitted.grad(loss_fn)(params, batch)
  want = jax.tree.map(lambda p, g: p - 0.1 * g, params, grads)
  _close(pipe.gather_params(state), want, atol=atol)


@pytest.mark.parametrize(
  "body",
  [
    tiers.slow(dict(moe="top1", fused=True), id="moe top1 + fused"),
    tiers.slow(dict(moe="soft"), id="moe soft"),
    tiers.slow(dict(policy=scan_models.POLICY), id="checkpoint policy"),
  ],
)
def test_scan_bodies_step_equals_the_single_device_step(body):
  """Stacked experts under a router, jax.nn.dot_product_attention and a
  jax.checkpoint policy in the scan body: 4 stages, one step exact.
  (Slow tier: the default tier's tests/partition/test_scan_layers.py
  checks the same bodies' stages against jax.grad.)"""
  _one_step_equals_one_device(scan_models.body_case(**body), 4)


@pytest.mark.parametrize(
  "make",
  [
    pytest.param(scan_models.plain_case, id="lax.scan"),
    tiers.slow(
      lambda: scan_models.body_case(moe="soft", fused=True),
      id="moe + fused",
    ),
  ],
)
def test_eight_blocks_into_eight_stages(make):
  """8 scanned blocks, 8 stages: one block each, the plan's slowest stage
  within 1.3x of the mean, one step equal to one device's. (The plain
  model's gradients reach 300: float32's own error in them, against
  float64, is 1.2e-3, so 1e-4 after the 0.1 step.)"""
  _one_step_equals_one_device(make(), 8, atol=1e-4)


@pytest.mark.parametrize(
  "options, num_stages, block, mu_shape",
  [
    # (Dense_0: [2D, D] per layer.)
    (dict(scan_axis=1), 2, (), (2 * D, LAYERS, D)),
    # More stages than the outer scan's 2 rows. (CI time: the default
    # tier splits nn.remat_scan in test_nested_scans and reads rows of
    # merged axes in test_process_arrays.)
    tiers.slow(dict(remat_scan=(2, 4)), 3, ("Block_0",), (2, 4, 2 * D, D)),
  ],
  ids=["axis 1", "nn.remat_scan"],
)
def test_stacked_layouts_train_save_and_load_in_their_layout(
  options, num_stages, block, mu_shape
):
  """``nn.scan(variable_axes={"params": 1})`` (MaxText's and flaxformer's
  default) and ``nn.remat_scan`` (a scan in a scan, params ``[2, 4,
  ...]``) split per layer too: an AdamW step equals one device's, params
  and moments, each in the model's own layout, and the state dict loads
  back."""
  case = scan_models.linen_case(attention_bias=False, **options)
  loss_fn, params, batch = case
  tx = optax.adamw(1e-2, weight_decay=0.1)
  pipe, _, _ = _pipe(case, num_stages, schedule="1f1b", optimizer=tx)
  layer_stages = {s for n, s in pipe.plan.stage_of.items() if "[" in n}
  assert layer_stages == set(range(num_stages))
  state, _ = pipe.step(pipe.init(params), batch)
  grads = jitted.grad(loss_fn)(params, batch)
  updates, opt = tx.update(grads, tx.init(params), params)
  _close(pipe.gather_params(state), optax.apply_updates(params, updates))
  saved = pipe.state_dict(state)
  path = "/".join(("params/blocks", *block, "Dense_0/kernel"))
  mu = saved["opt_state"][0].mu[path]
  assert np.shape(mu) == mu_shape
  want = opt[0].mu["params"]["blocks"]
  for key in block:
    want = want[key]
  _close(mu, want["Dense_0"]["kernel"])
  _close(pipe.local_state_dict(state), saved)
  _close(pipe.state_dict(pipe.load_state_dict(saved)), saved)
