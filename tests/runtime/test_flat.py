"""FlatLayout: leaves <-> one flat buffer per dtype, against NumPy."""

import math
import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jpipe
from jpipe.models import mlp
from jpipe.runtime.build.flat import FlatLayout, PackedTree


def _leaves():
  rng = np.random.default_rng(0)
  return (
    rng.normal(size=(3, 4)).astype(np.float32),
    rng.normal(size=()).astype(np.float32),
    rng.normal(size=(5,)).astype(jnp.bfloat16),
    rng.normal(size=(2, 1, 2)).astype(np.float32),
  )


def test_pack_is_numpy_concatenation_per_dtype_and_unpack_inverts_it():
  leaves = _leaves()
  layout = FlatLayout(leaves)
  flat = jax.jit(layout.pack)(leaves)
  assert len(flat) == 2  # float32, bfloat16
  expected_f32 = np.concatenate(
    [leaves[0].ravel(), leaves[1].ravel(), leaves[3].ravel()]
  )
  np.testing.assert_array_equal(flat[0], expected_f32)
  np.testing.assert_array_equal(
    np.asarray(flat[1], np.float32), leaves[2].astype(np.float32)
  )
  back = jax.jit(layout.unpack)(flat)
  for a, b in zip(back, leaves, strict=True):
    assert a.shape == b.shape and a.dtype == b.dtype
    np.testing.assert_array_equal(np.asarray(a), b)


def test_layout_from_avals_matches_layout_from_arrays():
  leaves = _leaves()
  avals = [jax.core.ShapedArray(x.shape, x.dtype) for x in leaves]
  a, b = FlatLayout(leaves), FlatLayout(avals)
  assert (a.entries, a.sizes, a.dtypes) == (b.entries, b.sizes, b.dtypes)


def test_empty_and_integer_tuples_pass_through():
  assert FlatLayout(()).pack(()) == ()
  ints = (np.arange(3), np.ones(2, np.float32))
  layout = FlatLayout(ints)
  assert not layout.packed
  assert layout.unpack(layout.pack(ints)) == ints


def test_leaves_from_the_threshold_keep_their_own_buffer():
  leaves = _leaves()  # 48, 4, 10 and 16 bytes
  layout = FlatLayout(leaves, own_buffer_bytes=16)
  flat = jax.jit(layout.pack)(leaves)
  # Own buffers first (in leaf order), then the small ones per dtype.
  assert [x.shape for x in flat] == [(3, 4), (2, 1, 2), (1,), (5,)]
  np.testing.assert_array_equal(flat[0], leaves[0])
  np.testing.assert_array_equal(flat[1], leaves[3])
  np.testing.assert_array_equal(flat[2], leaves[1].reshape(1))
  back = jax.jit(layout.unpack)(flat)
  for a, b in zip(back, leaves, strict=True):
    assert a.shape == b.shape and a.dtype == b.dtype
    np.testing.assert_array_equal(np.asarray(a), b)
  assert len(FlatLayout(leaves, own_buffer_bytes=0).pack(leaves)) == 4
  assert len(FlatLayout(leaves, own_buffer_bytes=math.inf).pack(leaves)) == 2


def _two_stage_mlp(hidden, rows, own_buffer_bytes=None):
  """An MLP of ``hidden`` widths (inputs as wide as the first) in 2 stages,
  2 microbatches of ``rows`` rows, no recomputation, SGD. Returns the
  pipeline, its params and batch, and stage 0's params, microbatch and
  saving forward's ``(outputs, results, residuals)``."""
  model = mlp.Model(hidden=hidden, num_classes=4)
  x = jax.random.normal(jax.random.key(1), (2 * rows, hidden[0]))
  params = model.init(jax.random.key(0), x)

  def loss_fn(params, batch):
    return jnp.mean(model.apply(params, batch["x"]) ** 2)

  pipe = jpipe.Pipeline(
    loss_fn,
    params,
    {"x": x},
    num_stages=2,
    num_microbatches=2,
    optimizer=optax.sgd(0.1),
    recompute=False,
    own_buffer_bytes=own_buffer_bytes,
  )
  stage_params = pipe.stages.split_params(params)[0]
  stage_batch = pipe.stages.split_batch({"x": x[:rows]})[0]
  saved = pipe.stages.jitted("forward_saving", 0)(stage_params, stage_batch, ())
  return pipe, params, {"x": x}, stage_params, saved


def test_a_stage_backward_never_copies_a_big_gradient_into_a_flat_buffer():
  """512 x 512 kernels (1 MiB) on a CPU: the saved-residual backward of
  a stage returns their gradients as their own buffers -- its compiled
  program concatenates nothing that big (it would be a copy of them)."""
  pipe, _, _, stage_params, saved = _two_stage_mlp((512, 512), rows=4)
  assert pipe.programs.grad_layouts[0].num_own >= 1
  outputs, _, residuals = saved
  out_cots = tuple(jnp.ones_like(o) for o in outputs)
  backward = pipe.programs.backward(0, first=True)
  hlo = backward.lower(None, stage_params, residuals, out_cots, ())
  concatenated = [
    int(np.prod([int(d) for d in m.group(1).split(",") if d], dtype=np.int64))
    for m in re.finditer(
      r"= \w+\[([\d,]*)\]\S* concatenate\(", hlo.compile().as_text()
    )
  ]
  assert all(n < 512 * 512 for n in concatenated), concatenated


def _mlp_pipeline(own_buffer_bytes):
  """64 x 64 kernels (16 KiB), 256-byte biases, microbatches of 64 rows
  (16 KiB activations): the pipeline, its stage-0 forward's residuals
  and its params after a step."""
  pipe, params, batch, _, (_, _, residuals) = _two_stage_mlp(
    (64, 64, 64), rows=64, own_buffer_bytes=own_buffer_bytes
  )
  state, _ = pipe.step(pipe.init(params), batch)
  return pipe, residuals, pipe.state_dict(state)["params"]


@pytest.mark.slow
def test_own_buffer_bytes_chooses_what_travels_packed_not_the_results():
  runs = {
    n: _mlp_pipeline(n) for n in (None, 0, math.inf, 1 << 14, (1 << 14) + 1)
  }
  kernels = []
  for leaf in jax.tree.leaves(
    runs[None][0].stages.split_params(runs[None][2])[0]
  ):
    kernels.append(leaf.ndim == 2)
  num_leaves, num_kernels = len(kernels), sum(kernels)
  assert num_kernels >= 1 and num_leaves > num_kernels

  def own(pipe):
    return pipe.programs.grad_layouts[0].num_own

  # The CPU's default: 16 KiB leaves (the kernels) apart, the biases packed.
  assert own(runs[None][0]) == own(runs[1 << 14][0]) == num_kernels
  assert own(runs[0][0]) == num_leaves
  assert own(runs[math.inf][0]) == own(runs[(1 << 14) + 1][0]) == 0
  # Residuals alike: the 16 KiB activations apart, or all in one buffer.
  counts = {n: len(r) for n, (_, r, _) in runs.items()}
  assert counts[0] == counts[None] == counts[1 << 14] > 1
  assert counts[math.inf] == counts[(1 << 14) + 1] == 1
  for _, _, params in runs.values():  # The same step, to the bit.
    jax.tree.map(np.testing.assert_array_equal, params, runs[None][2])


def test_own_buffer_bytes_must_be_a_size():
  with pytest.raises(ValueError, match="own_buffer_bytes must be a size"):
    jpipe.runtime.Partitioning(num_stages=2, own_buffer_bytes=-1)


def test_a_stored_state_keeps_a_prng_key_apart():
  """A typed PRNG key (optax.add_noise's state) has no NumPy dtype: it
  stays its own buffer and comes back the same key."""
  state = {
    "count": jnp.int32(3),
    "key": jax.random.key(7),
    "mu": jnp.arange(4.0),
  }
  packed = PackedTree.pack(state, 1 << 14)
  assert (
    sum(
      jax.dtypes.issubdtype(b.dtype, jax.dtypes.prng_key)
      for b in packed.buffers
    )
    == 1
  )
  back = packed.unpack()
  np.testing.assert_array_equal(
    jax.random.key_data(back["key"]), jax.random.key_data(state["key"])
  )
  np.testing.assert_array_equal(back["mu"], state["mu"])
  assert back["count"] == 3
