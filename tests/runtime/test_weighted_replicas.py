"""Weighted replica groups (``replica_routing="weighted"``, DynPipe's
DP-stage load balancing): replica j of a stage takes ``rows[j]`` examples
of every microbatch, as its own program.

Against independent references: the synchronous schedules train as one
device would (``_trains_like_one_device``), the asynchronous stream as
the plain restatement of its semantics in ``test_pipeline_async`` -- for
any split, changed between calls, since the split is not in the math.
The split itself against a restatement of DynPipe's rule.
"""

import jax
import jax.numpy as jnp
import optax
import pytest

from jpipe.runtime.build.placement import even_rows, rows_for_speeds
from tests.partition import flax_models
from tests.runtime import test_pipeline_async as async_tests
from tests.runtime.test_replicated_stages import (
  LAYOUTS,
  _replicated,
  _trains_like_one_device,
)
from tests.tiers import slow


def _weighted(layout, case, **kwargs):
  """A 3-stage weighted pipeline of a ``flax_models`` case on
  ``layout``; returns (pipe, loss_fn, params, batch)."""
  loss_fn, params, batch, _ = flax_models.CASES[case]()
  pipe = _replicated(
    layout, loss_fn, params, batch, replica_routing="weighted", **kwargs
  )
  return pipe, loss_fn, params, batch


@pytest.mark.parametrize("layout", LAYOUTS, ids=str)
@pytest.mark.parametrize(
  "case, schedule", [("mlp", "gpipe"), ("encoder_decoder", "1f1b")]
)
@pytest.mark.slow
def test_synchronous_weighted_equals_single_device(case, schedule, layout):
  tx = optax.sgd(0.1, momentum=0.9)
  pipe, loss_fn, params, batch = _weighted(
    LAYOUTS[layout], case, schedule=schedule, num_microbatches=2, optimizer=tx
  )
  n = pipe.placement[0].microbatch_size
  assert pipe.replica_rows[0] == even_rows(n, 2)
  # Uneven, and a replica that takes nothing.
  pipe.set_replica_rows(0, (n - 1, 1))
  if pipe.placement[2].weighted:
    pipe.set_replica_rows(2, (0, n))
  state = _trains_like_one_device(pipe, loss_fn, params, batch, tx, 2)
  want = loss_fn(pipe.gather_params(state), batch)
  got = pipe.evaluate(state, batch)["loss"]
  assert float(got) == pytest.approx(float(want), rel=1e-5)
  # Each slice size compiled from the model traced on that many examples;
  # the params and optimizer state stay replicated over each group.
  assert set(pipe.programs._at_rows) >= {n - 1, 1} - {n}
  for x in jax.tree.leaves((state.stage_params[0], state.opt_states[0])):
    assert x.sharding.is_fully_replicated
    assert len(x.devices()) == 2


def _async_data(num_microbatches, size, seed=7):
  k1, k2 = jax.random.split(jax.random.key(seed))
  total = size * num_microbatches
  return {
    "x": jax.random.normal(k1, (total, 6)),
    "y": jax.random.randint(k2, (total,), 0, 4),
  }


@pytest.mark.parametrize(
  "opts",
  [
    slow(dict(weight_stashing=True, recompute=True)),
    dict(weight_stashing=True, recompute=False),
    dict(weight_stashing=False, recompute=True),
  ],
  ids=lambda o: "-".join(f"{k[:2]}={v}" for k, v in o.items()),
)
def test_async_weighted_streams_like_the_reference(opts):
  """The stream's math does not depend on the split: re-splitting between
  calls (as DynPipe's balancer does) keeps the reference's params."""
  loss_fn, params, _ = async_tests._mlp()
  size = 5  # Any size: the replicas need not split it evenly.
  example = _async_data(async_tests.NUM_MICRO, size)
  pipe = _replicated(
    ((0, 1), (2,), (3, 4)),
    loss_fn,
    params,
    example,
    schedule="async",
    num_microbatches=async_tests.NUM_MICRO,
    optimizer=async_tests.SGD,
    record_params=True,
    replica_routing="weighted",
    **opts,
  )
  assert pipe.replica_rows == {0: (3, 2), 2: (3, 2)}
  data = _async_data(11, size)
  splits = iter([(1, 4), (5, 0), (2, 3)])

  def resplit():
    rows = next(splits)
    pipe.set_replica_rows(0, rows)
    pipe.set_replica_rows(2, rows[::-1])

  state, _, streams, (used,) = async_tests._run_calls(
    pipe, pipe.init(params), data, (4, 3, 4, "flush"), after_call=resplit
  )
  expected, (expected_used,) = async_tests._reference(
    pipe, params, streams, async_tests.SGD, {"schedule": "async", **opts}
  )
  for s in range(3):
    async_tests._close(state.stage_params[s], expected[s])
  assert set(used) == set(expected_used)
  for key, theta in expected_used.items():
    async_tests._close(used[key], theta)


def _dynpipe_rows(n, speeds):
  """DynPipe's ``communication_tyf_1.py`` split, restated: target
  round(share x n) per rank, then the remainder one by one over the
  first ranks (here with speeds, so a slow rank gets fewer)."""
  total = sum(speeds)
  rows = [int(round(v / total * n)) for v in speeds]
  left = n - sum(rows)
  j = 0
  while left:
    step = 1 if left > 0 else -1
    if step > 0 or rows[j % len(rows)] > 0:
      rows[j % len(rows)] += step
      left -= step
    j += 1
  return tuple(rows)


@pytest.mark.parametrize(
  "n, speeds",
  [
    (8, (1.0, 1.0)),
    (8, (1.0, 1 / 3)),
    (72, (1, 1, 1, 1, 1, 1)),
    (7, (3.0, 1.0, 1.0)),
    (5, (0.2, 0.2, 0.2, 0.2, 0.2, 0.2, 0.2)),
    (9, (1.0, 0.0)),
  ],
)
def test_rows_follow_dynpipes_split(n, speeds):
  rows = rows_for_speeds(n, speeds)
  assert rows == _dynpipe_rows(n, speeds)
  assert sum(rows) == n and min(rows) >= 0
  # A faster replica never gets fewer examples.
  for a in range(len(speeds)):
    for b in range(len(speeds)):
      if speeds[a] > speeds[b]:
        assert rows[a] >= rows[b]
  # Equal speeds: equal shares, to one example (as ``even_rows``).
  equal = rows_for_speeds(n, [1] * len(speeds))
  assert max(equal) - min(equal) <= 1
  assert sorted(equal) == sorted(even_rows(n, len(speeds)))


def test_weighted_needs_what_it_is_built_for():
  kwargs = dict(num_microbatches=2, optimizer=async_tests.SGD)
  layout = LAYOUTS["disjoint"]
  with pytest.raises(ValueError, match="'weighted' does not run with tied"):
    _weighted(layout, "gpt_tied", schedule="1f1b", **kwargs)
  with pytest.raises(ValueError, match="weight prediction"):
    _weighted(layout, "mlp", schedule="async", prediction="msnag", **kwargs)
  loss_fn, params, batch, _ = flax_models.mlp_case()
  with pytest.raises(ValueError, match="aux outputs made on a weighted"):
    _replicated(
      layout,
      lambda p, b: (loss := loss_fn(p, b), {"loss": loss}),
      params,
      batch,
      replica_routing="weighted",
      schedule="gpipe",
      has_aux=True,
      **kwargs,
    )
  pipe = _weighted(layout, "mlp", schedule="gpipe", **kwargs)[0]
  with pytest.raises(ValueError, match="summing to 4"):
    pipe.set_replica_rows(0, (3, 2))
  with pytest.raises(ValueError, match="non-negative"):
    pipe.set_replica_rows(0, (5, -1))
  with pytest.raises(ValueError, match="not a weighted replica group"):
    pipe.set_replica_rows(1, (4,))
  with pytest.raises(ValueError, match="speeds"):
    rows_for_speeds(4, (0.0, 0.0))
  zb, _, params, batch = _weighted(layout, "mlp", schedule="zbh1", **kwargs)
  with pytest.raises(ValueError, match="does not split into I and W"):
    zb.step(zb.init(params), batch)


def test_a_model_that_changes_with_the_batch_size_is_refused():
  """A slice runs the model traced on fewer examples: a model whose
  operations depend on the batch size would be cut differently."""
  model = flax_models.Mlp(widths=(8, 8, 4))  # 3 layers: 3 stages.
  x = jax.random.normal(jax.random.key(0), (8, 6))
  params = model.init(jax.random.key(1), x)

  def loss_fn(params, batch):
    h = model.apply(params, batch["x"])
    if batch["x"].shape[0] > 1:  # Shape-dependent Python.
      h = jnp.tanh(h)
    return jnp.mean(h**2)

  pipe = _replicated(
    ((0, 1), (2,), (3,)),
    loss_fn,
    params,
    {"x": x},
    num_microbatches=2,
    optimizer=optax.sgd(0.1),
    replica_routing="weighted",
  )
  with pytest.raises(ValueError, match="traces differently on 1 examples"):
    pipe.set_replica_rows(0, (3, 1))
  assert pipe.replica_rows[0] == (2, 2)  # Kept: the pipeline still runs.
  pipe.step(pipe.init(params), {"x": x})


def test_memory_counts_the_busiest_replicas_slice():
  layout = LAYOUTS["disjoint"]
  kwargs = dict(
    schedule="gpipe",
    num_microbatches=2,
    optimizer=optax.sgd(0.1),
    fuse_last_stage=False,
  )
  pipe = _weighted(layout, "mlp", **kwargs)[0]
  whole = _weighted(((0,), (2,), (3,)), "mlp", **kwargs)[0].memory
  n = pipe.placement[0].microbatch_size
  pipe.set_replica_rows(0, (n - 1, 1))
  memory = pipe.memory
  assert memory[0].kept_per_microbatch == -(
    -whole[0].kept_per_microbatch * (n - 1) // n
  )
  assert memory[0].params == whole[0].params
