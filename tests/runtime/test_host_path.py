"""The driver's host path reuses work across a stream's calls without
changing what runs: a shifted call's ops are its base's lowering
shifted; the params-held count (kept as holders come and go) is the
plain formula's; stages on one device pass values without MOVE ops."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import SingleDeviceSharding

import jpipe
from jpipe import schedule as schedule_lib
from jpipe.runtime.build.calls import ShiftedCall, shifted_ops
from jpipe.runtime.build.placement import StagePlacement, put
from jpipe.runtime.execute import driver as _driver
from jpipe.runtime.execute.held_params import HeldParams
from tests.partition import flax_models


def _async_pipeline():
  loss_fn, params, batch, _ = flax_models.mlp_case()
  pipe = jpipe.Pipeline(
    loss_fn,
    params,
    batch,
    num_stages=4,
    devices=jax.devices()[:4],
    schedule="async",
    num_microbatches=2,
    optimizer=optax.sgd(0.05),
    weight_stashing=True,
  )
  return pipe, params, batch


def test_a_steady_streams_calls_are_lowered_once():
  pipe, params, batch = _async_pipeline()
  state = pipe.init(params)
  sizes = []
  for _ in range(8):
    state, _ = pipe.step(state, batch)
    sizes.append(len(pipe.driver._lowered))
  # Warm-up calls differ; past them every call is a shift of one.
  assert sizes[-1] == sizes[3] and sizes[-1] <= 4
  fed = state.in_flight.fed
  call = pipe.calls(fed, 2)
  assert isinstance(call, ShiftedCall) and call.shift > 0
  # The shifted call's lists, order and fused pairs: the base's, shifted.
  k = call.shift
  assert call.order == tuple(
    schedule_lib.Action(a.kind, a.stage, a.microbatch + k)
    for a in call.base.order
  )
  assert call.fused == {(s, b + k) for s, b in call.base.fused}
  for acts, base in zip(
    call.lists.device_actions, call.base.lists.device_actions, strict=True
  ):
    assert [a.microbatch for a in acts] == [a.microbatch + k for a in base]


@pytest.mark.parametrize("stage_process", [(0, 0, 0, 0), (0, 0, 1, 1)])
def test_shifted_ops_equal_lowering_the_shifted_order(stage_process):
  """Across 2 processes too (sends moved early, keyed by seq): lowering
  commutes with shifting microbatches."""
  pipe, params, batch = _async_pipeline()
  state = pipe.init(params)
  for _ in range(5):
    state, _ = pipe.step(state, batch)
  call = pipe.calls(state.in_flight.fed, 2)
  for process in sorted(set(stage_process)):
    options = dict(made_by=_driver._made_by)

    def lower(order, process=process, options=options):
      return schedule_lib.lower(
        order, pipe.driver._transfers, stage_process, process, **options
      )

    expected = lower(call.order)
    got = shifted_ops(lower(call.base.order), call.shift)
    assert tuple(got) == expected
    assert any(isinstance(op, schedule_lib.Move) for op in expected)


def _held_reference(holders, leaf_bytes):
  """(distinct tuples, bytes of distinct arrays) of the tuples held,
  restated."""
  distinct = []
  for t in holders:
    if not any(t is u for u in distinct):
      distinct.append(t)
  arrays = []
  total = 0
  for t in distinct:
    for x, n in zip(t or (), leaf_bytes, strict=False):
      if not any(x is y for y in arrays):
        arrays.append(x)
        total += n
  return len(distinct), total


def test_held_params_equal_the_plain_count_as_holders_come_and_go():
  """Random takes and drops (tuples sharing leaves, a leaf twice in one
  tuple, None): after each, the count and bytes are the plain formula's
  over the holders left, and nothing is referenced once dropped."""
  rng = np.random.default_rng(0)
  leaf_bytes = (40, 40, 400)
  fresh = [tuple(object() for _ in leaf_bytes) for _ in range(6)]
  # A version sharing a leaf with another, one holding a leaf twice
  # (tied leaves: same shape).
  shared = (fresh[0][0], object(), object())
  twice = (fresh[1][0], fresh[1][0], object())
  pool = [*fresh, shared, twice, None]
  holders = [pool[i] for i in rng.integers(0, len(pool), 3)]
  held = HeldParams(leaf_bytes, holders)
  for _ in range(400):
    move = rng.integers(0, 3)
    if move == 0 or not holders:
      t = pool[rng.integers(0, len(pool))]
      holders.append(t)
      held.take(t)
    elif move == 1:
      held.drop(holders.pop(rng.integers(0, len(holders))))
    else:
      i, t = rng.integers(0, len(holders)), pool[rng.integers(0, len(pool))]
      held.replace(holders[i], t)
      holders[i] = t
    assert (held.count, held.nbytes) == _held_reference(holders, leaf_bytes)
  for t in list(holders):
    held.drop(t)
  assert (held.count, held.nbytes) == (0, 0)
  assert not held._tuples and not held._arrays


@pytest.mark.parametrize("schedule", ["gpipe", "async"])
def test_stages_on_one_device_pass_values_without_move_ops(schedule):
  """4 stages on 2 devices (0, 1 | 2, 3): the lowering moves
  activations and input cotangents only between stages 1 and 2; F and B
  pass the others in place, with the same results to the bit as moving
  every one (the old path, forced)."""
  loss_fn, params, batch, _ = flax_models.mlp_case()
  d0, d1 = jax.devices()[:2]
  options = dict(
    num_stages=4,
    devices=(d0, d0, d1, d1),
    schedule=schedule,
    num_microbatches=4,
    optimizer=optax.sgd(0.05),
  )
  if schedule == "async":
    options["weight_stashing"] = True
  pipes = [jpipe.Pipeline(loss_fn, params, batch, **options) for _ in "ab"]
  every_move = pipes[1].driver
  every_move.inputs_placed = tuple(
    tuple((v, False) for v, _ in pairs) for pairs in every_move.inputs_placed
  )
  _assert_train_alike(pipes, params, batch)
  for pipe in pipes:
    ops, _ = pipe.driver.lower(pipe.calls(0, 4))
    pairs = {
      (op.transfer.what, op.transfer.src, op.transfer.dst)
      for op in ops
      if op.kind == _driver.MOVE
    }
    if pipe is pipes[0]:
      assert pairs == {("F", 1, 2), ("B", 2, 1)}
    else:
      assert {(w, s) for w, s, _ in pairs} >= {("F", 0), ("F", 2)}


def _assert_train_alike(pipes, params, batch):
  """Both pipelines, trained 3 steps from ``params`` (a stream flushed),
  end with the same params and last loss, to the bit."""
  results = []
  for pipe in pipes:
    state = pipe.init(params)
    for _ in range(3):
      state, metrics = pipe.step(state, batch)
    if pipe.stream is not None:
      state, _ = pipe.flush(state)
    results.append((jax.device_get(state.stage_params), metrics["loss"]))
  (got, got_loss), (want, want_loss) = results
  assert float(got_loss) == float(want_loss)
  jax.tree.map(np.testing.assert_array_equal, got, want)


@pytest.mark.parametrize(
  "schedule, options",
  [
    ("gpipe", {}),
    ("async", {"weight_stashing": True, "prediction": "msnag"}),
    ("async", {"step_every": 3}),
  ],
)
def test_numbers_placed_once_train_bit_identically(schedule, options):
  """Loss cotangents, step scales and prediction delays go to programs as
  arrays placed once (``Driver.device_scalar``): the same results to the
  bit as passing the Python numbers at every call, and the same arrays
  reused."""
  loss_fn, params, batch, _ = flax_models.mlp_case()
  pipes = [
    jpipe.Pipeline(
      loss_fn,
      params,
      batch,
      num_stages=4,
      devices=jax.devices()[:4],
      schedule=schedule,
      num_microbatches=4,
      optimizer=optax.sgd(0.05, momentum=0.9),
      **options,
    )
    for _ in "ab"
  ]
  pipes[1].driver.device_scalar = lambda s, number: number
  _assert_train_alike(pipes, params, batch)
  placed = pipes[0].driver._scalars
  assert placed, "no number was placed"
  for (s, kind, number), x in placed.items():
    assert x.weak_type and x.dtype == jnp.asarray(number).dtype
    assert x.sharding == pipes[0].driver.placement[s].replicated
    assert pipes[0].driver.device_scalar(s, number) is x
    assert kind is type(number)


def test_placing_keeps_arrays_already_in_place_and_places_the_rest():
  """``put_replicated`` returns an array committed where it goes as
  itself (no ~80 µs ``device_put``), and places everything else as
  ``device_put`` did: other devices, uncommitted arrays, numbers,
  NumPy arrays; None stays."""
  d0, d1 = jax.devices()[:2]
  for devices in ([d0], [d0, d1]):
    place = StagePlacement(devices, microbatch_size=4)
    there = jax.device_put(jnp.arange(3.0), place.replicated)
    tree = {
      "there": there,
      "elsewhere": jax.device_put(jnp.arange(3.0), jax.devices()[2]),
      "uncommitted": jnp.arange(2.0),
      "numpy": np.ones(2),
      "number": 1.5,
      "none": None,
    }
    got = place.put_replicated(tree)
    assert got["there"] is there
    assert got["none"] is None
    for name in ("elsewhere", "uncommitted", "numpy", "number"):
      x = got[name]
      assert x.committed and x.sharding == place.replicated, name
      np.testing.assert_array_equal(x, np.asarray(tree[name]))
    values = place.put_values({"a": there, "b": np.ones((4, 2))})
    assert values["a"] is there
    assert values["b"].sharding == place.split
  # By device (a weighted group's values, the clip norms, the losses).
  on_d0 = jax.device_put(jnp.arange(3.0), d0)
  assert put(on_d0, d0) is on_d0
  moved = put(on_d0, d1)
  assert moved.committed and moved.sharding == SingleDeviceSharding(d1)
  assert put(1.5, d1).devices() == {d1}
