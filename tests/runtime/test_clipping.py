"""Global-norm gradient clipping over all stages = optax's on one device."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jpipe
from tests import jitted
from tests.partition import flax_models
from tests.runtime.test_pipeline_sync import _microbatch, _reference_steps
from tests.runtime.test_replicated_stages import LAYOUTS, _replicated
from tests.tiers import slow


def _mean_grad_norm(loss_fn, params, batch, m):
  """The global norm of the first step's gradient (the microbatches'
  mean), by plain JAX."""
  grads = [
    jitted.grad(loss_fn)(params, _microbatch(batch, k, m)) for k in range(m)
  ]
  mean = jax.tree.map(lambda *g: sum(g) / m, *grads)
  leaves = jax.tree.leaves(mean)
  return float(np.sqrt(sum(np.sum(np.square(x)) for x in leaves)))


def _assert_close(a, b):
  for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
    np.testing.assert_allclose(x, y, rtol=1e-6, atol=1e-6)


# schedule, stages, devices, microbatches (every synchronous schedule; the
# V ones hold two stages per device).
SYNCHRONOUS = {
  "seq": ("seq", 3, 3, 4),
  "gpipe": ("gpipe", 3, 3, 4),
  "1f1b": ("1f1b", 3, 3, 4),
  "eager1f1b": ("eager1f1b", 3, 3, 4),
  "interleaved": ("interleaved", 4, 2, 4),  # (mixed: 2 stages a device)
  "looped_bfs": ("looped_bfs", 4, 2, 4),
  "zbh1": ("zbh1", 3, 3, 4),
  "zbh2": ("zbh2", 3, 3, 4),
  "zbv": ("zbv", 4, 2, 4),
  "dualpipev": ("dualpipev", 4, 2, 4),
}


# The tied embedding (its gradient counted once) on the placements that
# hold it differently: one stage a device (1f1b), two stages a device
# (interleaved), and the V's, where the embedding's owner and holder
# share a device (zbv, its backward split; dualpipev).
TIED = ("1f1b", "interleaved", "zbv", "dualpipev")


@pytest.mark.parametrize(
  "name, case",
  [(name, "mlp") for name in SYNCHRONOUS]
  + [slow(name, "gpt_tied", id=f"{name}-gpt_tied") for name in TIED],
)
def test_clipped_steps_equal_optax_clipping_on_one_device(name, case):
  """Two clipped steps (the clip at half the first gradient's norm, so it
  acts) equal ``optax.chain(clip_by_global_norm, adam)`` on one device;
  the tied embedding's gradient counts once."""
  schedule, stages, devices, m = SYNCHRONOUS[name]
  loss_fn, params, batch, _ = flax_models.CASES[case]()
  clip = 0.5 * _mean_grad_norm(loss_fn, params, batch, m)
  tx = optax.adam(1e-2)
  pipe = jpipe.Pipeline(
    loss_fn,
    params,
    batch,
    num_stages=stages,
    devices=jax.devices()[:devices],
    schedule=schedule,
    num_microbatches=m,
    optimizer=tx,
    clip_global_norm=clip,
    partition="mixed"
    if name in ("interleaved", "looped_bfs")
    else "contiguous",
  )
  state = pipe.init(params)
  for _ in range(2):
    state, _ = pipe.step(state, batch)
  reference = optax.chain(optax.clip_by_global_norm(clip), tx)
  expected, _ = _reference_steps(loss_fn, params, batch, m, reference, 2)
  _assert_close(pipe.gather_params(state), expected)


@pytest.mark.parametrize("layout", ["mixed", slow("disjoint")])
def test_clipping_on_replicated_and_mixed_placements(layout):
  """Stages on replica groups (data parallel inside the pipeline) and a
  group holding two stages: the same clipped steps."""
  loss_fn, params, batch, _ = flax_models.CASES["gpt_tied"]()
  clip = 0.5 * _mean_grad_norm(loss_fn, params, batch, 2)
  tx = optax.sgd(0.1, momentum=0.9)
  pipe = _replicated(
    LAYOUTS[layout],
    loss_fn,
    params,
    batch,
    num_microbatches=2,
    optimizer=tx,
    schedule="1f1b",
    clip_global_norm=clip,
  )
  state = pipe.init(params)
  for _ in range(2):
    state, _ = pipe.step(state, batch)
  reference = optax.chain(optax.clip_by_global_norm(clip), tx)
  expected, _ = _reference_steps(loss_fn, params, batch, 2, reference, 2)
  _assert_close(pipe.gather_params(state), expected)


def test_a_clipped_sgd_step_moves_the_params_by_lr_times_the_clip():
  """The property: with plain SGD, a clipped step's update has norm
  exactly lr * clip; a clip above the norm changes nothing."""
  loss_fn, params, batch, _ = flax_models.CASES["mlp"]()
  norm = _mean_grad_norm(loss_fn, params, batch, 2)
  moved = {}
  for clip in (0.25 * norm, 4.0 * norm, None):
    pipe = jpipe.Pipeline(
      loss_fn,
      params,
      batch,
      num_stages=2,
      devices=jax.devices()[:2],
      num_microbatches=2,
      optimizer=optax.sgd(0.5),
      clip_global_norm=clip,
    )
    state, _ = pipe.step(pipe.init(params), batch)
    after = pipe.gather_params(state)
    moved[clip] = float(
      jnp.sqrt(
        sum(
          jnp.sum(jnp.square(a - b))
          for a, b in zip(
            jax.tree.leaves(after), jax.tree.leaves(params), strict=True
          )
        )
      )
    )
  assert moved[0.25 * norm] == pytest.approx(0.5 * 0.25 * norm, rel=1e-5)
  assert moved[4.0 * norm] == pytest.approx(moved[None], rel=1e-6)
  assert moved[None] == pytest.approx(0.5 * norm, rel=1e-5)


def _streaming(loss_fn, params, batch, clip, **options):
  """Asynchronous 1F1B on 2 devices, 4 microbatches, SGD, clipping at
  ``clip`` (None: none)."""
  return jpipe.Pipeline(
    loss_fn,
    params,
    batch,
    num_stages=2,
    devices=jax.devices()[:2],
    num_microbatches=4,
    optimizer=optax.sgd(0.1),
    schedule="async",
    clip_global_norm=clip,
    **options,
  )


def test_streaming_clips_with_the_latest_norm_of_every_stage():
  """Asynchronous 1F1B: each step's gradient is scaled by min(1, clip /
  the norm of its own gradient with every other stage's latest), so no
  stage's update is larger than its unclipped one and the first step
  (no other norm known yet) clips on its own gradient alone."""
  loss_fn, params, batch, _ = flax_models.CASES["mlp"]()
  clip = 0.25 * _mean_grad_norm(loss_fn, params, batch, 4)
  runs = {}
  for c in (clip, None):
    pipe = _streaming(loss_fn, params, batch, c, record_params=True)
    state, metrics = pipe.step(pipe.init(params), batch)
    state, _ = pipe.flush(state)
    runs[c] = (pipe, state, metrics["used_params"])
  pipe, clipped, _ = runs[clip]
  _, unclipped, _ = runs[None]
  for s in range(2):
    step = [
      float(jnp.linalg.norm(jnp.ravel(a - b)))
      for a, b in zip(
        clipped.stage_params[s], pipe.init(params).stage_params[s], strict=True
      )
    ]
    free = [
      float(jnp.linalg.norm(jnp.ravel(a - b)))
      for a, b in zip(
        unclipped.stage_params[s],
        pipe.init(params).stage_params[s],
        strict=True,
      )
    ]
    assert sum(step) < sum(free)


def test_streaming_tied_exchange_outside_the_step_when_clipping():
  """Asynchronous 1F1B of GPT with its embedding reused as the head:
  with clipping, a tied stage's gradient is unpacked so the holder's
  gradient goes to the owner before the norm is taken (outside the
  fused step). A clip that never bites gives the unclipped run's params
  (which exchanges inside the step) and losses."""
  loss_fn, params, batch, _ = flax_models.gpt_case()
  runs = {}
  for c in (1e9, None):
    pipe = _streaming(loss_fn, params, batch, c)
    assert pipe.tied.replicas
    state, losses = pipe.init(params), []
    for _ in range(2):
      state, metrics = pipe.step(state, batch)
      losses.append(float(metrics["loss"]))
    state, _ = pipe.flush(state)
    runs[c] = (losses, state.stage_params)
    unpacked = "unpack" in pipe.programs.compiled_kinds()
    assert unpacked == (c is not None)
  np.testing.assert_allclose(runs[1e9][0], runs[None][0], rtol=1e-6)
  _assert_close(runs[1e9][1], runs[None][1])


def test_bad_clip_is_refused():
  loss_fn, params, batch, _ = flax_models.CASES["mlp"]()
  with pytest.raises(ValueError, match="clip_global_norm must be > 0"):
    jpipe.Pipeline(
      loss_fn,
      params,
      batch,
      num_stages=2,
      devices=jax.devices()[:2],
      optimizer=optax.sgd(0.1),
      clip_global_norm=0.0,
    )
