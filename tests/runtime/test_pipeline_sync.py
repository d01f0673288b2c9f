"""Synchronous schedules = single-device gradient accumulation."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jpipe
from tests import jitted
from tests.partition import flax_models
from tests.tiers import slow


def _microbatch(batch, k, m):
  """Microbatch k of m of ``batch`` (its leading axis cut evenly)."""
  size = jax.tree.leaves(batch)[0].shape[0]
  return jax.tree.map(lambda x: x[k * size // m : (k + 1) * size // m], batch)


def _reference_steps(loss_fn, params, batch, m, tx, steps=1):
  """Single device: mean of m microbatch gradients, then an optax step."""
  opt_state = tx.init(params)
  grad_fn = jax.jit(jax.value_and_grad(loss_fn))  # (Traced once.)
  for _ in range(steps):
    grads, losses = None, []
    for k in range(m):
      mb = _microbatch(batch, k, m)
      loss, g = grad_fn(params, mb)
      losses.append(loss)
      grads = g if grads is None else jax.tree.map(jnp.add, grads, g)
    grads = jax.tree.map(lambda g: g / m, grads)
    updates, opt_state = tx.update(grads, opt_state, params)
    params = optax.apply_updates(params, updates)
  return params, float(np.mean(losses))


def _assert_tree_close(a, b):
  for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
    np.testing.assert_allclose(x, y, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "seq", "zbh1"])
@pytest.mark.parametrize(
  "case", ["mlp", slow("gpt_tied"), slow("encoder_decoder")]
)
def test_one_step_equals_single_device(case, schedule):
  loss_fn, params, batch, _ = flax_models.CASES[case]()
  tx = optax.sgd(0.1, momentum=0.9)
  pipe = jpipe.Pipeline(
    loss_fn,
    params,
    batch,
    num_stages=4,
    devices=jax.devices()[:4],
    schedule=schedule,
    num_microbatches=4,
    optimizer=tx,
  )
  state = pipe.init(params)
  assert len({d for d in pipe.stage_device}) == 4
  state, metrics = pipe.step(state, batch)
  expected, expected_loss = _reference_steps(loss_fn, params, batch, 4, tx)
  _assert_tree_close(pipe.gather_params(state), expected)
  assert float(metrics["loss"]) == pytest.approx(expected_loss, rel=1e-5)


@pytest.mark.slow
def test_mixed_plan_several_stages_per_device_and_no_recompute():
  loss_fn, params, batch, _ = flax_models.encoder_decoder_case()
  tx = optax.adam(1e-2)
  pipe = jpipe.Pipeline(
    loss_fn,
    params,
    batch,
    num_stages=3,
    devices=jax.devices()[:3],
    schedule="gpipe",
    num_microbatches=2,
    optimizer=tx,
    partition="mixed",
    recompute=False,
  )
  state = pipe.init(params)
  for _ in range(2):
    state, _ = pipe.step(state, batch)
  expected, _ = _reference_steps(loss_fn, params, batch, 2, tx, steps=2)
  _assert_tree_close(pipe.gather_params(state), expected)


@pytest.mark.slow
def test_acyclic_plan_trains_as_one_device():
  """FTPipe's acyclic partition: stages that are not runs of the program
  order (the narrow tower's first layer on stage 1, the wide tower's
  second on stage 0) train to the single-device result."""
  loss_fn, params, batch, _ = flax_models.two_towers_case()
  tx = optax.sgd(0.1, momentum=0.9)
  pipe = jpipe.Pipeline(
    loss_fn,
    params,
    batch,
    num_stages=2,
    devices=jax.devices()[:2],
    schedule="1f1b",
    num_microbatches=2,
    optimizer=tx,
    partition="acyclic",
    depth=2,
  )
  of = pipe.plan.stage_of
  assert of["b0"] == 1 and of["a1"] == 0
  state = pipe.init(params)
  for _ in range(3):
    state, metrics = pipe.step(state, batch)
  expected, loss = _reference_steps(loss_fn, params, batch, 2, tx, steps=3)
  for x, y in zip(
    jax.tree.leaves(pipe.gather_params(state)),
    jax.tree.leaves(expected),
    strict=True,
  ):
    np.testing.assert_allclose(x, y, rtol=0, atol=1e-6)
  assert float(metrics["loss"]) == pytest.approx(loss, rel=1e-5)


@pytest.mark.slow
def test_tied_replicas_stay_equal():
  loss_fn, params, batch, _ = flax_models.gpt_case()
  pipe = jpipe.Pipeline(
    loss_fn,
    params,
    batch,
    num_stages=2,
    devices=jax.devices()[:2],
    schedule="1f1b",
    num_microbatches=2,
    optimizer=optax.adam(1e-2),
  )
  state = pipe.init(params)
  for _ in range(3):
    state, _ = pipe.step(state, batch)
  shared = list(pipe.tied.shared)
  assert shared
  for leaf in shared:
    copies = [
      np.asarray(state.stage_params[s][pos])
      for s, pos in pipe.tied.shared[leaf]
    ]
    np.testing.assert_array_equal(copies[0], copies[1])


def test_bad_input():
  loss_fn, params, batch, _ = flax_models.mlp_case()
  tx = optax.sgd(0.1)
  with pytest.raises(ValueError, match="3 microbatches do not divide"):
    jpipe.Pipeline(
      loss_fn, params, batch, num_stages=2, num_microbatches=3, optimizer=tx
    )
  with pytest.raises(ValueError, match="unknown schedule 'zb'"):
    jpipe.Pipeline(
      loss_fn, params, batch, num_stages=2, schedule="zb", optimizer=tx
    )
  with pytest.raises(ValueError, match="4 stages need 4 devices, got 2"):
    jpipe.Pipeline(
      loss_fn,
      params,
      batch,
      num_stages=4,
      devices=jax.devices()[:2],
      optimizer=tx,
    )


@pytest.mark.parametrize("schedule", ["1f1b", "zbh1"])
@pytest.mark.parametrize("recompute", [True, False])
def test_no_recompilation_across_microbatches_and_steps(recompute, schedule):
  """Saved residuals (and what a split backward's W keeps) cross jit as
  arrays only: one trace per function."""
  loss_fn, params, batch, _ = flax_models.mlp_case()
  pipe = jpipe.Pipeline(
    loss_fn,
    params,
    batch,
    num_stages=2,
    devices=jax.devices()[:2],
    schedule=schedule,
    num_microbatches=4,
    optimizer=optax.sgd(0.1),
    recompute=recompute,
  )
  state = pipe.init(params)
  for _ in range(2):
    state, _ = pipe.step(state, batch)
  jitted = list(pipe.stages._jitted.values()) + list(
    pipe.programs._cache.values()
  )
  assert jitted
  assert all(f._cache_size() == 1 for f in jitted)


@pytest.mark.parametrize(
  "schedule, stages, devices",
  [
    ("gpipe", 3, 3),
    ("1f1b", 3, 3),
    ("zbh1", 3, 3),
    ("zbv", 4, 2),
    slow("zbh2", 3, 3),
    slow("interleaved_zb", 4, 2),
  ],
)
def test_batchnorm_state_flows_like_one_device(schedule, stages, devices):
  """Each microbatch's forward reads the statistics the previous one left
  (zbv: over a V, two stages per device; interleaved_zb: in a loop,
  stage s on device s mod 2); gradients and the final statistics equal a
  single-device loop."""
  loss_fn, params, stats, batch = flax_models.resnet_state_case(3, 8)
  m, tx = 4, optax.sgd(0.1)
  kwargs = dict(
    num_stages=stages,
    schedule=schedule,
    num_microbatches=m,
    optimizer=tx,
    model_state=stats,
  )
  pipe = jpipe.Pipeline(
    loss_fn, params, batch, devices=jax.devices()[:devices], **kwargs
  )
  if schedule == "interleaved_zb":  # The loop: 4 stages on 2 devices.
    assert pipe.plan.stage_devices == ((0,), (1,), (0,), (1,))
  state = pipe.init(params, stats)
  state, metrics = pipe.step(state, batch)
  grads, ref_stats, losses = None, stats, []
  for k in range(m):
    mb = jax.tree.map(lambda x, k=k: x[2 * k : 2 * k + 2], batch)
    (loss, ref_stats), g = jitted.value_and_grad(loss_fn, has_aux=True)(
      params, ref_stats, mb
    )
    losses.append(loss)
    grads = g if grads is None else jax.tree.map(jnp.add, grads, g)
  grads = jax.tree.map(lambda g: g / m, grads)
  updates, _ = tx.update(grads, tx.init(params), params)
  _assert_tree_close(
    pipe.gather_params(state), optax.apply_updates(params, updates)
  )
  _assert_tree_close(pipe.gather_model_state(state), ref_stats)
  assert float(metrics["loss"]) == pytest.approx(np.mean(losses), rel=1e-5)
  saved = pipe.state_dict(state)
  again = pipe.load_state_dict(saved)
  _assert_tree_close(pipe.gather_model_state(again), ref_stats)
  with pytest.raises(ValueError, match="pass model_state to init"):
    pipe.init(params)


def test_default_hooks_change_nothing():
  """The driver skips the default ``reduce_gradient`` and ``after_step``
  (no call at all, for speed): sound only while they return what they
  are given, unchanged."""
  hooks = jpipe.runtime.DriverHooks()
  grads, params = (np.ones(2),), (np.zeros(3), np.ones(1))
  assert hooks.reduce_gradient(0, grads) is grads
  assert hooks.after_step(1, params) is params
  assert hooks.before_compute(None) is None


class _Counting(jpipe.runtime.DriverHooks):
  """Counts what a driver calls; halves the gradient of stage 0."""

  def __init__(self):
    self.computes, self.reduced, self.stepped = [], [], []

  def before_compute(self, action, inputs=()):
    self.computes.append((action.kind, action.stage))

  def reduce_gradient(self, stage, grads):
    self.reduced.append(stage)
    return jax.tree.map(lambda g: g * 0.5, grads) if stage == 0 else grads

  def after_step(self, stage, params):
    self.stepped.append(stage)
    return params


@pytest.mark.slow
def test_hooks_argument_sees_every_action_and_changes_gradients():
  """``Pipeline(hooks=...)``: called before each forward and backward,
  on each stage's gradient before its step (what it returns is applied)
  and after each step."""
  loss_fn, params, batch, _ = flax_models.CASES["mlp"]()
  hooks = _Counting()

  def build(**options):
    return jpipe.Pipeline(
      loss_fn,
      params,
      batch,
      num_stages=2,
      devices=jax.devices()[:2],
      schedule="gpipe",
      num_microbatches=4,
      optimizer=optax.sgd(0.1),
      **options,
    )

  pipe = build(hooks=hooks, fuse_last_stage=False)
  state = pipe.init(params)
  state, _ = pipe.step(state, batch)
  assert sorted(hooks.computes) == sorted(
    (kind, s) for kind in "FB" for s in (0, 1) for _ in range(4)
  )
  assert sorted(hooks.reduced) == [0, 1] and sorted(hooks.stepped) == [0, 1]
  # Stage 0 stepped with half its gradient: half its plain update.
  plain = build(partition=pipe.plan)
  plain_state, _ = plain.step(plain.init(params), batch)
  for got, want, start in zip(
    state.stage_params[0],
    plain_state.stage_params[0],
    pipe.init(params).stage_params[0],
    strict=True,
  ):
    np.testing.assert_allclose(
      np.asarray(got) - np.asarray(start),
      0.5 * (np.asarray(want) - np.asarray(start)),
      rtol=1e-5,
      atol=1e-7,
    )
