"""Asynchronous schedules against a plain simulation of their semantics.

The reference below restates PipeDream/FTPipe's semantics microbatch by
microbatch (``design.md``): stage s of n (w = n - 1 - s warm-up forwards)
runs the forward of microbatch b at the version it has after the steps of
the backwards before b - w, and its backward at the current params (steps
before b), or at the forward's (stashing, or no recomputation); a step
applies the mean gradient of its window. It keeps every version and uses
plain optax / jpipe.staleness calls on tuples of leaves, no driver code.
"""

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jpipe
from jpipe import staleness
from tests import jitted
from tests.partition import flax_models
from tests.tiers import slow

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


def mlp_pipeline(schedule, optimizer, num_devices, **options):
  """``_mlp``'s model as a Pipeline on the first ``num_devices`` devices
  (``options``: the Pipeline's own); returns (pipe, params, batch)."""
  loss_fn, params, batch = _mlp()
  pipe = jpipe.Pipeline(
    loss_fn,
    params,
    batch,
    devices=jax.devices()[:num_devices],
    schedule=schedule,
    num_microbatches=NUM_MICRO,
    optimizer=optimizer,
    **options,
  )
  return pipe, params, batch


def _reference(pipe, params, streams, tx, opts):
  """Final stage params and, per stream, the params every action used.

  ``streams``: lists of microbatches (dicts), one list per stream (a
  flush ends each). Within a stream, stage s of n (w = n - 1 - s warm-up
  forwards, k = step_every) runs F(b) at the version after its steps over
  the backwards before b - w (2BW: after max(b // k - 1, 0) steps) and
  B(b) at the current params (steps over the backwards before b), or at
  F's (stashing, 2BW, no recomputation); its j-th step applies the mean
  gradient of microbatches j k .. j k + k - 1 (a flush: those left).
  Call boundaries do not appear: the pipeline must not depend on them.
  """
  stages = pipe.stages
  n = stages.num_stages
  se = opts.get("step_every", 1)
  two_bw = opts.get("schedule") == "2bw"
  ws, prediction = opts.get("weight_stashing"), opts.get("prediction")
  ga, recompute = opts.get("gap_aware"), opts.get("recompute", True)
  # FTPipe's options: a delay-0 forward predicted one step ahead; the last
  # stage's own optimizer and no prediction there; a short window's sum
  # over step_every, its update times r / step_every.
  # FTPipe's virtual_stages_1f1b: stage s's warm-up is its virtual depth
  # (restated as FTPipe's recursion over the depth d = n - 1 - s).
  warmups = [n - 1 - s for s in range(n)]
  if opts.get("supremum_staleness") is not None:
    vd = {n: min(n, opts["supremum_staleness"] - 1)}
    for d in reversed(range(n)):
      vd[d] = max(0, vd[d + 1] - 1)
    warmups = [vd[n - 1 - s] for s in range(n)]
  nag = opts.get("nag_with_predictor", False)
  last_tx = opts.get("last_stage_optimizer")
  ftpipe_window = opts.get("partial_window") == "ftpipe"
  # FTPipe's Gap-Aware stage policies, by depth, restated.
  applies_ga = {
    "all_except_last": lambda depth: depth != 0,
    "almost_last_partition": lambda depth: depth == 1,
    "all_except_last_two": lambda depth: depth >= 2,
  }[opts.get("gap_aware_policy", "all_except_last")]
  # ga_from_grad: no stale params, the step's delay (FTPipe's from_grad).
  from_grad = ga == "ga_from_grad"
  txs = [
    staleness.gap_aware(tx, **opts["gap_aware_options"], gap_from_grad=True)
    if from_grad and applies_ga(n - 1 - s)
    else staleness.gap_aware(tx, **opts["gap_aware_options"])
    if ga and applies_ga(n - 1 - s)
    else tx
    for s in range(n)
  ]
  if last_tx is not None:
    txs[n - 1] = last_tx
  # Delay corrections: each stage's optimizer from its delay (its warm-up
  # forwards, step_every 1); PipeMare's rate rescheduling after it.
  for s in range(n):
    if opts.get("stage_optimizer") is not None:
      txs[s] = opts["stage_optimizer"](warmups[s], n)
    if opts.get("pipemare_anneal_steps") is not None:
      txs[s] = optax.chain(
        txs[s],
        staleness.pipemare_learning_rate(
          warmups[s], opts["pipemare_anneal_steps"]
        ),
      )
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

  # (Jitted, as the stage functions below: the same arithmetic, and an
  # op-by-op reference cost the suite more than the pipelines it checks.)
  predictor = jax.jit(staleness.replay_predictor(tx))
  updaters = [jax.jit(t.update) for t in txs]
  current = stages.split_params(params)
  state = [txs[s].init(current[s]) for s in range(n)]
  used_per_stream = []
  for stream in streams:
    num = len(stream)
    versions = [[p] for p in current]
    states = [[st] for st in state]
    window = {b: min(se, num - b // se * se) for b in range(num)}
    pending, grads, acc, used, delays = {}, {}, [None] * n, {}, {}
    for b, mb in enumerate(stream):
      local = stages.split_batch(mb)
      values, fwd, inputs = {}, {}, {}
      for s in range(n):
        w = warmups[s]
        v = max(b // se - 1, 0) if two_bw else max(b - w, 0) // se
        theta = versions[s][v]
        delay = b // se - v  # steps until the one applying b
        delays[(s, b)] = delay
        if nag and delay == 0:
          delay = 1
        if last_tx is not None and s == n - 1:
          delay = 0  # Not predicted.
        if prediction and delay > 0:
          base = states[s][v]
          if ga and applies_ga(n - 1 - s):
            base = base.inner_state
          grad = None
          if prediction == "aggmsnag":
            # What stage s accumulated before this forward: the backwards
            # since its last step that 1F1B ran before F(s, b).
            done = [grads[(s, x)] for x in range(v * se, b - w)]
            if done:
              grad = jax.tree.map(lambda *g: sum(g), *done)
          theta = predictor(theta, base, delay, grad=grad)
        theta = tie(s, theta, fwd)
        fwd[s] = theta
        used[("F", s, b)] = theta
        spec = stages.specs[s]
        acts = tuple(values[v_] for v_ in spec.inputs)
        inputs[s] = acts
        outputs, _ = stages.jitted("forward", s)(theta, local[s], acts)
        values.update(zip(spec.outputs, outputs, strict=True))
      cots = {}
      for s in reversed(range(n)):
        spec = stages.specs[s]
        at_forward = two_bw or (ws and ga != "ga_jfl") or not recompute
        theta = fwd[s] if at_forward else versions[s][b // se]
        theta = tie(s, theta, fwd)
        used[("B", s, b)] = theta
        out_cots = tuple(cots.get(v_) for v_ in spec.outputs)
        result_cots = tuple(
          (1.0 / se if ftpipe_window else 1.0 / window[b]) if r == 0 else None
          for r in spec.results
        )
        g, act_cots = stages.jitted("backward", s)(
          theta, local[s], inputs[s], out_cots, result_cots
        )
        grads[(s, b)] = g
        for v_, c in zip(spec.inputs, act_cots, strict=True):
          if c is not None:
            cots[v_] = c if v_ not in cots else cots[v_] + c
        acc[s] = g if acc[s] is None else jax.tree.map(jnp.add, acc[s], g)
        if b % se == se - 1 or b == num - 1:  # The window closes.
          g = list(acc[s])
          for pos, owner, opos in replicas.get(s, ()):
            pending[(owner, opos)] = g[pos]
            g[pos] = jnp.zeros_like(g[pos])  # a replica never steps (SGD)
          for pos in range(len(g)):
            if (s, pos) in pending:
              g[pos] = g[pos] + pending.pop((s, pos))
          p, st = versions[s][-1], states[s][-1]
          if from_grad and applies_ga(n - 1 - s):
            updates, st = updaters[s](tuple(g), st, p, delay=delays[(s, b)])
          elif ga and applies_ga(n - 1 - s):
            updates, st = updaters[s](tuple(g), st, p, stale_params=fwd[s])
          else:
            updates, st = updaters[s](tuple(g), st, p)
          if ftpipe_window:
            r = window[b] / se
            updates = jax.tree.map(lambda u, r=r: u * r, updates)
          versions[s].append(optax.apply_updates(p, updates))
          states[s].append(st)
          acc[s] = None
    current = [v[-1] for v in versions]
    state = [st[-1] for st in states]
    used_per_stream.append(used)
  return current, used_per_stream


def _microbatches(batch, size):
  """A batch's microbatches of ``size`` examples (dicts)."""
  total = jax.tree.leaves(batch)[0].shape[0]
  return [
    jax.tree.map(lambda x, b=b: x[b : b + size], batch)
    for b in range(0, total, size)
  ]


def _run_calls(pipe, state, batch, calls, after_call=None):
  """Runs ``calls`` (microbatch counts, or "flush") on consecutive
  microbatches of ``batch`` (``after_call()`` after each step call, if
  given). Returns
  (state, every call's metrics, the microbatches of each stream, the
  params each stream's actions used)."""
  pool = _microbatches(batch, pipe.microbatch_size)
  streams, used, all_metrics, start = [[]], [{}], [], 0
  for call in calls:
    if call == "flush":
      state, metrics = pipe.flush(state)
      streams.append([])
    else:
      mbs = pool[start : start + call]
      start += call
      joined = jax.tree.map(lambda *x: jnp.concatenate(x), *mbs)
      state, metrics = pipe.step(state, joined)
      streams[-1].extend(mbs)
      if after_call is not None:
        after_call()
    used[-1].update(metrics.get("used_params", {}))
    if call == "flush":
      used.append({})
    all_metrics.append(metrics)
  if not streams[-1]:
    streams.pop()
    used.pop()
  return state, all_metrics, streams, used


def _mlp_data(num_microbatches, seed=5):
  """Distinct examples for ``num_microbatches`` microbatches of 2."""
  k1, k2 = jax.random.split(jax.random.key(seed))
  size = 2 * num_microbatches
  return {
    "x": jax.random.normal(k1, (size, 6)),
    "y": jax.random.randint(k2, (size,), 0, 4),
  }


def _build(opts, tx, **kwargs):
  loss_fn, params, batch = _mlp()
  opts = dict(opts)
  pipe = jpipe.Pipeline(
    loss_fn,
    params,
    batch,
    num_stages=kwargs.pop("num_stages", NUM_STAGES),
    devices=kwargs.pop("devices", jax.devices()[:NUM_STAGES]),
    schedule=opts.pop("schedule", "async"),
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


def _check_against_reference(pipe, params, tx, opts, calls, data=None):
  """Runs ``calls`` and compares the final params and every action's
  params with the reference; returns the calls' metrics."""
  if data is None:
    data = _mlp_data(sum(c for c in calls if c != "flush"))
  state = pipe.init(params)
  state, metrics, streams, used = _run_calls(pipe, state, data, calls)
  expected, expected_used = _reference(pipe, params, streams, tx, opts)
  for s in range(pipe.stages.num_stages):
    _close(state.stage_params[s], expected[s])
  assert len(used) == len(expected_used)
  for got, want in zip(used, expected_used, strict=True):
    assert set(got) == set(want)
    for key, theta in want.items():
      _close(got[key], theta)
  return metrics


SGD = optax.sgd(0.3, momentum=0.9)
GA_SGD = {"optimizer": "sgd", "learning_rate": 0.3}

# Three streams of calls with different microbatch counts: 2 + 5 + 3, a
# flush, 4, a flush, 1 + 2 (fewer than the warm-up), a flush.
CALLS = (2, 5, 3, "flush", 4, "flush", 1, 2, "flush")

COMBINATIONS = [
  dict(weight_stashing=ws, prediction=wp, gap_aware=ga, recompute=rc)
  for ws in (False, True)
  for wp in (None, "msnag")
  for ga in (None, "ga", "ga_jfl")
  for rc in (True, False)
  # (Without recomputation and without stashing the backward is not a
  # recomputed one at any params: tests/runtime/test_no_recompute.py.)
  if rc or (ws and ga != "ga_jfl")
]


# Every pair of two options' values, in 6 of the 16 (the default tier);
# the other 10 in the slow tier.
ALL_PAIRS = [
  (False, None, None, True),
  (False, "msnag", "ga", True),
  (False, None, "ga_jfl", True),
  (True, "msnag", "ga_jfl", True),
  (True, None, "ga", False),
  (True, "msnag", None, False),
]


def _combination(opts):
  return pytest.param(
    opts,
    id="-".join(f"{k[:2]}={v}" for k, v in opts.items()),
    marks=() if tuple(opts.values()) in ALL_PAIRS else pytest.mark.slow,
  )


def test_the_default_tiers_combinations_hold_every_pair():
  """``ALL_PAIRS`` (run in the default tier): every value pair of any two
  options that ``COMBINATIONS`` holds, and only combinations it holds."""
  every = [tuple(o.values()) for o in COMBINATIONS]
  assert set(ALL_PAIRS) <= set(every)
  for i, j in itertools.combinations(range(4), 2):
    want = {(c[i], c[j]) for c in every}
    assert {(c[i], c[j]) for c in ALL_PAIRS} == want, (i, j)


@pytest.mark.parametrize("opts", [_combination(o) for o in COMBINATIONS])
def test_async_streams_like_the_reference(opts):
  """Every {ws, wp, ga, ga_jfl} x {recompute, not}, streaming over calls
  of different sizes and flushes: the new params and the params each
  forward and backward used are the never-flushed reference's."""
  if opts["gap_aware"]:
    opts = dict(opts, gap_aware_options=GA_SGD)
  pipe, params, _ = _build(opts, SGD)
  metrics = _check_against_reference(pipe, params, SGD, opts, CALLS)
  for call, m in zip(CALLS, metrics, strict=True):
    assert ("loss" in m) == (call != "flush")
    if call != "flush":
      assert np.isfinite(float(m["loss"]))


@pytest.mark.parametrize("prediction", [None, "msnag"])
def test_gap_aware_from_grad_streams_like_the_reference(prediction):
  """FTPipe's Gap-Aware without a stash on its almost-last stage (delay
  1): the gap estimated from the gradient at the step's delay (0 in a
  stream's first steps, after each flush), no forward params kept."""
  opts = dict(
    gap_aware="ga_from_grad",
    gap_aware_options=GA_SGD,
    gap_aware_policy="almost_last_partition",
    prediction=prediction,
  )
  unrecorded, _, _ = mlp_pipeline(
    "async", SGD, NUM_STAGES, num_stages=NUM_STAGES, **opts
  )
  assert not unrecorded.driver.policy.keeps_forward_params
  pipe, params, _ = _build(opts, SGD)
  _check_against_reference(pipe, params, SGD, opts, CALLS)
  # The estimate acted: the exact gap ('ga') ends elsewhere.
  exact, _, _ = _build(dict(opts, gap_aware="ga"), SGD)
  data = _mlp_data(sum(c for c in CALLS if c != "flush"))
  ends = [
    _run_calls(p, p.init(params), data, CALLS)[0].stage_params[NUM_STAGES - 2]
    for p in (pipe, exact)
  ]
  assert not all(
    np.allclose(a, b, atol=1e-6)
    for a, b in zip(*map(jax.tree.leaves, ends), strict=True)
  )


def test_gap_aware_from_grad_is_refused_where_it_cannot_estimate():
  """On a stage 2+ steps late, beside a stash (the exact gap is free)
  and for AdamW: one line each, naming the fix."""
  base = dict(gap_aware="ga_from_grad", gap_aware_options=GA_SGD)
  with pytest.raises(ValueError, match="on a stage 2 steps late: use "):
    _build(base, SGD)
  with pytest.raises(ValueError, match="the stash gives the exact gap"):
    _build(dict(base, weight_stashing=True), SGD)
  adamw = {"optimizer": "adamw", "learning_rate": 0.3}
  with pytest.raises(ValueError, match="FTPipe has none for AdamW"):
    _build(dict(base, gap_aware_options=adamw), optax.adamw(0.3))


FTPIPE_OPTIONS = {
  "nag": dict(prediction="msnag", nag_with_predictor=True),
  "nag-aggmsnag-ws": dict(
    prediction="aggmsnag", nag_with_predictor=True, weight_stashing=True
  ),
  "nesterov-last": dict(
    prediction="msnag",
    nag_with_predictor=True,
    last_stage_optimizer=optax.sgd(0.3, momentum=0.9, nesterov=True),
  ),
  "partial-ftpipe": dict(step_every=2, partial_window="ftpipe"),
  "partial-mean": dict(step_every=2, partial_window="mean"),
}

# The newer delay corrections (issue 34): PipeMare's rate rescheduling and
# the delay-aware Nesterov method's per-stage momentum, with stashing as
# their authors run them.
DELAY_CORRECTIONS = {
  "pipemare": dict(weight_stashing=True, pipemare_anneal_steps=4),
  "pipemare-recompute": dict(pipemare_anneal_steps=3),
  "nesterov-adaptive": dict(
    weight_stashing=True,
    stage_optimizer=lambda d, n: staleness.delay_aware_nesterov(
      0.3, delay=d, num_stages=n, optimizer="sgd", momentum=0.5, adaptive=True
    ),
  ),
}


@pytest.mark.parametrize("name", list(DELAY_CORRECTIONS))
@pytest.mark.slow
def test_delay_corrections_stream_like_the_reference(name):
  """Each stage steps with its own delay's optimizer, over calls and
  flushes; and the run differs from the uncorrected one."""
  opts = DELAY_CORRECTIONS[name]
  pipe, params, _ = _build(opts, SGD)
  _check_against_reference(pipe, params, SGD, opts, CALLS)
  base = {k: v for k, v in opts.items() if k == "weight_stashing"}
  assert np.abs(_final_params(opts) - _final_params(base)).max() > 1e-5


def test_delay_corrections_are_checked():
  with pytest.raises(ValueError, match="prediction replays"):
    _build(dict(prediction="msnag", pipemare_anneal_steps=5), SGD)
  for k in (0, 1):  # (1 rescheduled nothing.)
    with pytest.raises(ValueError, match="int >= 2"):
      _build(dict(pipemare_anneal_steps=k), SGD)
  with pytest.raises(ValueError, match="apply to the asynchronous"):
    _build(dict(schedule="1f1b", pipemare_anneal_steps=5), SGD)
  with pytest.raises(ValueError, match="one optimizer family"):
    _build(
      dict(stage_optimizer=lambda d, n: optax.adam(1e-3) if d else SGD), SGD
    )


@pytest.mark.parametrize(
  "name", [slow("nag"), *list(FTPIPE_OPTIONS)[1:]]
)  # (nag: also in nag-aggmsnag-ws and nesterov-last.)
def test_ftpipe_options_stream_like_the_reference(name):
  """FTPipe's nag_with_predictor, nesterov_set_for_last_partition and
  partial step_every windows (lr x r / se), over calls and flushes that
  cut windows short."""
  opts = FTPIPE_OPTIONS[name]
  pipe, params, _ = _build(opts, SGD)
  _check_against_reference(pipe, params, SGD, opts, CALLS)


def _final_params(opts):
  """The stage params, flattened, after ``CALLS`` under ``opts`` (SGD)."""
  pipe, params, _ = _build(opts, SGD)
  state = pipe.init(params)
  data = _mlp_data(sum(c for c in CALLS if c != "flush"))
  state, _, _, _ = _run_calls(pipe, state, data, CALLS)
  return np.concatenate(
    [np.ravel(x) for x in jax.tree.leaves(state.stage_params)]
  )


@pytest.mark.slow
def test_ftpipe_options_change_the_run():
  """Each option is used: the run differs from the one without it."""

  # (nag and nesterov-last share their base: msnag alone.)
  without = {"nag_with_predictor", "last_stage_optimizer", "partial_window"}
  bases = {}
  for name in ("nag", "nesterov-last", "partial-ftpipe"):
    opts = FTPIPE_OPTIONS[name]
    base = {k: v for k, v in opts.items() if k not in without}
    key = repr(sorted(base.items()))
    if key not in bases:
      bases[key] = _final_params(base)
    assert np.abs(_final_params(opts) - bases[key]).max() > 1e-5, name


def _measured_delays(lists, num_stages, fed):
  """Per stage, per microbatch: the steps of that stage between its
  forward and the step applying its gradient, counted in the device
  action lists the pipeline runs (step every backward)."""
  delays = []
  for s in range(num_stages):
    own = [a for acts in lists.device_actions for a in acts if a.stage == s]
    order = {(a.kind, a.microbatch): i for i, a in enumerate(own)}
    row = []
    for b in range(fed):
      if ("S", b) not in order:  # Still in flight after the call.
        break
      start, end = order[("F", b)], order[("S", b)]
      row.append(sum(a.kind == "S" for a in own[start:end]))
    delays.append(row)
  return delays


@pytest.mark.parametrize("supremum", [2, 3, 4])
def test_mixed_pipe_delays_follow_ftpipes_virtual_depth(supremum):
  """6 stages on 3 devices (a mixed pipe), async under
  supremum_staleness S: every microbatch's delay on stage s, counted in
  the action lists the pipeline runs, is FTPipe's virtual depth
  max(0, min(6, S - 1) - 1 - s) after the warm-up, not 5 - s; and the
  trained params and every action's params are the reference's with
  those delays."""
  loss_fn, params, batch = _mlp()
  traced = jpipe.partition.trace(loss_fn, params, batch)
  costs = jpipe.partition.profile_nodes(
    traced, params, batch, method="analytic"
  )
  plan = jpipe.partition.plan_from_boundaries(
    traced, costs, range(7), devices=[0, 1, 2, 0, 1, 2]
  )
  opts = {"supremum_staleness": supremum}
  pipe, params, _ = _build(
    opts, SGD, partition=plan, num_stages=6, devices=jax.devices()[:3]
  )
  want = [max(0, min(6, supremum - 1) - 1 - s) for s in range(6)]
  assert pipe.schedule.warmups == tuple(want)
  delays = _measured_delays(pipe.calls(0, 12).lists, 6, 12)
  for s in range(6):  # (The last w_s microbatches are still in flight.)
    assert delays[s] == [min(b, want[s]) for b in range(12 - want[s])], s
  _check_against_reference(pipe, params, SGD, opts, (2, 5, 3, "flush"))
  # "auto": the pipeline's devices (3).
  auto, _, _ = _build(
    {"supremum_staleness": "auto"},
    SGD,
    partition=plan,
    num_stages=6,
    devices=jax.devices()[:3],
  )
  assert auto.schedule.warmups == (1, 0, 0, 0, 0, 0)


@pytest.mark.parametrize(
  "policy", ["almost_last_partition", "all_except_last_two"]
)
@pytest.mark.slow
def test_gap_aware_policies_stream_like_the_reference(policy):
  """FTPipe's other two Gap-Aware stage policies (all_except_last: the
  combinations above): the stages they name apply it, the others not."""
  opts = dict(
    gap_aware="ga",
    gap_aware_options=GA_SGD,
    gap_aware_policy=policy,
    weight_stashing=True,
  )
  pipe, params, _ = _build(opts, SGD)
  _check_against_reference(pipe, params, SGD, opts, CALLS)


def test_loss_is_the_mean_over_the_calls_microbatches():
  """metrics["loss"] averages exactly the losses computed in the call:
  each microbatch's, once, at the version its last stage's forward used."""
  pipe, params, _ = _build({}, SGD)
  data = _mlp_data(9)
  state = pipe.init(params)
  state, metrics, streams, used = _run_calls(pipe, state, data, (4, 5))
  for first, m, call in ((0, 4, metrics[0]), (4, 5, metrics[1])):
    losses = []
    for b in range(first, first + m):
      # The loss is the last stage's; earlier stages' forwards fed it.
      acts, mb = (), streams[0][b]
      local = pipe.stages.split_batch(mb)
      for s in range(NUM_STAGES):
        theta = jax.device_get(used[0][("F", s, b)])
        forward = pipe.stages.jitted("forward", s)
        outputs, results = forward(theta, local[s], acts)
        acts = outputs
      losses.append(float(results[0]))
    np.testing.assert_allclose(float(call["loss"]), np.mean(losses), 1e-5)


def test_steady_state_delay_is_n_minus_1_minus_s_across_calls():
  """After the warm-up every microbatch on stage s sees delay n - 1 - s,
  whatever the calls: stage s's F(b) uses the params after b - (n-1-s)
  steps (the reference checks the values; here the counts)."""
  pipe, params, _ = _build({}, SGD)
  stream = pipe.schedule
  for s in range(NUM_STAGES):
    w = NUM_STAGES - 1 - s
    assert [stream.delay(s, b) for b in range(12)] == [
      min(b, w) for b in range(12)
    ]
  # A call of m microbatches in steady state: m forwards and m backwards
  # per stage, whatever m and wherever the call starts.
  for fed, m in ((5, 1), (7, 4), (11, 16)):
    lists = pipe.calls(fed, m).lists
    for s in range(NUM_STAGES):
      own = [a for acts in lists.device_actions for a in acts if a.stage == s]
      assert sum(a.kind == "F" for a in own) == m
      assert sum(a.kind == "B" for a in own) == m
      assert sum(a.kind == "S" for a in own) == m
  # Concatenating calls of any sizes gives the same per-stage stream.
  whole = pipe.calls(0, 12).lists
  parts = [pipe.calls(f, m).lists for f, m in ((0, 2), (2, 7), (9, 3))]
  for d in range(NUM_STAGES):
    joined = [a for p in parts for a in p.device_actions[d]]
    assert joined == list(whole.device_actions[d])


def test_unflushed_state_is_refused_where_it_would_be_wrong():
  pipe, params, batch = _build({"weight_stashing": True}, SGD)
  state = pipe.init(params)
  state, _ = pipe.step(state, batch)
  for call in (pipe.gather_params, pipe.state_dict, pipe.gather_model_state):
    with pytest.raises(ValueError, match="pipe.flush"):
      call(state)
  state, _ = pipe.flush(state)
  assert state.in_flight.drained and state.in_flight.fed == 0
  pipe.gather_params(state)
  again, metrics = pipe.flush(state)  # Nothing in flight: a no-op.
  assert again is state and metrics == {}


def test_with_stage_params_restarts_the_stream_at_new_params():
  """A drained state with other params: they replace the old ones; with
  the same params, the next step is the drained state's own (the stream
  restarts as a drained one does); an undrained state is refused."""
  pipe, params, batch = _build({"weight_stashing": True}, SGD)
  state, _ = pipe.step(pipe.init(params), batch)

  def halve(state):
    return tuple(
      tuple(x * 0.5 for x in leaves) for leaves in state.stage_params
    )

  with pytest.raises(ValueError, match="pipe.flush"):
    pipe.with_stage_params(state, halve(state))
  drained, _ = pipe.flush(state)
  before = pipe.gather_params(drained)
  halved = pipe.with_stage_params(drained, halve(drained))
  assert halved.in_flight.fed == 0
  _close(pipe.gather_params(halved), jax.tree.map(lambda x: x * 0.5, before))
  same = pipe.with_stage_params(drained, drained.stage_params)
  got, _ = pipe.flush(pipe.step(same, batch)[0])
  want, _ = pipe.flush(pipe.step(drained, batch)[0])
  _close(pipe.gather_params(got), pipe.gather_params(want))


def test_gradient_avals_are_what_each_stage_step_receives():
  """Per stage, the packed gradient's shapes hold every param entry
  once (small leaves packed, big ones kept)."""
  pipe, params, _ = _build({"weight_stashing": True}, SGD)
  state = pipe.init(params)
  for s, leaves in enumerate(state.stage_params):
    avals = pipe.gradient_avals(s, leaves)
    entries = sum(int(np.prod(a.shape)) for a in jax.tree.leaves(avals))
    assert entries == sum(int(np.prod(x.shape)) for x in leaves)


def test_step_every_windows_span_calls():
  opts = {"step_every": 2, "weight_stashing": True}
  pipe, params, _ = _build(opts, SGD)
  # 3 + 4 microbatches: the window (2, 3) spans the two calls, and the
  # flush steps on the partial window (6,) alone.
  _check_against_reference(pipe, params, SGD, opts, (3, 4, "flush"))


@pytest.mark.parametrize("step_every", [slow(2), 3])
def test_aggmsnag_predicts_with_the_accumulated_gradient(step_every):
  """A forward inside a step_every window predicts with the gradient its
  stage accumulated so far (the reference sums the backwards 1F1B ran
  before it); msnag ignores it, so some forwards differ."""
  used = {}
  calls = (4, 3, "flush")
  data = _mlp_data(7)
  for kind in ("msnag", "aggmsnag"):
    opts = {"step_every": step_every, "prediction": kind}
    pipe, params, _ = _build(opts, SGD)
    _check_against_reference(pipe, params, SGD, opts, calls, data)
    state = pipe.init(params)
    _, _, _, got = _run_calls(pipe, state, data, calls)
    used[kind] = got[0]
  assert any(
    not all(
      np.allclose(a, b)
      for a, b in zip(used["msnag"][k], used["aggmsnag"][k], strict=True)
    )
    for k in used["msnag"]
    if k[0] == "F"
  )
  # Untied stages step and predict from the packed accumulator directly.
  assert "unpack" not in pipe.programs.compiled_kinds()


@pytest.mark.slow
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
    _, _, _, used[name] = _run_calls(pipe, state, batch, (6, "flush"))
  # Replay and the closed form agree for SGD (both exact d-step look-ahead
  # with the scheduled future learning rates).
  for key in used["replay"][0]:
    _close(used["replay"][0][key], used["closed"][0][key], rtol=1e-4)


@pytest.mark.slow
def test_two_bw_is_w_minus_grad_at_previous_version_across_calls():
  """2BW: W(t+1) = W(t) - lr * grad f(W(t-1)) for minibatches of 3
  microbatches fed by calls that do not align with them (2 + 4 + 3)."""
  loss_fn, params, _ = _mlp()
  lr = 0.3
  opts = {"schedule": "2bw", "step_every": NUM_STAGES}
  pipe, params, _ = _build(opts, optax.sgd(lr))
  data = _mlp_data(9)
  _check_against_reference(
    pipe, params, optax.sgd(lr), opts, (2, 4, 3, "flush"), data
  )
  state = pipe.init(params)
  state, _, _, _ = _run_calls(pipe, state, data, (2, 4, 3, "flush"))
  minibatch = 2 * NUM_STAGES
  history = [params, params]  # W(-1) := W(0)
  for t in range(3):
    mb = jax.tree.map(
      lambda x, t=t: x[t * minibatch : (t + 1) * minibatch], data
    )
    # The minibatch's microbatch gradients, averaged (equal sizes).
    g = jitted.grad(loss_fn)(history[-2], mb)
    history.append(jax.tree.map(lambda w, g: w - lr * g, history[-1], g))
  _close(pipe.gather_params(state), history[-1], rtol=1e-4)
  # 1F1B (a flush per call) on the same data differs: 2BW is not 1F1B.
  one_f, _, _ = _build({"schedule": "1f1b"}, optax.sgd(lr))[:3]
  sync = one_f.init(params)
  for t in range(3):
    mb = jax.tree.map(
      lambda x, t=t: x[t * minibatch : (t + 1) * minibatch], data
    )
    sync, _ = one_f.step(sync, mb)
  assert not all(
    np.allclose(a, b)
    for a, b in zip(
      jax.tree.leaves(one_f.gather_params(sync)),
      jax.tree.leaves(pipe.gather_params(state)),
      strict=True,
    )
  )


@pytest.mark.slow
def test_checkpoint_state_roundtrip_into_another_partition():
  """state_dict is keyed by global paths: a 2-stage pipeline resumes a
  flushed 3-stage one's params, optimizer and Gap-Aware state exactly."""
  opts = {
    "weight_stashing": True,
    "gap_aware": "ga",
    "gap_aware_options": GA_SGD,
  }
  pipe3, params, batch = _build(opts, SGD)
  state3 = pipe3.init(params)
  state3, _ = pipe3.step(state3, batch)
  state3, _ = pipe3.flush(state3)
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
  grads = jitted.grad(loss_fn)(saved["params"], batch)
  tx_state = jax.tree.map(jnp.asarray, saved["opt_state"])
  names = jpipe.runtime.build.stage_optimizer.leaf_names(params)
  flat = dict(zip(names, jax.tree.leaves(grads), strict=True))
  flat_params = dict(zip(names, jax.tree.leaves(saved["params"]), strict=True))
  updates, _ = SGD.update(flat, tx_state, flat_params)
  new = optax.apply_updates(flat_params, updates)
  expected = jax.tree.unflatten(
    jax.tree.structure(params), [new[k] for k in names]
  )
  _close(pipe2.gather_params(state2), expected)


def test_flush_then_continue_resumes_bit_identically():
  """A stream flushed, saved and loaded into a new pipeline continues
  exactly as the original flushed at the same point."""
  opts = {"weight_stashing": True, "prediction": "msnag"}
  pipe, params, _ = _build(opts, SGD)
  data = _mlp_data(10)
  first, second = (
    jax.tree.map(lambda x: x[:10], data),
    jax.tree.map(lambda x: x[10:], data),
  )
  state = pipe.init(params)
  state, _ = pipe.step(state, first)
  state, _ = pipe.flush(state)
  saved = pipe.state_dict(state)
  state, _ = pipe.step(state, second)
  state, _ = pipe.flush(state)
  resumed_pipe, _, _ = _build(opts, SGD)
  resumed = resumed_pipe.load_state_dict(saved)
  resumed, _ = resumed_pipe.step(resumed, second)
  resumed, _ = resumed_pipe.flush(resumed)
  for a, b in zip(
    jax.tree.leaves(pipe.gather_params(state)),
    jax.tree.leaves(resumed_pipe.gather_params(resumed)),
    strict=True,
  ):
    np.testing.assert_array_equal(a, b)


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
  # Gap-Aware told "sgd" while the pipeline runs Adam: an error at build.
  with pytest.raises(ValueError, match="gap_aware_options.*Adam-like"):
    jpipe.Pipeline(
      loss_fn,
      params,
      batch,
      schedule="async",
      gap_aware="ga",
      gap_aware_options=GA_SGD,
      recompute=True,
      **dict(common, optimizer=optax.adam(0.1)),
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
  with pytest.raises(ValueError, match="2bw needs step_every.*>= num_stages"):
    jpipe.Pipeline(
      loss_fn,
      params,
      batch,
      schedule="2bw",
      step_every=2,
      num_stages=3,
      devices=jax.devices()[:3],
      optimizer=SGD,
    )
  pipe = jpipe.Pipeline(loss_fn, params, batch, schedule="async", **common)
  state = pipe.init(params)
  with pytest.raises(ValueError, match="does not split into microbatches"):
    pipe.step(state, jax.tree.map(lambda x: x[:3], batch))


@pytest.mark.parametrize("stashing", [False, True])
@pytest.mark.slow
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
  assert pipe.tied.replicas  # the head on the last stage is a replica
  data = jax.tree.map(lambda x: jnp.concatenate([x] * 2), batch)
  _check_against_reference(pipe, params, SGD, opts, (3, 5, "flush"), data)
  # The exchanges ran inside the steps: no gradient was unpacked for them.
  assert "unpack" not in pipe.programs.compiled_kinds()


@pytest.mark.slow
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
  state, _ = pipe.flush(state)
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


SPLIT_FLUSH = {
  "ws": dict(weight_stashing=True, recompute=False),
  "wp+recompute": dict(prediction="msnag", recompute=True),
  "ws+ga": dict(weight_stashing=True, gap_aware="ga", gap_aware_options=GA_SGD),
  "2bw": dict(schedule="2bw", step_every=NUM_STAGES, recompute=False),
}


@pytest.mark.parametrize("case", SPLIT_FLUSH)
@pytest.mark.slow
def test_split_flush_runs_the_drain_as_i_and_w_with_the_same_semantics(case):
  """split_flush: a flush's pending backwards run as I then W; every
  action's params and the final params are still the reference's (same
  steps, same delays), and only the drain changed."""
  opts = SPLIT_FLUSH[case]
  pipe, params, _ = _build(dict(opts, split_flush=True), SGD)
  _check_against_reference(pipe, params, SGD, opts, CALLS)
  plain, _, _ = _build(opts, SGD)
  split, unsplit = pipe.stream, plain.stream
  assert split.split_flush and not unsplit.split_flush
  for s in range(NUM_STAGES):
    drain = split.drain_actions(s, 7)
    kinds = {a.kind for a in drain}
    assert kinds <= {"I", "W", "S"} and (s == NUM_STAGES - 1) == (
      not {"I", "W"} & kinds
    )
    assert split.stage_actions(s, 0, 7) == unsplit.stage_actions(s, 0, 7)
  assert (split.schedule((7,)).delay == unsplit.schedule((7,)).delay).all()


def test_split_flush_is_for_streams():
  with pytest.raises(ValueError, match="split_flush splits the flush"):
    _build({"schedule": "1f1b", "split_flush": True}, SGD)
