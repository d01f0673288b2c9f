"""PipeDream's round-robin replicas (1F1B-RR, ``replica_routing=
"round_robin"``): microbatch b whole on replica b mod r of its stage.

Against independent references: the synchronous schedules train as one
device would; the asynchronous stream with weight stashing trains as a
restatement of PipeDream's per-replica runtime loop does (its warm-up
formula, F / B pairs per replica, a step per round of backwards on their
mean, the rate times r_s / r_0).
"""

import jax
import jax.numpy as jnp
import optax
import pytest

from jpipe import schedule as schedule_lib
from tests.partition import flax_models
from tests.runtime import test_pipeline_async as async_tests
from tests.runtime.test_replicated_stages import (
  LAYOUTS,
  _replicated,
  _trains_like_one_device,
)
from tests.tiers import slow


def _pipedream_steps_before_forward(replicas, num_micro):
  """``(s, b) -> steps stage s took before F(s, b)``, from PipeDream's
  runtime loop (``runtime/main_with_runtime.py``): replica j of stage s
  runs ``w = (R - 1 - sum(r[:s])) // r_s`` forwards, then (forward,
  backward) pairs; its k-th forward is microbatch j + k r_s; every
  backward ends in the all-reduce and the step all replicas take
  together, so a replica's backwards so far are the stage's steps."""
  total, out = sum(replicas), {}
  for s, r in enumerate(replicas):
    w = (total - 1 - sum(replicas[:s])) // r
    for j in range(r):
      ops = [("F", k) for k in range(w)]
      for k in range(w, num_micro):
        ops += [("F", k), ("B", k - w)]
      done = 0
      for kind, k in ops:
        if kind == "B":
          done += 1
        elif j + k * r < num_micro:
          out[(s, j + k * r)] = done
  return out


@pytest.mark.parametrize(
  "replicas", [(3, 1), (1, 3), (2, 2), (2, 1, 2), (1, 1, 1, 1), (1, 2, 1)]
)
def test_stream_follows_pipedreams_per_replica_loop(replicas):
  n, num = len(replicas), 40
  stream = schedule_lib.Stream("async", n, replicas=replicas)
  expected = _pipedream_steps_before_forward(replicas, num)
  for s in range(n):
    for b in range(num):
      assert stream.replica(s, b) == b % replicas[s]
      assert stream.steps_before_forward(s, b) == expected[(s, b)]
      # Its step is the round's: b // r_s.
      assert stream.delay(s, b) == b // replicas[s] - expected[(s, b)]
  if set(replicas) == {1}:  # Plain 1F1B.
    assert [stream.warmup(s) for s in range(n)] == [n - 1 - s for s in range(n)]
  # Every call pattern runs to the end (no action waits forever), and a
  # stage steps after each whole round of its replicas' backwards.
  lists = stream.schedule((3, 5, 4))
  schedule_lib.simulate(lists, 1.0, 2.0)
  for s, acts in enumerate(lists.device_actions):
    steps = [a.microbatch for a in acts if a.kind == "S"]
    assert steps == [
      b for b in range(12) if (b + 1) % replicas[s] == 0 or b == 11
    ]


def test_stream_replicas_are_checked():
  with pytest.raises(ValueError, match="one per stage"):
    schedule_lib.Stream("async", 2, replicas=(2,))
  with pytest.raises(ValueError, match="1F1B-RR"):
    schedule_lib.Stream("async", 2, step_every=2, replicas=(2, 1))
  with pytest.raises(ValueError, match="1F1B-RR"):
    schedule_lib.Stream("2bw", 2, step_every=2, replicas=(2, 1))


def _round_robin(layout, case, routing="round_robin", **kwargs):
  """A 3-stage round-robin pipeline of a ``flax_models`` case (or
  "async_mlp": ``test_pipeline_async``'s MLP) on ``layout``; returns
  (pipe, loss_fn, params, batch)."""
  if case == "async_mlp":
    loss_fn, params, batch = async_tests._mlp()
  else:
    loss_fn, params, batch, _ = flax_models.CASES[case]()
  pipe = _replicated(
    layout,
    loss_fn,
    params,
    batch,
    replica_routing=routing,
    record_params=True,
    **kwargs,
  )
  return pipe, loss_fn, params, batch


def _replica_devices(pipe, used, layout):
  """Checks every action's params lived on the replica of its
  microbatch (b mod r of the stage's group)."""
  devices = jax.devices()
  for (_, s, b), theta in used.items():
    group = layout[s]
    want = {devices[group[b % len(group)]]}
    assert all(x.devices() == want for x in jax.tree.leaves(theta)), (s, b)


@pytest.mark.parametrize(
  "case, schedule, layout",
  [
    ("mlp", "gpipe", "mixed"),
    slow("mlp", "gpipe", "disjoint"),
    slow("encoder_decoder", "1f1b", "mixed"),
    slow("encoder_decoder", "1f1b", "disjoint"),
  ],
)
def test_synchronous_round_robin_equals_single_device(case, schedule, layout):
  tx = optax.sgd(0.1, momentum=0.9)
  pipe, loss_fn, params, batch = _round_robin(
    LAYOUTS[layout], case, schedule=schedule, num_microbatches=4, optimizer=tx
  )
  state = pipe.init(params)
  _, metrics = pipe.step(state, batch)
  _replica_devices(pipe, metrics["used_params"], LAYOUTS[layout])
  state = _trains_like_one_device(pipe, loss_fn, params, batch, tx, 2)
  # Forward only (evaluation) on the replicas too: the loss at the params.
  want = loss_fn(pipe.gather_params(state), batch)
  got = pipe.evaluate(state, batch)["loss"]
  assert float(got) == pytest.approx(float(want), rel=1e-5)


def _pipedream_reference(pipe, params, microbatches, tx, replicas):
  """Final stage params and the params every forward used: each
  microbatch through the stages at the versions PipeDream's loop gives
  (``_pipedream_steps_before_forward``), its backward at the same
  params (weight stashing); stage s's step t applies the mean gradient
  of microbatches t r_s .. t r_s + r_s - 1 (its replicas' all-reduce),
  the update times r_s / r_0 (PipeDream's rate per stage)."""
  stages = pipe.stages
  n = stages.num_stages
  before = _pipedream_steps_before_forward(replicas, len(microbatches))
  versions = [[p] for p in stages.split_params(params)]
  states = [[tx.init(v[0])] for v in versions]
  grads, used = {}, {}
  update = jax.jit(tx.update)  # (Jitted: the same arithmetic, sooner.)
  for b, mb in enumerate(microbatches):
    local = stages.split_batch(mb)
    values, fwd, inputs = {}, {}, {}
    for s in range(n):
      spec = stages.specs[s]
      fwd[s] = versions[s][before[(s, b)]]
      used[("F", s, b)] = fwd[s]
      inputs[s] = tuple(values[v] for v in spec.inputs)
      outputs, _ = stages.jitted("forward", s)(fwd[s], local[s], inputs[s])
      values.update(zip(spec.outputs, outputs, strict=True))
    cots = {}
    for s in reversed(range(n)):
      spec = stages.specs[s]
      out_cots = tuple(cots.get(v) for v in spec.outputs)
      result_cots = tuple(1.0 if r == 0 else None for r in spec.results)
      grads[(s, b)], act_cots = stages.jitted("backward", s)(
        fwd[s], local[s], inputs[s], out_cots, result_cots
      )
      for v, c in zip(spec.inputs, act_cots, strict=True):
        if c is not None:
          cots[v] = c if v not in cots else cots[v] + c
      r = replicas[s]
      if b % r == r - 1:  # Every replica of the round has its gradient.
        round_grads = [grads[(s, x)] for x in range(b - r + 1, b + 1)]
        mean = jax.tree.map(lambda *g, r=r: sum(g) / r, *round_grads)
        updates, state = update(mean, states[s][-1], versions[s][-1])
        rate = r / replicas[0]
        updates = jax.tree.map(lambda u, rate=rate: u * rate, updates)
        versions[s].append(optax.apply_updates(versions[s][-1], updates))
        states[s].append(state)
  return [v[-1] for v in versions], used


@pytest.mark.parametrize(
  "layout", [((0, 1), (2,), (3, 4)), ((0, 1, 2), (3,), (4,))], ids=str
)
@pytest.mark.parametrize("recompute", [True, False])
@pytest.mark.slow
def test_async_round_robin_with_stashing_is_pipedreams(layout, recompute):
  tx = async_tests.SGD
  pipe, _, params, _ = _round_robin(
    layout,
    "async_mlp",
    schedule="async",
    num_microbatches=async_tests.NUM_MICRO,
    optimizer=tx,
    weight_stashing=True,
    recompute=recompute,
  )
  replicas = tuple(len(g) for g in layout)
  assert pipe.stream.replicas == replicas
  data = async_tests._mlp_data(12)
  state = pipe.init(params)
  state, _, streams, used = async_tests._run_calls(
    pipe, state, data, (4, 4, 4, "flush")
  )
  (microbatches,) = streams
  expected, expected_used = _pipedream_reference(
    pipe, params, microbatches, tx, replicas
  )
  for s in range(pipe.stages.num_stages):
    async_tests._close(state.stage_params[s], expected[s])
  (got,) = used
  _replica_devices(pipe, got, layout)
  for key, theta in expected_used.items():
    async_tests._close(got[key], theta)
  # Each replica's params and optimizer state stay those of its group.
  for x in jax.tree.leaves((state.stage_params, state.opt_states)):
    assert x.sharding.is_fully_replicated


def test_round_robin_needs_what_it_is_built_for():
  kwargs = dict(num_microbatches=2, optimizer=async_tests.SGD)
  layout = LAYOUTS["disjoint"]
  with pytest.raises(ValueError, match="tied params"):
    _round_robin(layout, "gpt_tied", schedule="1f1b", **kwargs)
  with pytest.raises(ValueError, match="weight prediction"):
    _round_robin(layout, "mlp", schedule="async", prediction="msnag", **kwargs)
  with pytest.raises(ValueError, match="1F1B-RR"):
    _round_robin(layout, "mlp", schedule="2bw", **{**kwargs, "step_every": 4})
  with pytest.raises(ValueError, match="unknown replica_routing"):
    _round_robin(layout, "mlp", routing="random", **kwargs)


def test_a_round_robin_group_takes_whole_microbatches():
  """Where ``split`` gives each replica half of every microbatch, round
  robin gives replica b mod r all of microbatch b."""
  pipe, _, _, batch = _round_robin(
    LAYOUTS["disjoint"], "mlp", num_microbatches=4, optimizer=optax.sgd(0.1)
  )
  from jpipe.runtime.build.batches import place_microbatches

  place = pipe.placement[0]
  micro = place_microbatches(jax.tree.leaves(batch), pipe.batch_leaves, 4, 0)
  x_index = jax.tree.leaves(batch).index(batch["x"])
  for b, leaves in micro[place].items():
    x = leaves[x_index]
    assert x.devices() == {place.devices[b % 2]}
    assert jnp.array_equal(x, batch["x"][2 * b : 2 * b + 2])


def test_memory_counts_whole_microbatches_on_each_replica():
  """A round-robin replica keeps its microbatches whole, 1 / r of the
  stage's in flight; split replicas a 1 / r share of every one."""
  layout = LAYOUTS["disjoint"]
  kwargs = dict(
    schedule="gpipe",
    num_microbatches=4,
    optimizer=optax.sgd(0.1),
    fuse_last_stage=False,  # (A fused last stage keeps nothing.)
  )
  rr = _round_robin(layout, "mlp", **kwargs)[0].memory
  split = _round_robin(layout, "mlp", routing="split", **kwargs)[0].memory
  for s, group in enumerate(layout):
    r = len(group)
    assert split[s].in_flight == 4  # GPipe: every microbatch.
    assert rr[s].in_flight == 4 // r
    assert rr[s].kept_per_microbatch == split[s].kept_per_microbatch * r
    assert rr[s].params == split[s].params
