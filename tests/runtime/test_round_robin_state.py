"""PipeDream's 1F1B-RR with model state (BatchNorm statistics): each
replica of a round-robin group keeps its own statistics, updated only by
the microbatches it runs (b on replica b mod k, in microbatch order).

Against an independent restatement: a plain single-device loop over the
microbatches that keeps k copies of a replicated stage's statistics and
runs microbatch b with copy b mod k.
"""

import dataclasses
import types

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jpipe
from jpipe.runtime.execute import replica_state
from tests import jitted
from tests.partition import flax_models
from tests.runtime import test_pipeline_async as async_tests
from tests.runtime.test_pipeline_sync import _assert_tree_close
from tests.runtime.test_replicated_stages import _replicated
from tests.runtime.test_round_robin import _pipedream_reference

LAYOUT = ((0, 1), (2,), (3, 4))  # Stages 0 and 2 two replicas each.
M = 4  # Microbatches of 2 examples.


def _stage_of_leaf(pipe, batch) -> dict:
  """Model-state leaf -> the stage whose forward reads it."""
  nb = len(jax.tree.leaves(batch))
  return {
    i - nb: s
    for s, spec in enumerate(pipe.stages.specs)
    for i in spec.batch_leaves
    if i >= nb
  }


def _reference(loss_fn, params, stats, batch, tx, steps, replicas_of_leaf, m=M):
  """(params, per leaf the list of its replicas' copies) after ``steps``
  synchronous steps of a single-device loop over ``m`` microbatches:
  microbatch b's forward reads and writes copy b mod k of each leaf held
  k times."""
  treedef = jax.tree.structure(stats)
  leaves = jax.tree.leaves(stats)
  copies = [[x] * k for x, k in zip(leaves, replicas_of_leaf, strict=True)]
  opt_state = tx.init(params)
  size = len(batch["x"]) // m
  for _ in range(steps):
    grads = None
    for b in range(m):
      mb = jax.tree.map(lambda x, b=b: x[size * b : size * (b + 1)], batch)
      mine = [c[b % len(c)] for c in copies]
      (_, new), g = jitted.value_and_grad(loss_fn, has_aux=True)(
        params, jax.tree.unflatten(treedef, mine), mb
      )
      for c, x in zip(copies, jax.tree.leaves(new), strict=True):
        c[b % len(c)] = x
      grads = g if grads is None else jax.tree.map(jnp.add, grads, g)
    grads = jax.tree.map(lambda g: g / m, grads)
    updates, opt_state = tx.update(grads, opt_state, params)
    params = optax.apply_updates(params, updates)
  return params, copies


def _pipeline(schedule, **kwargs):
  loss_fn, params, stats, batch = flax_models.resnet_state_case(3, 2 * M)
  pipe = _replicated(
    LAYOUT,
    loss_fn,
    params,
    batch,
    schedule=schedule,
    num_microbatches=M,
    replica_routing="round_robin",
    model_state=stats,
    **kwargs,
  )
  return pipe, loss_fn, params, stats, batch


def _check_replicas(
  pipe, state, copies, replicas_of_leaf, stage_of_leaf, layout=LAYOUT
):
  """Each replica's copy of each leaf equals the reference's, on the
  replica's device; the gathered model state is replica 0's."""
  devices = jax.devices()
  for i, (want, k) in enumerate(zip(copies, replicas_of_leaf, strict=True)):
    got = [state.model_state[i]]
    if k > 1:
      got += list(state.replica_model_state[i])
    assert len(got) == k
    for j, (x, y) in enumerate(zip(got, want, strict=True)):
      np.testing.assert_allclose(x, y, rtol=1e-5, atol=1e-6)
      group = layout[stage_of_leaf[i]]
      if k > 1:
        assert x.devices() == {devices[group[j]]}, (i, j)
  gathered = jax.tree.leaves(pipe.gather_model_state(state))
  for x, c in zip(gathered, copies, strict=True):
    np.testing.assert_allclose(x, c[0], rtol=1e-5, atol=1e-6)


def test_two_replicas_keep_their_own_statistics():
  """The smallest case: 2 stages, stage 0 on two round-robin replicas,
  two microbatches (one each), one step."""
  loss_fn, params, stats, batch = flax_models.resnet_state_case(2, 4)
  layout, tx = ((0, 1), (2,)), optax.sgd(0.1)
  kwargs = dict(
    num_stages=2,
    devices=jax.devices()[:3],
    schedule="gpipe",
    num_microbatches=2,
    optimizer=tx,
    replica_routing="round_robin",
    model_state=stats,
  )
  plain = jpipe.Pipeline(loss_fn, params, batch, **kwargs)
  plan = dataclasses.replace(plain.plan, stage_devices=layout)
  pipe = jpipe.Pipeline(loss_fn, params, batch, partition=plan, **kwargs)
  stage_of_leaf = _stage_of_leaf(pipe, batch)
  replicas = [len(layout[stage_of_leaf[i]]) for i in sorted(stage_of_leaf)]
  assert set(replicas) == {1, 2}
  state, _ = pipe.step(pipe.init(params, stats), batch)
  want_params, copies = _reference(
    loss_fn, params, stats, batch, tx, 1, replicas, m=2
  )
  _assert_tree_close(pipe.gather_params(state), want_params)
  _check_replicas(pipe, state, copies, replicas, stage_of_leaf, layout)


@pytest.mark.slow
def test_sync_round_robin_keeps_each_replicas_statistics():
  tx = optax.sgd(0.1, momentum=0.9)
  pipe, loss_fn, params, stats, batch = _pipeline("1f1b", optimizer=tx)
  stage_of_leaf = _stage_of_leaf(pipe, batch)
  replicas = [len(LAYOUT[stage_of_leaf[i]]) for i in sorted(stage_of_leaf)]
  assert set(replicas) == {1, 2}  # Replicated and unreplicated stages.
  state = pipe.init(params, stats)
  for _ in range(2):
    state, _ = pipe.step(state, batch)
  want_params, copies = _reference(
    loss_fn, params, stats, batch, tx, 2, replicas
  )
  _assert_tree_close(pipe.gather_params(state), want_params)
  _check_replicas(pipe, state, copies, replicas, stage_of_leaf)
  # The replicas' statistics differ (each saw its own microbatches).
  i = replicas.index(2)
  assert not np.allclose(state.model_state[i], state.replica_model_state[i][0])
  # Evaluation reads replica 0's copy on every replica.
  want = np.mean(
    [
      loss_fn(
        want_params,
        jax.tree.unflatten(jax.tree.structure(stats), [c[0] for c in copies]),
        jax.tree.map(lambda x, b=b: x[2 * b : 2 * b + 2], batch),
      )[0]
      for b in range(M)
    ]
  )
  assert float(pipe.evaluate(state, batch)["loss"]) == pytest.approx(
    float(want), rel=1e-5
  )
  # A loaded state: every replica at the saved (replica 0's) statistics.
  again = pipe.load_state_dict(pipe.state_dict(state))
  assert again.replica_model_state == ()
  again, _ = pipe.step(again, batch)
  _, copies = _reference(
    loss_fn,
    want_params,
    jax.tree.unflatten(jax.tree.structure(stats), [c[0] for c in copies]),
    batch,
    tx,
    1,
    replicas,
  )
  for i, c in enumerate(copies):
    np.testing.assert_allclose(again.model_state[i], c[0], rtol=1e-5, atol=1e-5)
    if len(c) > 1:
      np.testing.assert_allclose(
        again.replica_model_state[i][0], c[1], rtol=1e-5, atol=1e-5
      )


def _full_params(pipe, params, used, b):
  """The params pytree whose stage leaves are those F(s, b) used (on
  the host: they live on several devices)."""
  used = jax.device_get({key: used[key] for key in used if key[2] == b})
  leaves = list(jax.tree.leaves(params))
  for s, spec in enumerate(pipe.stages.specs):
    for i, x in zip(spec.param_leaves, used[("F", s, b)], strict=True):
      leaves[i] = x
  return jax.tree.unflatten(jax.tree.structure(params), leaves)


@pytest.mark.slow
def test_async_round_robin_keeps_each_replicas_statistics():
  """Weight stashing's stream: params as PipeDream's per-replica loop
  gives them; each replica's statistics those of its microbatches, in
  order, at the params their forwards used."""
  tx = optax.sgd(0.3, momentum=0.9)
  pipe, loss_fn, params, stats, batch = _pipeline(
    "async", optimizer=tx, weight_stashing=True, record_params=True
  )
  stage_of_leaf = _stage_of_leaf(pipe, batch)
  replicas = [len(LAYOUT[stage_of_leaf[i]]) for i in sorted(stage_of_leaf)]
  state, used = pipe.init(params, stats), {}
  for call in (batch, batch, None):  # Two steps, then the flush.
    if call is None:
      state, metrics = pipe.flush(state)
    else:
      state, metrics = pipe.step(state, call)
    used.update(metrics["used_params"])
  micro = [
    jax.tree.map(lambda x, b=b: x[2 * (b % M) : 2 * (b % M) + 2], batch)
    for b in range(2 * M)
  ]
  # Params: BatchNorm in training normalises by the batch, so gradients
  # do not read the running statistics: PipeDream's loop at the initial
  # ones gives the params.
  wrapped = [{"batch": mb, "state": stats} for mb in micro]
  expected, expected_used = _pipedream_reference(
    pipe, params, wrapped, tx, tuple(len(g) for g in LAYOUT)
  )
  for s in range(pipe.stages.num_stages):
    async_tests._close(state.stage_params[s], expected[s])
  for key, theta in expected_used.items():
    async_tests._close(used[key], theta)
  # Statistics: microbatch b reads and writes copy b mod k, at the params
  # its forwards used.
  treedef = jax.tree.structure(stats)
  leaves = jax.tree.leaves(stats)
  copies = [[x] * k for x, k in zip(leaves, replicas, strict=True)]
  for b, mb in enumerate(micro):
    mine = [np.asarray(c[b % len(c)]) for c in copies]
    mine = jax.tree.unflatten(treedef, mine)
    _, new = loss_fn(_full_params(pipe, params, used, b), mine, mb)
    for c, x in zip(copies, jax.tree.leaves(new), strict=True):
      c[b % len(c)] = x
  _check_replicas(pipe, state, copies, replicas, stage_of_leaf)


def test_a_leaf_shared_with_a_round_robin_stage_is_refused():
  """A model-state leaf held per replica belongs to its round-robin stage
  alone: which leaves are held how many times, and the one-line refusal
  where another stage reads or writes one."""
  spec = lambda batch_leaves, results: types.SimpleNamespace(  # noqa: E731
    batch_leaves=batch_leaves, results=results
  )
  place = lambda k: types.SimpleNamespace(  # noqa: E731
    round_robin=k > 1, devices=tuple(range(k))
  )
  # 2 batch leaves; leaves 0, 1 on stage 0 (3 replicas), 2 on stage 1.
  specs = [spec((0, 2, 3), (1, 2)), spec((1, 4), (0, 3))]
  assert replica_state.round_robin_leaves(specs, [place(3), place(1)], 2) == {
    0: 3,
    1: 3,
  }
  assert replica_state.round_robin_leaves(specs, [place(1), place(2)], 2) == {
    2: 2
  }
  shared = [spec((0, 2), (1,)), spec((1, 2), (0, 1))]  # Leaf 0 on both.
  with pytest.raises(ValueError, match="keep each model state on one stage"):
    replica_state.round_robin_leaves(shared, [place(2), place(1)], 2)
  assert replica_state.round_robin_leaves(shared, [place(1), place(1)], 2) == {}
