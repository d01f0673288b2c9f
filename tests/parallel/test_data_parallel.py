"""P pipelines in data parallel: allreduce = one pipeline on P x the
batch; averaging = the NumPy mean; free-running epochs end and keep
pipelines independent."""

import dataclasses
import threading

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jpipe
from jpipe import parallel
from tests.partition import flax_models


def _close(a, b, atol=1e-6):
  for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
    np.testing.assert_allclose(x, y, rtol=1e-6, atol=atol)


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "async"])
def test_allreduce_equals_one_pipeline_on_the_whole_batch(schedule):
  """P pipelines, each on its shard, = one pipeline whose microbatch k is
  every shard's microbatch k (sync: the mean over all; async: each
  step's gradient)."""
  loss_fn, params, batch, _ = flax_models.mlp_case()
  tx = optax.sgd(0.1, momentum=0.9)
  shards = [batch, jax.tree.map(lambda x: x[::-1], batch)]
  half = batch_size = 4  # per microbatch of a shard

  def micro(t, k):
    return jax.tree.map(lambda x: x[k * half : (k + 1) * half], t)

  whole = jax.tree.map(
    lambda *xs: jnp.concatenate(xs),
    *[micro(shard, k) for k in range(2) for shard in shards],
  )
  options = dict(
    num_stages=2, schedule=schedule, num_microbatches=2, optimizer=tx
  )
  if schedule == "async":
    options["weight_stashing"] = True
  dp = parallel.DataParallelPipelines(
    jpipe.PipelineBuilder.of(loss_fn, params, batch, **options),
    pipelines=2,
    sync="allreduce",
    devices=jax.devices()[:4],
  )
  one = jpipe.Pipeline(
    loss_fn, params, whole, devices=jax.devices()[4:6], **options
  )
  assert one.microbatch_size == 2 * batch_size
  states, state = dp.init(params), one.init(params)
  for _ in range(3):
    states, metrics = dp.step(states, shards)
    state, expected = one.step(state, whole)
    mean_loss = np.mean([float(m["loss"]) for m in metrics])
    assert mean_loss == pytest.approx(float(expected["loss"]), rel=1e-6)
  states, _ = dp.flush(states)
  state, _ = one.flush(state)
  reference = one.gather_params(state)
  for pipe, s in zip(dp.pipelines, states, strict=True):
    _close(pipe.gather_params(s), reference)
  assert dp.pipelines[1].stage_device[0] == jax.devices()[2]  # Disjoint.


def test_group_mean_equals_numpy_mean():
  devices = [jax.devices()[i] for i in (1, 4, 6)]
  rng = np.random.default_rng(0)
  trees = [
    (
      rng.normal(size=(3, 5)).astype(np.float32),
      np.float32(rng.normal()),
      rng.normal(size=(2,)).astype(np.float32),
    )
    for _ in devices
  ]
  placed = [jax.device_put(t, d) for t, d in zip(trees, devices, strict=True)]
  means = parallel.GroupMean()(placed)
  for got, device in zip(means, devices, strict=True):
    for g, *xs in zip(got, *trees, strict=True):
      assert g.devices() == {device}
      np.testing.assert_allclose(g, np.mean(np.stack(xs), axis=0), rtol=1e-6)
  with pytest.raises(ValueError, match="share a device"):
    parallel.GroupMean()([placed[0], placed[0]])


def _free_running(sync, **options):
  loss_fn, params, batch, _ = flax_models.mlp_case()
  return (
    parallel.DataParallelPipelines(
      jpipe.PipelineBuilder.of(
        loss_fn,
        params,
        batch,
        num_stages=2,
        schedule="async",
        weight_stashing=True,
        num_microbatches=2,
        optimizer=optax.sgd(0.05),
      ),
      pipelines=4,
      sync=sync,
      batches_per_epoch=6,
      **options,
    ),
    params,
    batch,
  )


@pytest.mark.parametrize("sync", ["preduce", "adpsgd", "hetpipe", "allreduce"])
def test_epochs_end_and_replicas_sync(sync):
  dp, params, batch = _free_running(
    sync, hetero=parallel.Heterogeneity(hetero=0.01, seed=1)
  )
  assert dp.compile_groups(dp.init(params)) == 2 * len(
    dp.policy.possible_groups()
  )
  states = dp.init(params)
  shards = [
    jax.tree.map(lambda x, p=p: jnp.roll(x, p, axis=0), batch) for p in range(4)
  ]
  states, report = dp.run_epoch(states, lambda p, i: shards[p])
  # The epoch ends once 4 * 6 last-stage steps were taken; each pipeline
  # stops at its next step after that (2 steps per call here).
  assert 24 <= sum(report.steps) <= 24 + 4 * 2 * 2
  sizes = report.mean_group_size
  expected = {"allreduce": 4.0, "adpsgd": 2.0, "hetpipe": 1.0}
  if sync == "preduce":
    assert all(1.0 <= g <= 4.0 for g in sizes)
  else:
    assert sizes == [expected[sync]] * 2
  if sync in ("allreduce", "adpsgd"):  # Lockstep: the same count each.
    assert len(set(report.batches)) == 1
  # One process: the policy's own means are the report's.
  assert dp.policy.mean_group_size() == pytest.approx(sizes)
  dp.reset_statistics()  # Forgets the groups and delays so far.
  assert all(np.isnan(g) for g in dp.policy.mean_group_size())
  assert all(h.delayed_seconds == 0.0 for h in dp.hooks)
  consensus = dp.consensus_params(states)
  assert all(np.isfinite(x).all() for x in jax.tree.leaves(consensus))
  # The same mean averaged stage by stage on the devices, on the first
  # pipeline's stages (nothing gathered): its loss there is the loss at
  # the gathered mean on one device.
  pipe, on_stages = dp.consensus_state(states)
  stages = zip(on_stages.stage_params, states[0].stage_params, strict=True)
  for mean, own in stages:
    assert [x.devices() for x in mean] == [x.devices() for x in own]
  np.testing.assert_allclose(
    float(pipe.evaluate(on_stages, shards[0])["loss"]),
    float(flax_models.mlp_case()[0](consensus, shards[0])),
    rtol=1e-5,
  )
  states, again = dp.run_epoch(states, lambda p, i: shards[p])  # Epoch 2.
  assert sum(again.steps) >= 48


def test_gossip_survives_epochs_that_end_at_different_batches():
  """AD-PSGD's rounds count from each epoch's start. Pipeline 1 ends an
  epoch two steps after pipeline 0 (alone once 0 has left); in the next
  epoch both must meet at their first step (a count across epochs made 0
  wait at its step 3 for a partner that had passed it: a hang)."""
  import threading

  policy = parallel.make_policy("adpsgd", 2, 1, 10)
  devices = jax.devices()[:2]
  policy.place({r: (devices[r],) for r in range(2)})
  trees = [
    jax.device_put(jnp.full((3,), float(r)), devices[r]) for r in range(2)
  ]
  out = {}

  def pipeline(rank, steps):
    for step in steps:
      out[(rank, step)] = policy.params(rank, 0, step, trees[rank], False)
    policy.start_draining(rank, [0])

  def epoch(steps0, steps1):
    threads = [
      threading.Thread(target=pipeline, args=(r, st), daemon=True)
      for r, st in ((0, steps0), (1, steps1))
    ]
    for t in threads:
      t.start()
    for t in threads:
      t.join(timeout=30)
    return not any(t.is_alive() for t in threads)

  policy.new_epoch()
  assert epoch([0, 1, 2], [0, 1, 2, 3, 4])
  policy.new_epoch()
  assert epoch([3, 4], [5, 6]), "the next epoch's pairs never met"
  # Both pairs of the second epoch averaged the two pipelines.
  np.testing.assert_allclose(out[(0, 3)], [0.5] * 3)
  np.testing.assert_allclose(out[(1, 5)], [0.5] * 3)


def test_a_slow_pipeline_does_not_stall_the_others():
  """HetPipe never waits: pipeline 0's devices 5x slower -> it runs
  fewer batches in the epoch while the others go on."""
  # Simulated compute (20 ms per action, 100 ms on the slow devices)
  # dominates the real one on a loaded 2-core machine; the first epoch
  # compiles every pipeline (its compile times, seconds under load, would
  # otherwise decide who runs the most batches).
  slow = parallel.Heterogeneity(base_seconds=0.02, slowdown={0: 5.0, 1: 5.0})
  dp, params, batch = _free_running("hetpipe", hetero=slow)
  states, _ = dp.run_epoch(dp.init(params), lambda p, i: batch)
  states, report = dp.run_epoch(states, lambda p, i: batch)
  assert report.batches[0] < min(report.batches[1:])
  assert report.delayed_seconds[0] > report.delayed_seconds[1]


def test_state_dict_resumes_each_replica_or_their_mean():
  dp, params, batch = _free_running("preduce")
  states = dp.init(params)
  shards = [
    jax.tree.map(lambda x, p=p: jnp.roll(x, p, axis=0), batch) for p in range(4)
  ]
  states, _ = dp.step(states, shards)
  states, _ = dp.flush(states)
  saved = dp.state_dict(states)
  same = dp.load_state_dict(saved)
  for pipe, a, b in zip(dp.pipelines, states, same, strict=True):
    _close(pipe.gather_params(a), pipe.gather_params(b))
  # Saved by 2 pipelines: every pipeline starts from their mean.
  two = {"pipelines": saved["pipelines"][:2]}
  mean = dp.load_state_dict(two)
  expected = jax.tree.map(
    lambda a, b: (a + b) / 2, *(d["params"] for d in two["pipelines"])
  )
  for pipe, s in zip(dp.pipelines, mean, strict=True):
    _close(pipe.gather_params(s), expected)


def test_bad_combinations_are_refused():
  loss_fn, params, batch, _ = flax_models.mlp_case()
  common = dict(num_stages=2, num_microbatches=2, optimizer=optax.sgd(0.1))
  build = jpipe.PipelineBuilder.of(loss_fn, params, batch, **common)
  with pytest.raises(ValueError, match="even number"):
    parallel.DataParallelPipelines(build, pipelines=3, sync="adpsgd")
  with pytest.raises(ValueError, match="unknown sync"):
    parallel.DataParallelPipelines(build, pipelines=2, sync="ring")
  with pytest.raises(ValueError, match="need at least 9 devices"):
    parallel.DataParallelPipelines(build, pipelines=9)
  with pytest.raises(ValueError, match="the builder has devices"):
    parallel.DataParallelPipelines(
      build.with_options(devices=jax.devices()[:2]), pipelines=2
    )
  plan = jpipe.Pipeline(
    loss_fn, params, batch, devices=jax.devices()[:4], **common
  ).plan
  replicated = dataclasses.replace(plan, stage_devices=((0, 1), (2, 3)))
  with pytest.raises(ValueError, match="replicated inside a pipeline"):
    parallel.DataParallelPipelines(
      build.with_options(partition=replicated), pipelines=2
    )


def test_stop_calls_every_process_of_a_pipeline_makes_the_same_calls():
  """``StopCalls`` (an epoch's end for pipelines spanning processes): its
  processes ask before each call, at random paces, and the last stage's
  process fixes the stop at a random moment. Every process of a pipeline
  ends with the same calls, and none had been granted a call past the
  stop (it would wait for a peer that never makes it); in one process
  the stop is at once; ``together`` gives every pipeline one stop."""
  from jpipe.parallel._epoch import StopCalls

  rng = np.random.default_rng(0)
  for trial in range(200):
    together = trial % 2 == 1
    pipelines, processes = 3, [1, 2, 3]  # pipeline p runs in p + 1
    stops = StopCalls(pipelines, together)
    calls = {(p, q): 0 for p in range(pipelines) for q in range(processes[p])}
    done = set()
    decided = {p: False for p in range(pipelines)}
    while len(done) < len(calls):
      p, q = list(calls)[rng.integers(len(calls))]
      if (p, q) in done:
        continue
      if q == 0 and not decided[p] and rng.random() < 0.15:
        stops.stop(p)  # (The last stage's process saw the epoch's end.)
        decided[p] = True
      if stops.grant(p, calls[(p, q)]):
        calls[(p, q)] += 1
      else:
        done.add((p, q))
    for p in range(pipelines):
      made = {calls[(p, q)] for q in range(processes[p])}
      assert made == {stops.stop(p)}
    if together:
      assert len({stops.stop(p) for p in range(pipelines)}) == 1
  # One process: the stop is the calls granted so far.
  stops = StopCalls(1)
  assert stops.grant(0, 0) and stops.grant(0, 1)
  assert stops.stop(0) == 2 and not stops.grant(0, 2)
  stops.new_epoch()
  assert stops.grant(0, 0)


def test_stop_calls_cut_stops_every_pipeline_where_it_is():
  """``StopCalls.cut`` (a stop request from any process): every process of
  a pipeline ends with the same calls, none past the calls granted to the
  pipeline when the cut came (at least one), or its own earlier stop;
  ``together``: one stop for all."""
  from jpipe.parallel._epoch import StopCalls

  rng = np.random.default_rng(1)
  for trial in range(200):
    together = trial % 2 == 1
    pipelines, processes = 3, [1, 2, 3]  # pipeline p runs in p + 1
    stops = StopCalls(pipelines, together)
    calls = {(p, q): 0 for p in range(pipelines) for q in range(processes[p])}
    done, granted_at_cut, stopped_before = set(), None, {}
    while len(done) < len(calls):
      p, q = list(calls)[rng.integers(len(calls))]
      if (p, q) in done:
        continue
      if granted_at_cut is None and rng.random() < 0.05:
        granted_at_cut = list(stops._granted)
        stopped_before = dict(stops._stops)
        stops.cut()
      elif q == 0 and p not in stops._stops and rng.random() < 0.02:
        stops.stop(p)  # (A natural end, before or after the cut.)
      if stops.grant(p, calls[(p, q)]):
        calls[(p, q)] += 1
      else:
        done.add((p, q))
    for p in range(pipelines):
      made = {calls[(p, q)] for q in range(processes[p])}
      assert made == {stops.stop(p)} and stops.stop(p) >= 1
      if granted_at_cut is not None and p in stopped_before:
        assert stops.stop(p) == stopped_before[p]
      elif granted_at_cut is not None and not together:
        assert stops.stop(p) == max(1, granted_at_cut[p])
    if together:
      assert len({stops.stop(p) for p in range(pipelines)}) == 1
      if granted_at_cut is not None and not stopped_before:
        assert stops.stop(0) == max(1, *granted_at_cut)
  stops = StopCalls(2)  # A cut before any call: one call each.
  stops.cut()
  assert stops.grant(0, 0) and not stops.grant(0, 1)
  assert stops.grant(1, 0) and not stops.grant(1, 1)
  stops.new_epoch()  # Cuts one epoch only.
  assert all(stops.grant(0, c) for c in range(5))


@pytest.mark.parametrize("sync", ["preduce", "allreduce"])
def test_a_stop_request_cuts_the_epoch_short_and_the_rest_follows(sync):
  """``run_epoch(stop_requested=...)``: once it is true, every pipeline
  stops after its calls under way (an epoch of 4 x 50 steps ends after a
  few), the report says so and the states are drained; the next epoch,
  of the rest's length (``batches=3``), ends after 4 x 3 calls' steps."""
  dp, params, batch = _free_running(sync)
  dp.batches_per_epoch = 100  # (Steps: 2 per call, 50 calls a pipeline.)
  calls = []

  def batch_at(p, i):
    calls.append(p)
    return batch

  states, report = dp.run_epoch(
    dp.init(params), batch_at, stop_requested=lambda: len(calls) >= 4
  )
  assert report.cut_short
  assert all(b >= 1 for b in report.batches)
  assert sum(report.batches) <= 4 + 4 * 2  # (Each: its calls under way.)
  assert all(not s.in_flight or s.in_flight.drained for s in states)
  before = sum(report.steps)
  states, rest = dp.run_epoch(states, batch_at, batches=3 * 2)
  assert not rest.cut_short
  assert 4 * 3 * 2 <= sum(rest.steps) - before <= 4 * 3 * 2 + 4 * 2 * 2


def test_peer_mean_is_the_mean_and_the_same_bits_on_every_member():
  """``PeerMean`` (averaging where pipelines span processes): every
  member's copy is the NumPy mean of the group's trees, on the member's
  device, and the copies are bit-identical (summed in rank order
  everywhere). Its transfer keys are the same in every process and
  differ by meeting, member and receiver."""
  from jpipe.parallel._averaging import _uuid

  devices = {r: jax.devices()[r] for r in range(3)}
  rng = np.random.default_rng(0)
  hosts = [
    (rng.normal(size=(5, 3)).astype(np.float32), np.float32(rng.normal()))
    for _ in range(3)
  ]
  trees = [jax.device_put(h, devices[r]) for r, h in enumerate(hosts)]
  out = parallel.PeerMean(links=None)(
    ("k", 0), trees, [0, 1, 2], (0, 1, 2), devices
  )
  for r, tree in enumerate(out):
    assert {d for x in tree for d in x.devices()} == {devices[r]}
    for j, got in enumerate(tree):
      want = np.mean([h[j] for h in hosts], axis=0)
      np.testing.assert_allclose(got, want, rtol=1e-6)
      assert np.array_equal(np.asarray(got), np.asarray(out[0][j]))
  keys = {
    _uuid(("k", e), m, q) for e in range(3) for m in range(4) for q in range(2)
  }
  assert len(keys) == 24 and all(0 <= k < 2**62 for k in keys)
  assert _uuid(("k", 0), 1, 0) == _uuid(("k", 0), 1, 0)


def test_stage_placement_puts_a_stage_of_every_pipeline_in_a_block():
  """``placement="stage"``: with 4 pipelines of 2 devices, block s (4
  devices: one process per stage under the launcher) holds every
  pipeline's s-th device; "pipeline" keeps them consecutive."""
  from jpipe.parallel._pipelines import _placed

  devices = list(range(8))
  by_stage = _placed(devices, 4, 2, "stage")
  assert [by_stage[2 * p : 2 * p + 2] for p in range(4)] == [
    [0, 4],
    [1, 5],
    [2, 6],
    [3, 7],
  ]
  assert _placed(devices, 4, 2, "pipeline") == devices
  with pytest.raises(ValueError, match="unknown placement 'rows'"):
    _placed(devices, 4, 2, "rows")


@pytest.mark.parametrize("sync", ["preduce", "allreduce"])
def test_a_failing_pipeline_aborts_and_the_others_stop_waiting(sync):
  """Pipeline 1's step fails (a batch of the wrong shape) while the
  others wait to average with it: the policy's ``abort`` releases them
  and the error reaches the caller (no hang)."""
  dp, params, batch = _free_running(sync)
  states = dp.init(params)
  bad = jax.tree.map(lambda x: x[:, :1] if x.ndim > 1 else x, batch)
  batches = [batch, bad, batch, batch]
  raised = []

  def call():
    try:
      dp.step(states, batches)
    except Exception as e:  # The caller's error: pipeline 1's.
      raised.append(e)

  thread = threading.Thread(target=call, daemon=True)
  thread.start()
  thread.join(120)
  assert not thread.is_alive(), "the other pipelines still wait for rank 1"
  assert len(raised) == 1


def test_state_dicts_keep_typed_prng_keys_in_model_state():
  """NNX RNG streams (typed keys) as model state: the state dict holds
  each pipeline's keys as their key data (a state dict holds arrays);
  resumed from fewer pipelines, the mean of floating leaves takes the
  first pipeline's keys and counts as they are (a key has no mean), and
  they are keys again."""
  loss_fn, params, model_state, batch = flax_models.nnx_dropout_case()
  dp = parallel.DataParallelPipelines(
    jpipe.PipelineBuilder.of(
      loss_fn,
      params,
      batch,
      num_stages=2,
      num_microbatches=2,
      optimizer=optax.sgd(0.05),
      model_state=model_state,
    ),
    pipelines=2,
    sync="allreduce",
  )
  states = dp.init(params, model_state)
  flipped = jax.tree.map(lambda x: x[::-1], batch)
  states, _ = dp.step(states, [batch, flipped])
  saved = dp.state_dict(states)
  typed = [
    jpipe.runtime.is_key(x)
    for x in jax.tree.leaves(dp.pipelines[0].gather_model_state(states[0]))
  ]
  keys = [
    [
      x
      for x, k in zip(jax.tree.leaves(d["model_state"]), typed, strict=True)
      if k
    ]
    for d in saved["pipelines"]
  ]
  assert len(keys[0]) == 4  # One stream per Dropout.
  assert all(np.asarray(x).dtype == np.uint32 for x in keys[0])  # Key data.
  one = {"pipelines": saved["pipelines"][:1]}
  for pipe, s in zip(dp.pipelines, dp.load_state_dict(one), strict=True):
    got = [
      x
      for x in jax.tree.leaves(pipe.gather_model_state(s))
      if jpipe.runtime.is_key(x)
    ]
    for a, b in zip(got, keys[0], strict=True):
      np.testing.assert_array_equal(jax.random.key_data(a), b)
  dp.close()


def test_a_failed_average_fails_every_member_instead_of_hanging():
  """Two pipelines' threads meet to average a stage; the combine run by
  the last to arrive raises: it re-raises, and the member already waiting
  raises too (it once waited forever: a stage whose params are all
  frozen had nothing to average, and the run hung)."""
  from jpipe.parallel._averaging import Rendezvous

  rendezvous = Rendezvous()
  errors = {}

  def combine(trees, came):
    raise ValueError("no arrays to average")

  def member(rank):
    try:
      rendezvous.meet(("sync", 1), 0, (0, 1), rank, {}, combine, (0, 1))
    except Exception as e:  # noqa: BLE001 (Recorded, checked below.)
      errors[rank] = e

  threads = [
    threading.Thread(target=member, args=(r,), daemon=True) for r in (0, 1)
  ]
  for t in threads:
    t.start()
  for t in threads:
    t.join(timeout=30)
  assert not any(t.is_alive() for t in threads)
  kinds = sorted(type(e).__name__ for e in errors.values())
  assert kinds == ["RuntimeError", "ValueError"]
  waiting = next(e for e in errors.values() if isinstance(e, RuntimeError))
  assert "failed in another pipeline's thread" in str(waiting)
