"""A stage's backward split into I and W (zero-bubble schedules)."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jpipe
from jpipe.partition._backward_split import split_backward
from jpipe.runtime.build.memory import nbytes
from tests.partition import flax_models
from tests.runtime.test_memory import (
  _assert_same_bytes,
  _cots,
  _gpt_pipe,
  _stage_inputs,
)
from tests.runtime.test_pipeline_sync import (
  _assert_tree_close,
  _reference_steps,
)
from tests.tiers import slow


def _stage(params, x):
  w1, b1, w2, b2 = params
  h = jnp.tanh(x @ w1 + b1[None])
  return jax.nn.relu(h @ w2 + b2[None]), jnp.sum(h)


def _backward(params, x, dy, dsum):
  _, pull = jax.vjp(_stage, params, x)
  grads, dx = pull((dy, dsum))
  return grads, (dx, None)


def _args():
  k = jax.random.split(jax.random.key(0), 7)
  params = (
    jax.random.normal(k[0], (5, 7)),
    jax.random.normal(k[1], (7,)),
    jax.random.normal(k[2], (7, 3)),
    jax.random.normal(k[3], (3,)),
  )
  x = jax.random.normal(k[4], (4, 5))
  return params, x, jax.random.normal(k[5], (4, 3)), jnp.float32(0.5)


def test_i_then_w_is_the_backward_and_w_holds_the_weight_matmuls():
  args = _args()
  split = split_backward(_backward, *args)
  cots, kept = jax.jit(split.input_part)(*args)
  grads = jax.jit(split.weight_part)(kept)
  want_grads, (want_dx, _) = _backward(*args)
  np.testing.assert_allclose(cots[0], want_dx, rtol=1e-5, atol=1e-6)
  assert cots[1] is None
  for g, w in zip(grads, want_grads, strict=True):
    np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-6)
  prims = {
    part: [str(split.jaxpr.eqns[i].primitive) for i in eqns]
    for part, eqns in (("I", split.input_eqns), ("W", split.weight_eqns))
  }
  # x^T dy of both layers is W's; I keeps dx = dy w^T of the second.
  assert prims["W"].count("dot_general") == 2
  assert "dot_general" in prims["I"]
  assert not set(split.input_eqns) & set(split.weight_eqns)
  # What W keeps: the layers' inputs and the cotangents at their outputs.
  assert sorted(a.shape for a in split.kept_avals) == sorted(
    [(4, 5), (4, 7), (4, 7), (4, 3)]
  )


@pytest.mark.parametrize("recompute", [True, False])
def test_memory_counts_what_w_keeps_as_xla_allocates_it(recompute):
  """What each I hands its W is XLA's output of the I program less the
  input cotangents; a stage holds at most n microbatches between F and W
  (ZB-H1), and its prediction counts the moment of its most bytes."""
  pipe, _, _ = _gpt_pipe(schedule="zbh1", recompute=recompute)
  one_f_one_b, _, _ = _gpt_pipe(schedule="1f1b", recompute=recompute)
  n = pipe.stages.num_stages
  for s, memory in enumerate(pipe.memory):
    params, batch, acts = _stage_inputs(pipe, s)
    saving = pipe.stages.jitted("forward_saving", s)
    outputs, results, residuals = jax.eval_shape(saving, params, batch, acts)
    head = (batch, acts) if recompute else (residuals,)
    args = (params, *head, outputs, _cots(results))
    run = pipe.programs.input_grad(s)
    act_cots, kept = jax.eval_shape(run, *args)
    stats = run.lower(*args).compile().memory_analysis()
    _assert_same_bytes(
      nbytes(act_cots) + memory.weight_kept_per_microbatch,
      stats.output_size_in_bytes,
      (act_cots, kept),
    )
    assert memory.weight_kept_per_microbatch == nbytes(kept) > 0
    assert memory.in_flight + memory.awaiting_weight <= n
    other = one_f_one_b.memory[s]
    assert (
      memory.total
      - memory.in_flight * memory.kept_per_microbatch
      - (memory.awaiting_weight * memory.weight_kept_per_microbatch)
      == other.total - other.in_flight * other.kept_per_microbatch
    )
  # The last stage keeps the most W's waiting (n - 1 deferred).
  assert pipe.memory[-1].awaiting_weight >= 1


WRITTEN = """
0F0 0F1 0F2 0I0 0F3 0I1 0W0 0I2 0W1 0I3 0W2 0W3
1F0 1I0 1F1 1I1 1W0 1F2 1I2 1W1 1F3 1I3 1W2 1W3
"""


def test_a_written_schedule_runs_as_written_and_equals_one_device():
  loss_fn, params, batch, _ = flax_models.CASES["mlp"]()
  tx = optax.adam(1e-2)
  kind = jpipe.schedule.custom_schedule("mine", WRITTEN)
  pipe = jpipe.Pipeline(
    loss_fn,
    params,
    batch,
    num_stages=2,
    devices=jax.devices()[:2],
    schedule=kind,
    num_microbatches=4,
    optimizer=tx,
  )
  state = pipe.init(params)
  lists = pipe.call_actions(state, 4)
  assert lists.format().splitlines() == [
    "dev0: "
    + " ".join(f"{t[1]}0.{t[2]}" for t in WRITTEN.split()[:12])
    + " S0.3",
    "dev1: "
    + " ".join(f"{t[1]}1.{t[2]}" for t in WRITTEN.split()[12:])
    + " S1.3",
  ]
  state, metrics = pipe.step(state, batch)
  expected, loss = _reference_steps(loss_fn, params, batch, 4, tx)
  _assert_tree_close(pipe.gather_params(state), expected)
  assert float(metrics["loss"]) == pytest.approx(loss, rel=1e-5)
  half = jax.tree.map(lambda x: x[: len(x) // 2], batch)
  with pytest.raises(ValueError, match="written for 4 microbatches"):
    pipe.step(state, half)


ADAM, SGD = optax.adam(1e-2), optax.sgd(0.1, momentum=0.9)
# schedule, stages, devices, recompute, optimizer.
SPLIT_CASES = {
  "zbh1-recompute-adam": ("zbh1", 3, 3, True, ADAM),
  "zbh1-adam": ("zbh1", 3, 3, False, ADAM),
  "zbh2-recompute-adam": ("zbh2", 3, 3, True, ADAM),
  "zbh2-sgd": ("zbh2", 3, 3, False, SGD),
  "zbv-recompute-adam": ("zbv", 4, 2, True, ADAM),
  "zbv-sgd": ("zbv", 4, 2, False, SGD),
  "dualpipev-recompute-sgd": ("dualpipev", 4, 2, True, SGD),
  "dualpipev-adam": ("dualpipev", 4, 2, False, ADAM),
}


@pytest.mark.parametrize(
  "case",
  [c if c == "zbv-recompute-adam" else slow(c) for c in SPLIT_CASES],
)
def test_split_backward_schedules_equal_single_device(case):
  """ZB-H1 (a stage per device), ZB-V and DualPipeV (4 stages in a V on 2
  devices: device 0 holds the first and the last, which share the tied
  embedding): two steps equal single-device accumulation, the call runs
  the schedule's own lists."""
  schedule, stages, devices, recompute, tx = SPLIT_CASES[case]
  loss_fn, params, batch, _ = flax_models.CASES["gpt_tied"]()
  pipe = jpipe.Pipeline(
    loss_fn,
    params,
    batch,
    num_stages=stages,
    devices=jax.devices()[:devices],
    schedule=schedule,
    num_microbatches=4,
    optimizer=tx,
    recompute=recompute,
  )
  state = pipe.init(params)
  for _ in range(2):
    state, metrics = pipe.step(state, batch)
  expected, loss = _reference_steps(loss_fn, params, batch, 4, tx, steps=2)
  _assert_tree_close(pipe.gather_params(state), expected)
  assert float(metrics["loss"]) == pytest.approx(loss, rel=1e-5)
  lists = pipe.call_actions(state, 4)
  built = jpipe.schedule.build(schedule, stages, 4)
  assert lists.device_actions == built.device_actions
  assert {"I", "W"} <= {a.kind for acts in lists.device_actions for a in acts}
  assert len(pipe.device_names) == devices
  if stages > devices:  # The V; each device's prediction sums its two.
    assert pipe.plan.stage_devices == ((0,), (1,), (1,), (0,))
    assert len(pipe.device_memory) == 2


@pytest.mark.parametrize(
  "options, match",
  [
    # (Only what is wrong: not the partition it already has.)
    ({"num_stages": 3}, r"in a V: use an even num_stages \(got 3\)$"),
    ({"num_stages": 4, "partition": "mixed"}, "use partition 'contiguous'"),
    ({"num_stages": 6}, r"6 stages need 3 devices \(2 per device\)"),
  ],
)
def test_v_schedules_refuse_what_they_cannot_place(options, match):
  loss_fn, params, batch, _ = flax_models.CASES["mlp"]()
  with pytest.raises(ValueError, match=match):
    jpipe.Pipeline(
      loss_fn,
      params,
      batch,
      devices=jax.devices()[:2],
      schedule="zbv",
      num_microbatches=4,
      optimizer=optax.sgd(0.1),
      **options,
    )
