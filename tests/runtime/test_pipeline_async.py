"""Asynchronous schedules against a plain simulation of their semantics.

The reference below restates PipeDream/FTPipe's semantics microbatch by
microbatch (``design.md``): stage s of n (w = n - 1 - s warm-up forwards)
runs the forward of microbatch b at the version it has after the steps of
the backwards before b - w, and its backward at the current params (steps
before b), or at the forward's (stashing, or no recomputation); a step
applies the mean gradient of its window. It keeps every version and uses
plain optax / jpipe.staleness calls on tuples of leaves, no driver code.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jpipe
from jpipe import staleness
from tests.partition import flax_models

pytestmark = pytest.mark.usefixtures("fast_compiles")

NUM_STAGES = 3
NUM_MICRO = 6


def _mlp():
  model = flax_models.Mlp(widths=(8, 8, 8, 8, 8, 4))
  x = jax.random.normal(jax.random.key(0), (NUM_MICRO * 2, 6))
  y = jax.random.randint(jax.random.key(1), (NUM_MICRO * 2,), 0, 4)
  params = model.init(jax.random.key(2), x)

  def loss_fn(params, batch):
    logits = model.apply(params, batch["x"])
    return optax.softmax_cross_entropy_with_integer_labels(
      logits, batch["y"]
    ).mean()

  return loss_fn, params, {"x": x, "y": y}


def _reference(pipe, params, batch, tx, opts):
  """New stage params and the params every action used."""
  stages = pipe.stages
  n, num_micro = stages.num_stages, pipe.num_microbatches
  se = opts.get("step_every", 1)
  ws, prediction = opts.get("weight_stashing"), opts.get("prediction")
  ga, recompute = opts.get("gap_aware"), opts.get("recompute", True)
  boundaries = [
    b for b in range(num_micro) if b % se == se - 1 or b == num_micro - 1
  ]
  window = {}
  start = 0
  for b in boundaries:
    for x in range(start, b + 1):
      window[x] = b + 1 - start
    start = b + 1

  def steps_before(x):
    return sum(1 for b in boundaries if b < x)

  txs = [
    staleness.gap_aware(tx, **opts["gap_aware_options"])
    if ga and n - 1 - s != 0
    else tx
    for s in range(n)
  ]
  # Tied params: the first stage reading a leaf owns it; later stages use,
  # for microbatch b, the value the owner's forward of b used, and hand
  # their gradient to the owner's step.
  holders = {}
  for s, spec in enumerate(stages.specs):
    for pos, leaf in enumerate(spec.param_leaves):
      holders.setdefault(leaf, []).append((s, pos))
  replicas = {}  # stage -> [(pos, owner, owner pos)]
  for hs in holders.values():
    for h, pos in hs[1:]:
      replicas.setdefault(h, []).append((pos, *hs[0]))

  def tie(s, theta, fwd):
    theta = list(theta)
    for pos, owner, opos in replicas.get(s, ()):
      theta[pos] = fwd[owner][opos]
    return tuple(theta)

  pending = {}
  grads = {}  # (stage, microbatch) -> the gradient its backward computed
  versions = [[p] for p in stages.split_params(params)]
  states = [[txs[s].init(versions[s][0])] for s in range(n)]
  predictor = staleness.replay_predictor(tx)
  size = jax.tree.leaves(batch)[0].shape[0] // num_micro
  acc = [None] * n
  used = {}
  for b in range(num_micro):
    mb = jax.tree.map(lambda x, b=b: x[b * size : (b + 1) * size], batch)
    local = stages.split_batch(mb)
    values, fwd, inputs = {}, {}, {}
    for s in range(n):
      w = n - 1 - s
      v = steps_before(max(b - w, 0))
      theta = versions[s][v]
      # Steps between F and the step that applies b's gradient.
      delay = boundaries.index(next(x for x in boundaries if x >= b)) - v
      if prediction and delay > 0:
        base = states[s][v]
        if ga and n - 1 - s != 0:
          base = base.inner_state
        grad = None
        if prediction == "aggmsnag":
          # What stage s accumulated before this forward: the backwards
          # since its last step (v steps taken) that 1F1B runs before
          # F(s, b), i.e. of microbatches up to b - w - 1.
          first = boundaries[v - 1] + 1 if v else 0
          done = [grads[(s, x)] for x in range(first, b - w)]
          if done:
            grad = jax.tree.map(lambda *g: sum(g), *done)
        theta = predictor(theta, base, delay, grad=grad)
      theta = tie(s, theta, fwd)
      fwd[s] = theta
      used[("F", s, b)] = theta
      spec = stages.specs[s]
      acts = tuple(values[v_] for v_ in spec.inputs)
      inputs[s] = acts
      outputs, _ = stages.forward(s, theta, local[s], acts)
      values.update(zip(spec.outputs, outputs, strict=True))
    cots = {}
    for s in reversed(range(n)):
      spec = stages.specs[s]
      current = versions[s][steps_before(b)]
      at_forward = ws and ga != "ga_jfl"
      theta = fwd[s] if (at_forward or not recompute) else current
      theta = tie(s, theta, fwd)
      used[("B", s, b)] = theta
      out_cots = tuple(cots.get(v_) for v_ in spec.outputs)
      result_cots = tuple(
        1.0 / window[b] if r == 0 else None for r in spec.results
      )
      g, act_cots = stages.backward(
        s, theta, local[s], inputs[s], out_cots, result_cots
      )
      grads[(s, b)] = g
      for v_, c in zip(spec.inputs, act_cots, strict=True):
        if c is not None:
          cots[v_] = c if v_ not in cots else cots[v_] + c
      acc[s] = g if acc[s] is None else jax.tree.map(jnp.add, acc[s], g)
      if b in boundaries:
        g = list(acc[s])
        for pos, owner, opos in replicas.get(s, ()):
          pending[(owner, opos)] = g[pos]
          g[pos] = jnp.zeros_like(g[pos])  # a replica never steps (SGD)
        for pos in range(len(g)):
          if (s, pos) in pending:
            g[pos] = g[pos] + pending.pop((s, pos))
        acc[s] = tuple(g)
        p, st = versions[s][-1], states[s][-1]
        if txs[s] is tx:
          updates, st = tx.update(acc[s], st, p)
        else:
          updates, st = txs[s].update(acc[s], st, p, stale_params=fwd[s])
        versions[s].append(optax.apply_updates(p, updates))
        states[s].append(st)
        acc[s] = None
  return [v[-1] for v in versions], used


def _build(opts, tx, **kwargs):
  loss_fn, params, batch = _mlp()
  pipe = jpipe.Pipeline(
    loss_fn,
    params,
    batch,
    num_stages=NUM_STAGES,
    devices=jax.devices()[:NUM_STAGES],
    schedule="async",
    num_microbatches=NUM_MICRO,
    optimizer=tx,
    record_params=True,
    **opts,
    **kwargs,
  )
  return pipe, params, batch


def _close(a, b, rtol=2e-5):
  for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
    np.testing.assert_allclose(x, y, rtol=rtol, atol=1e-6)


SGD = optax.sgd(0.3, momentum=0.9)
GA_SGD = {"optimizer": "sgd", "learning_rate": 0.3}

COMBINATIONS = [
  dict(weight_stashing=ws, prediction=wp, gap_aware=ga, recompute=rc)
  for ws in (False, True)
  for wp in (None, "msnag")
  for ga in (None, "ga", "ga_jfl")
  for rc in (True, False)
  if not (ga == "ga_jfl" and not rc)
]


@pytest.mark.parametrize(
  "opts",
  COMBINATIONS,
  ids=lambda o: "-".join(f"{k[:2]}={v}" for k, v in o.items()),
)
def test_async_matches_reference_semantics(opts):
  """Every {ws, wp, ga, ga_jfl} x {recompute, not}: the new params and the
  params each forward and backward used are the reference's."""
  if opts["gap_aware"]:
    opts = dict(opts, gap_aware_options=GA_SGD)
  pipe, params, batch = _build(opts, SGD)
  state = pipe.init(params)
  state, metrics = pipe.step(state, batch)
  expected, used = _reference(pipe, params, batch, SGD, opts)
  for s in range(NUM_STAGES):
    _close(state.stage_params[s], expected[s])
  assert set(pipe.used_params) == set(used)
  for key, theta in used.items():
    _close(pipe.used_params[key], theta)
  assert np.isfinite(float(metrics["loss"]))


def test_async_is_stale_and_delays_follow_pipedream():
  """Stage s's forward of microbatch b runs min(b, n - 1 - s) steps behind
  the step applying it, so early stages see older params than later ones."""
  pipe, params, batch = _build({}, SGD)
  delay = pipe.schedule.delay
  for s in range(NUM_STAGES):
    for b in range(NUM_MICRO):
      assert delay[s, b] == min(b, NUM_STAGES - 1 - s)
  state = pipe.init(params)
  state, _ = pipe.step(state, batch)
  last = NUM_MICRO - 1
  # Stage 0's last forward ran before the steps of the last n-1 backwards.
  stale = pipe.used_params[("F", 0, last)]
  final = state.stage_params[0]
  assert any(not np.allclose(a, b) for a, b in zip(stale, final, strict=True))


def test_step_every_accumulates_windows():
  opts = {"step_every": 2, "weight_stashing": True}
  pipe, params, batch = _build(opts, SGD)
  assert pipe.schedule.step_groups[0] == ((0, 1), (2, 3), (4, 5))
  state = pipe.init(params)
  state, _ = pipe.step(state, batch)
  expected, used = _reference(pipe, params, batch, SGD, opts)
  for s in range(NUM_STAGES):
    _close(state.stage_params[s], expected[s])
  for key, theta in used.items():
    _close(pipe.used_params[key], theta)


@pytest.mark.parametrize("step_every", [2, 3])
def test_aggmsnag_predicts_with_the_accumulated_gradient(step_every):
  """A forward inside a step_every window predicts with the gradient its
  stage accumulated so far (the reference sums the backwards 1F1B ran
  before it); msnag ignores it, so some forwards differ."""
  used = {}
  for kind in ("msnag", "aggmsnag"):
    opts = {"step_every": step_every, "prediction": kind}
    pipe, params, batch = _build(opts, SGD)
    state = pipe.init(params)
    state, _ = pipe.step(state, batch)
    expected, used[kind] = _reference(pipe, params, batch, SGD, opts)
    for s in range(NUM_STAGES):
      _close(state.stage_params[s], expected[s])
    assert set(pipe.used_params) == set(used[kind])
    for key, theta in used[kind].items():
      _close(pipe.used_params[key], theta)
  assert any(
    not all(
      np.allclose(a, b)
      for a, b in zip(used["msnag"][k], used["aggmsnag"][k], strict=True)
    )
    for k in used["msnag"]
    if k[0] == "F"
  )
  # Untied stages step and predict from the packed accumulator directly.
  assert not any(k[0] == "unpack" for k in pipe._backward_fns)


def test_closed_form_predictor_is_scheduler_aware():
  schedule = optax.linear_schedule(0.3, 0.0, 8)
  tx = optax.sgd(schedule, momentum=0.9)
  closed = staleness.weight_predictor(
    "sgd", learning_rate=schedule, momentum=0.9
  )
  used = {}
  for name, kwargs in {
    "replay": {},
    "closed": {"predictor": closed, "learning_rate_schedule": schedule},
  }.items():
    pipe, params, batch = _build({"prediction": "msnag"}, tx, **kwargs)
    state = pipe.init(params)
    pipe.step(state, batch)
    used[name] = pipe.used_params
  # Replay and the closed form agree for SGD (both exact d-step look-ahead
  # with the scheduled future learning rates).
  for key in used["replay"]:
    _close(used["replay"][key], used["closed"][key], rtol=1e-4)


def test_two_bw_is_w_minus_grad_at_previous_version():
  """2BW: W(t+1) = W(t) - lr * grad f(W(t-1)) on each minibatch."""
  loss_fn, params, batch = _mlp()
  lr = 0.3
  pipe = jpipe.Pipeline(
    loss_fn,
    params,
    batch,
    num_stages=NUM_STAGES,
    devices=jax.devices()[:NUM_STAGES],
    schedule="2bw",
    num_microbatches=NUM_MICRO,
    step_every=NUM_STAGES,
    optimizer=optax.sgd(lr),
  )
  state = pipe.init(params)
  state, _ = pipe.step(state, batch)
  minibatch = jax.tree.leaves(batch)[0].shape[0] // 2
  history = [params, params]  # W(-1) := W(0)
  for t in range(2):
    mb = jax.tree.map(
      lambda x, t=t: x[t * minibatch : (t + 1) * minibatch], batch
    )
    # The minibatch's microbatch gradients, averaged (equal sizes).
    g = jax.grad(loss_fn)(history[-2], mb)
    history.append(jax.tree.map(lambda w, g: w - lr * g, history[-1], g))
  _close(pipe.gather_params(state), history[-1], rtol=1e-4)


def test_checkpoint_state_roundtrip_into_another_partition():
  """state_dict is keyed by global paths: a 2-stage pipeline resumes a
  3-stage one's params, optimizer and Gap-Aware state exactly."""
  opts = {
    "weight_stashing": True,
    "gap_aware": "ga",
    "gap_aware_options": GA_SGD,
  }
  pipe3, params, batch = _build(opts, SGD)
  state3 = pipe3.init(params)
  state3, _ = pipe3.step(state3, batch)
  saved = pipe3.state_dict(state3)
  assert saved["step"] == 1
  assert set(saved["gap_aware"]["sq_avg"])  # stages 0, 1 apply GA
  pipe2 = jpipe.Pipeline(
    *_mlp(),
    num_stages=2,
    devices=jax.devices()[:2],
    schedule="1f1b",
    num_microbatches=2,
    optimizer=SGD,
  )
  state2 = pipe2.load_state_dict(saved)
  _close(pipe2.gather_params(state2), pipe3.gather_params(state3))
  again = pipe2.state_dict(state2)
  _close(again["opt_state"], saved["opt_state"])
  # Continuing synchronously equals single-device SGD from the saved state.
  loss_fn, _, _ = _mlp()
  state2, _ = pipe2.step(state2, batch)
  grads = jax.grad(loss_fn)(saved["params"], batch)
  tx_state = jax.tree.map(jnp.asarray, saved["opt_state"])
  flat = dict(
    zip(
      jpipe.runtime._stage_optimizer.leaf_names(params),
      jax.tree.leaves(grads),
      strict=True,
    )
  )
  flat_params = dict(
    zip(
      jpipe.runtime._stage_optimizer.leaf_names(params),
      jax.tree.leaves(saved["params"]),
      strict=True,
    )
  )
  updates, _ = SGD.update(flat, tx_state, flat_params)
  new = optax.apply_updates(flat_params, updates)
  expected = jax.tree.unflatten(
    jax.tree.structure(params),
    [new[k] for k in jpipe.runtime._stage_optimizer.leaf_names(params)],
  )
  _close(pipe2.gather_params(state2), expected)


def test_bad_async_input():
  loss_fn, params, batch = _mlp()
  common = dict(num_stages=2, devices=jax.devices()[:2], optimizer=SGD)
  with pytest.raises(ValueError, match="apply to the asynchronous"):
    jpipe.Pipeline(
      loss_fn, params, batch, schedule="gpipe", weight_stashing=True, **common
    )
  with pytest.raises(ValueError, match="unknown prediction 'nag'"):
    jpipe.Pipeline(
      loss_fn, params, batch, schedule="async", prediction="nag", **common
    )
  with pytest.raises(ValueError, match="needs gap_aware_options"):
    jpipe.Pipeline(
      loss_fn, params, batch, schedule="async", gap_aware="ga", **common
    )
  with pytest.raises(ValueError, match="ga_jfl.*recompute=True"):
    jpipe.Pipeline(
      loss_fn,
      params,
      batch,
      schedule="async",
      gap_aware="ga_jfl",
      gap_aware_options=GA_SGD,
      recompute=False,
      **common,
    )
  with pytest.raises(ValueError, match="gap_aware needs step_every=1"):
    jpipe.Pipeline(
      loss_fn,
      params,
      batch,
      schedule="async",
      gap_aware="ga",
      gap_aware_options=GA_SGD,
      step_every=2,
      **common,
    )


@pytest.mark.parametrize("stashing", [False, True])
def test_async_tied_embedding_follows_its_owner(stashing):
  """GPT with the embedding reused as the head: the last stage uses, for
  each microbatch, the embedding version stage 0's forward used, and its
  gradient joins stage 0's step."""
  loss_fn, params, batch, _ = flax_models.gpt_case()
  batch = jax.tree.map(lambda x: jnp.concatenate([x] * 2), batch)
  opts = {"weight_stashing": stashing}
  pipe = jpipe.Pipeline(
    loss_fn,
    params,
    batch,
    num_stages=3,
    devices=jax.devices()[:3],
    schedule="async",
    num_microbatches=4,
    optimizer=SGD,
    record_params=True,
    **opts,
  )
  assert pipe._replicas  # the head on the last stage is a replica
  state = pipe.init(params)
  state, _ = pipe.step(state, batch)
  expected, used = _reference(pipe, params, batch, SGD, opts)
  for s in range(3):
    _close(state.stage_params[s], expected[s])
  for key, theta in used.items():
    _close(pipe.used_params[key], theta)


def test_async_on_a_mixed_plan_matches_reference():
  """Several stages share a device (FTPipe's mixed pipe): the semantics are
  per stage, so the reference is unchanged."""
  loss_fn, params, batch = _mlp()
  devices = jax.devices()[:2]
  traced = jpipe.partition.trace(loss_fn, params, batch)
  costs = jpipe.partition.profile_nodes(
    traced, params, batch, method="analytic"
  )
  plan = jpipe.partition.plan_traced(traced, costs, 2, method="contiguous")
  # Four stages over two devices, alternating (0, 1, 0, 1).
  bounds = np.linspace(0, traced.num_nodes, 5).astype(int)
  stage_of_node = np.repeat(np.arange(4), np.diff(bounds)).tolist()
  plan = dataclasses.replace(
    plan,
    method="mixed",
    stage_of_node=tuple(stage_of_node),
    stage_devices=((0,), (1,), (0,), (1,)),
  )
  opts = {"weight_stashing": True}
  pipe = jpipe.Pipeline(
    loss_fn,
    params,
    batch,
    num_stages=4,
    devices=devices,
    schedule="async",
    num_microbatches=NUM_MICRO,
    optimizer=SGD,
    partition=plan,
    record_params=True,
    **opts,
  )
  assert pipe.schedule.num_devices == 2
  state = pipe.init(params)
  state, _ = pipe.step(state, batch)
  expected, used = _reference(pipe, params, batch, SGD, opts)
  for s in range(4):
    _close(state.stage_params[s], expected[s])
  for key, theta in used.items():
    _close(pipe.used_params[key], theta)


def test_async_carries_batchnorm_statistics():
  loss_fn, params, stats, batch = flax_models.resnet_state_case(2, 8)
  pipe = jpipe.Pipeline(
    loss_fn,
    params,
    batch,
    num_stages=2,
    devices=jax.devices()[:2],
    schedule="async",
    num_microbatches=4,
    optimizer=SGD,
    weight_stashing=True,
    model_state=stats,
  )
  state = pipe.init(params, stats)
  state, metrics = pipe.step(state, batch)
  new = pipe.gather_model_state(state)
  moved = [
    not np.allclose(a, b)
    for a, b in zip(
      jax.tree.leaves(new),
      jax.tree.leaves(stats),
      strict=True,
    )
  ]
  assert all(moved) and np.isfinite(float(metrics["loss"]))
