"""The staleness study's pipeline simulator against a plain re-statement of
PipeDream's semantics for two stages."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from experiments.staleness import pipeline_sim

NUM_UNITS = 3
STEPS = 6


def _setup():
  rng = np.random.default_rng(0)
  data = {
    "train_x": jnp.asarray(rng.normal(size=(24, 5)), jnp.float32),
    "train_y": jnp.asarray(rng.integers(0, 4, size=24), jnp.int32),
    "order": jnp.asarray(rng.permutation(24).reshape(STEPS, 4)),
    "test_x": jnp.asarray(rng.normal(size=(8, 5)), jnp.float32),
    "test_y": jnp.asarray(rng.integers(0, 4, size=8), jnp.int32),
  }
  units = pipeline_sim.init_units(jax.random.key(1), NUM_UNITS, 5, 6, 4)
  return data, units


def _loss(units, x, y):
  for i, p in enumerate(units):
    x = pipeline_sim.apply_unit(i, NUM_UNITS, p, x)
  return optax.softmax_cross_entropy_with_integer_labels(x, y).mean()


def _reference_two_stages(units, data, lr, stash):
  """Plain SGD, stage 0 = unit 0 (delay 1), stage 1 = units 1-2 (delay 0).

  Microbatch t: stage 0 forwards at theta0 after t-1 updates (t=0: initial),
  stage 1 at its current params; stage 0's backward runs at the stashed
  forward params (stash) or its current params (no stash).
  """
  theta0, theta1 = units[0], units[1:]
  history0 = [theta0]
  losses = []
  for t in range(STEPS):
    idx = data["order"][t]
    x, y = data["train_x"][idx], data["train_y"][idx]
    fwd0 = history0[max(t - 1, 0)]

    def head(h, th1, y=y):
      for i, p in enumerate(th1, start=1):
        h = pipeline_sim.apply_unit(i, NUM_UNITS, p, h)
      return optax.softmax_cross_entropy_with_integer_labels(h, y).mean()

    h = pipeline_sim.apply_unit(0, NUM_UNITS, fwd0, x)
    loss, (cot, g1) = jax.value_and_grad(head, argnums=(0, 1))(h, theta1)
    at = fwd0 if stash else theta0
    _, vjp = jax.vjp(
      lambda p, x=x: pipeline_sim.apply_unit(0, NUM_UNITS, p, x), at
    )
    (g0,) = vjp(cot)
    theta0 = jax.tree.map(lambda p, g: p - lr * g, theta0, g0)
    theta1 = jax.tree.map(lambda p, g: p - lr * g, theta1, g1)
    history0.append(theta0)
    losses.append(float(loss))
  return np.asarray(losses)


@pytest.mark.slow
@pytest.mark.parametrize("method,stash", [("none", False), ("ws", True)])
def test_two_stage_pipeline_matches_reference(method, stash):
  data, units = _setup()
  lr = 0.5
  opt = pipeline_sim.OptimizerSpec("sgd", learning_rate=lr, momentum=0.0)
  groups = pipeline_sim.split_units(NUM_UNITS, 2)
  assert [list(g) for g in groups] == [[0, 1], [2]]
  groups = [range(0, 1), range(1, 3)]  # stage 0 = unit 0 only
  train = pipeline_sim.make_train(groups, NUM_UNITS, opt, method, STEPS, STEPS)
  out = jax.jit(train)([[units[0]], units[1:]], data)
  expected = _reference_two_stages(units, data, lr, stash)
  np.testing.assert_allclose(out["train_loss"], expected, rtol=1e-5)


@pytest.mark.slow
def test_one_stage_is_plain_training():
  data, units = _setup()
  opt = pipeline_sim.OptimizerSpec("adam", learning_rate=1e-2)
  # Every mitigation is a no-op at d = 0: training is plain training with
  # the stage's optimizer (the base one, or the Nesterov method's NAdam).
  for method in pipeline_sim.METHODS:
    train = pipeline_sim.make_train(
      [range(NUM_UNITS)], NUM_UNITS, opt, method, STEPS, STEPS
    )
    out = jax.jit(train)([units], data)
    tx = pipeline_sim.stage_optimizer(opt, method, 0, 1, STEPS)
    if "nag" not in method:
      tx = opt.base()
    params, state = units, tx.init(units)
    losses = []
    for t in range(STEPS):
      idx = data["order"][t]
      loss, g = jax.value_and_grad(_loss)(
        params, data["train_x"][idx], data["train_y"][idx]
      )
      updates, state = tx.update(g, state, params)
      params = optax.apply_updates(params, updates)
      losses.append(float(loss))
    np.testing.assert_allclose(out["train_loss"], losses, rtol=1e-5)


def test_bad_stage_counts_and_methods():
  with pytest.raises(ValueError, match="need 1 <= num_stages <= 3"):
    pipeline_sim.split_units(3, 4)
  with pytest.raises(ValueError, match="unknown method 'stale'"):
    pipeline_sim.make_train(
      [range(3)], 3, pipeline_sim.OptimizerSpec("sgd", 0.1), "stale", 4, 4
    )


@pytest.mark.slow
def test_run_writes_tables_json_and_png(tmp_path):
  """The study's entry point end to end, shrunk to seconds."""
  # Defines absl flags of its own at import: imported inside the
  # flagsaver, they would be deleted at its exit under a module that
  # still reads them (later TFDS reads in this process would fail).
  import array_record.python.array_record_data_source  # noqa: F401
  from absl import flags
  from absl.testing import flagsaver

  from experiments.staleness import run

  # Marked parsed, not parsed: another module this worker imported may
  # have made its own flags required (jpipe.train.slowdowns: --config,
  # --out), which a parse would validate and refuse.
  flags.FLAGS.mark_as_parsed()
  with flagsaver.flagsaver(
    optimizers=["sgd"],
    delays=["0", "2"],
    methods=["none", "wp+ga"],
    seeds=1,
    steps=10,
    eval_every=5,
    out_dir=str(tmp_path),
    data_dir=str(tmp_path / "tfds"),
  ):
    run.main(["run"])
  import json

  results = json.loads((tmp_path / "staleness.json").read_text())
  runs = {(r["optimizer"], r["delay"], r["method"]) for r in results["runs"]}
  assert runs == {("sgd", 0, "none"), ("sgd", 2, "none"), ("sgd", 2, "wp+ga")}
  assert all(len(r["train_loss_curve"]) == 10 for r in results["runs"])
  table = (tmp_path / "staleness.md").read_text()
  assert "| sgd | wp+ga |" in table
  assert (tmp_path / "staleness.png").stat().st_size > 10_000


def _reference_no_recompute(units, data, lr):
  """FTPipe's nr, restated per unit in NumPy: stage 0 = units 0-1 (delay
  1), stage 1 = unit 2 (delay 0), plain SGD. Stage 0's backward keeps its
  forward's unit inputs and pre-activations (at the params after t - 1
  updates) and reads the current weights: dW = x^T delta, dx = delta W^T
  (+ the residual's cotangent)."""
  th = [jax.tree.map(np.asarray, u) for u in units]
  history0 = [th[:2]]
  losses = []
  for t in range(STEPS):
    idx = np.asarray(data["order"][t])
    x = np.asarray(data["train_x"])[idx]
    y = np.asarray(data["train_y"])[idx]
    f0, f1 = history0[max(t - 1, 0)]
    y0 = x @ f0["w"] + f0["b"]
    h0 = np.maximum(y0, 0)
    y1 = h0 @ f1["w"] + f1["b"]
    h1 = h0 + np.maximum(y1, 0)
    logits = h1 @ th[2]["w"] + th[2]["b"]
    p = np.exp(logits - logits.max(1, keepdims=True))
    p /= p.sum(1, keepdims=True)
    losses.append(-np.mean(np.log(p[np.arange(len(y)), y])))
    delta2 = (p - np.eye(p.shape[1])[y]) / len(y)
    g2 = {"w": h1.T @ delta2, "b": delta2.sum(0)}
    cot = delta2 @ th[2]["w"].T
    delta1 = cot * (y1 > 0)
    g1 = {"w": h0.T @ delta1, "b": delta1.sum(0)}
    dx1 = delta1 @ th[1]["w"].T + cot  # The current W of unit 1.
    delta0 = dx1 * (y0 > 0)
    g0 = {"w": x.T @ delta0, "b": delta0.sum(0)}
    th = [
      {k: p_[k] - lr * g[k] for k in p_}
      for p_, g in zip(th, (g0, g1, g2), strict=True)
    ]
    history0.append(th[:2])
  return np.asarray(losses), th


def test_no_recompute_reads_forward_activations_and_current_weights():
  data, units = _setup()
  lr = 0.5
  opt = pipeline_sim.OptimizerSpec("sgd", learning_rate=lr, momentum=0.0)
  groups = [range(0, 2), range(2, 3)]
  train = pipeline_sim.make_train(groups, NUM_UNITS, opt, "nr", STEPS, STEPS)
  out = jax.jit(train)([units[:2], units[2:]], data)
  expected, _ = _reference_no_recompute(units, data, lr)
  np.testing.assert_allclose(out["train_loss"], expected, rtol=1e-5)
  # Not the recomputing run (the test can tell them apart).
  none = pipeline_sim.make_train(groups, NUM_UNITS, opt, "none", STEPS, STEPS)
  other = jax.jit(none)([units[:2], units[2:]], data)
  assert np.abs(other["train_loss"] - expected).max() > 1e-4
