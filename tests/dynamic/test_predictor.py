"""DynPipe's slowdown predictor: stage features against hand counts and
brute force, the samples against a plain restatement, the forest against
the measured rule on a known slowdown law, the range-dependent min-max
split against brute force, and the whole loop (collect, fit, re-partition
with the forest) on a real pipeline."""

import itertools

import numpy as np
import pytest

from jpipe import dynamic, partition
from jpipe.dynamic import _predictor as predictor_lib
from tests.dynamic import mlp_pipeline
from tests.partition import flax_models


def _traced():
  loss_fn, params, batch, _ = flax_models.mlp_case()
  return partition.trace(loss_fn, params, batch)


def test_node_features_count_each_layers_operations():
  traced = _traced()
  feats = predictor_lib.node_features(traced)
  names = list(traced.node_names)
  assert feats.shape == (traced.num_nodes, len(dynamic.NODE_FEATURES))
  np.testing.assert_array_equal(feats[:, 0], traced.node_flops())
  np.testing.assert_array_equal(feats[:, 1], traced.node_param_bytes())
  matmuls, convs, nonlinear, nodes = (
    feats[:, 3],
    feats[:, 4],
    feats[:, 5],
    feats[:, 7],
  )
  # Each Dense is one matrix product; no convolutions; every node is one.
  for i, name in enumerate(names):
    if name.startswith("dense_") or name == "head":
      assert matmuls[i] == 1, name
  assert convs.sum() == 0 and np.all(nodes == 1)
  # The relu after each hidden Dense joins its node (no module of its
  # own): one nonlinearity each; the head's node holds the loss (its
  # log-softmax: max, exp, log).
  hidden = [i for i, n in enumerate(names) if n.startswith("dense_")]
  assert len(hidden) == 7 and np.all(nonlinear[hidden] == 1)
  assert nonlinear[names.index("head")] == 3


def test_range_features_are_sums_and_crossing_bytes():
  rng = np.random.default_rng(0)
  n = 6
  feats = rng.uniform(0, 10, (n, 8))
  edges = {(0, 1): 5.0, (1, 2): 7.0, (0, 4): 11.0, (3, 5): 2.0, (4, 5): 3.0}
  got = predictor_lib.range_features(feats, edges)
  for lo in range(n):
    for hi in range(lo + 1, n + 1):
      np.testing.assert_allclose(got[lo, hi, :8], feats[lo:hi].sum(0))
      inside = set(range(lo, hi))
      bytes_in = sum(
        b for (s, d), b in edges.items() if d in inside and s not in inside
      )
      bytes_out = sum(
        b for (s, d), b in edges.items() if s in inside and d not in inside
      )
      assert got[lo, hi, 8] == bytes_in and got[lo, hi, 9] == bytes_out


def _measurements(overhead=0.004, seed=0):
  """Stage times under the sleep law: unslowed ``o + c``, slowed
  ``o + F c`` (the fixed cost does not slow), c in proportion to FLOPs."""
  rng = np.random.default_rng(seed)
  splits, stages, n = 10, 3, 12
  per_node = rng.uniform(1e-3, 4e-3, n)
  node_feats = np.column_stack(
    [per_node * 1e9, rng.integers(1, 5, (n, 6)), np.ones(n)]
  )
  feats = predictor_lib.range_features(node_feats)
  factors = np.array([1.5, 2.0, 3.0, 4.0])
  bounds, reference, slowed, stage_feats = [], [], [], []
  for _ in range(splits):
    cuts = np.sort(rng.choice(np.arange(1, n), stages - 1, replace=False))
    b = (0, *cuts.tolist(), n)
    c = np.array(
      [per_node[a:z].sum() for a, z in zip(b[:-1], b[1:], strict=True)]
    )
    bounds.append(b)
    reference.append(overhead + c)
    slowed.append([overhead + f * c for f in factors])
    stage_feats.append(predictor_lib.boundaries_of_features(feats, b))
  return predictor_lib.Measurements(
    tuple(bounds),
    factors,
    np.array(reference),
    np.array(slowed),
    np.array(stage_feats),
  )


def test_samples_pair_every_two_splits_per_slot_and_factor():
  m = _measurements()
  x, y, observed = m.samples()
  k, f, s = m.slowed.shape
  assert len(y) == k * k * f * s
  rows = {}
  for a, b, fi, si in itertools.product(range(k), range(k), range(f), range(s)):
    ra = m.slowed[a, fi, si] / m.reference[a, si]
    rb = m.slowed[b, fi, si] / m.reference[b, si]
    rows[
      (round(ra, 12), tuple(m.features[a, si]), tuple(m.features[b, si]))
    ] = rb
  for xi, yi, oi in zip(x, y, observed, strict=True):
    key = (round(xi[0], 12), tuple(xi[1:11]), tuple(xi[11:21]))
    assert rows[key] == pytest.approx(yi) and xi[0] == oi
  # The candidate / current ratios close the row.
  np.testing.assert_allclose(x[:, 21], x[:, 11] / x[:, 1])


def test_measurements_survive_their_json_file():
  """What ``jpipe.train.slowdowns`` writes beside its predictor reads back
  as the same measurements (float64, the splits as tuples)."""
  m = _measurements()
  back = predictor_lib.Measurements.from_json(m.to_json())
  assert back.splits == m.splits
  for name in ("factors", "reference", "slowed", "features"):
    got, want = getattr(back, name), getattr(m, name)
    assert got.dtype == np.float64
    np.testing.assert_array_equal(got, want)


def test_the_forest_beats_the_measured_rule_when_fixed_costs_do_not_slow(
  tmp_path,
):
  """Under ``o + F c`` a small stage slows less than a large one on the
  same device: the measured rule (the slot's slowdown for any layers)
  errs, the forest learns it. Saved and loaded, it predicts the same."""
  fitted = dynamic.SlowdownPredictor.fit(_measurements(), n_estimators=50)
  info = fitted.info
  assert info["heldout_mae"] < 0.5 * info["heldout_mae_measured_rule"]
  # On a fresh draw of splits it still does.
  x, y, observed = _measurements(seed=1).samples()
  forest = np.mean(np.abs(fitted.predict(x) - y))
  assert forest < 0.5 * np.mean(np.abs(observed - y))
  path = str(tmp_path / "rf.pkl")
  fitted.save(path)
  again = dynamic.SlowdownPredictor.load(path)
  np.testing.assert_array_equal(again.predict(x[:20]), fitted.predict(x[:20]))
  (tmp_path / "bad.pkl").write_bytes(b"not a pickle")
  with pytest.raises(ValueError, match="jpipe.train.slowdowns"):
    dynamic.SlowdownPredictor.load(str(tmp_path / "bad.pkl"))


def test_minmax_split_with_range_dependent_times_matches_brute_force():
  rng = np.random.default_rng(3)
  for n, stages in ((6, 2), (7, 3), (8, 4)):
    t = rng.uniform(0.1, 1.0, (stages, n + 1, n + 1))
    got, bottleneck = dynamic.minmax_split(t)
    best = min(
      max(t[s, b[s], b[s + 1]] for s in range(stages))
      for cuts in itertools.combinations(range(1, n), stages - 1)
      for b in [(0, *cuts, n)]
    )
    assert bottleneck == pytest.approx(best)
    assert max(t[s, got[s], got[s + 1]] for s in range(stages)) == (
      pytest.approx(best)
    )


def test_minmax_split_with_per_slot_slowdowns_is_jpipes_split():
  """A slowdown that does not depend on the layers: the same bottleneck
  as ``jpipe_split`` (the contiguous solver)."""
  rng = np.random.default_rng(4)
  n = 9
  f, b = rng.uniform(0.1, 1, n), rng.uniform(0.1, 1, n)
  sigma = np.array([1.0, 3.0, 1.0])
  prefix = np.concatenate([[0.0], np.cumsum(f + b)])
  plain = prefix[None, :] - prefix[:, None]
  _, got = dynamic.minmax_split(sigma[:, None, None] * plain)
  _, want = dynamic.jpipe_split(f, b, sigma)
  assert got == pytest.approx(want)


def test_dynpipe_split_takes_a_per_split_slowdown_function():
  rng = np.random.default_rng(5)
  f, b = rng.uniform(0.1, 1, 10), rng.uniform(0.1, 1, 10)
  sigma = np.array([1.0, 2.5, 1.0, 1.0])
  current = (0, 3, 5, 8, 10)
  constant = dynamic.dynpipe_split(f, b, current, sigma)
  as_function = dynamic.dynpipe_split(f, b, current, lambda split: sigma)
  assert constant == as_function


def test_collect_measures_each_split_then_returns_to_the_first():
  """The default tier's collection (2 splits, one factor, one step a
  window): every split measured, the pipeline back on its first, each
  split's features those of its stages, a slot slowed 3x (sleeps
  dominate) slower than unslowed, the data surviving JSON, and a forest
  fitted on it predicting one slowdown per sample. The slow test below
  checks the ratios' bounds and drives a re-partition with the forest."""
  dp, params, batch = mlp_pipeline.build("static")
  first = dp.boundaries
  state, measured = dynamic.collect(
    dp,
    dp.init(params),
    lambda step: batch,
    factors=(3.0,),
    num_splits=2,
    steps_per_window=1,
  )
  assert dp.boundaries == first == measured.splits[0]
  assert len(set(measured.splits)) == 2
  assert measured.reference.shape == (2, 2)
  assert measured.slowed.shape == (2, 1, 2)
  for k, split in enumerate(measured.splits):
    np.testing.assert_array_equal(
      measured.features[k],
      predictor_lib.boundaries_of_features(dp.features, split),
    )
  assert np.all(measured.reference > 0)
  ratio = np.median(measured.slowed / measured.reference[:, None, :], axis=0)
  assert np.all(ratio > 1.2), ratio
  again = predictor_lib.Measurements.from_json(measured.to_json())
  np.testing.assert_array_equal(again.reference, measured.reference)
  forest = dynamic.SlowdownPredictor.fit(measured, n_estimators=5)
  x, y, _ = measured.samples()
  assert forest.predict(x).shape == y.shape


@pytest.mark.slow
def test_collect_fit_and_repartition_with_the_forest(tmp_path):
  """The library's own data: stage times on several splits with device
  slowdowns (sleeps), a forest fitted on them, and a controller using it
  moving layers off a device slowed 4x."""
  dp, params, batch = mlp_pipeline.build("static")
  state = dp.init(params)
  state, measured = dynamic.collect(
    dp,
    state,
    lambda step: batch,
    factors=(2.0, 4.0),
    num_splits=4,
    # Three steps per window: one step's time on a busy 2-core machine
    # (the suite's other workers) swings too much for the bounds below.
    steps_per_window=3,
  )
  assert dp.boundaries == measured.splits[0] and len(measured.splits) == 4
  # A slowed device's stage takes longer; by less than the factor (its
  # dispatch does not slow), by more than half of it (sleeps dominate).
  # Bounds on the median over splits: one split's ratio divides by one
  # reference window, which a busy 2-core machine (the suite's other
  # workers) once made fast enough to put a 4x ratio at 4.8 (CI).
  ratio = np.median(measured.slowed / measured.reference[:, None, :], axis=0)
  assert np.all(ratio[0] > 1.3) and np.all(ratio[1] > 2.2)
  assert np.all(ratio[1] < 4.4)
  again = predictor_lib.Measurements.from_json(measured.to_json())
  np.testing.assert_array_equal(again.slowed, measured.slowed)
  forest = dynamic.SlowdownPredictor.fit(measured, n_estimators=30)

  dp, _, _ = mlp_pipeline.build("jpipe", "1:4:6", predictor=forest)
  start = dp.boundaries
  state = dp.init(params)
  for _ in range(12):
    state, metrics = dp.step(state, batch)
  assert len(dp.history) == 1, dp.windows
  record = dp.history[0]
  assert record["step"] == 10 and record["new"][1] > start[1]
  # What the forest expects the slowed slot to show with its new stage.
  assert 1.0 <= record["expected_sigma"][1] <= 4.4
  # The planners' table of every range's slowdown (one forest call) is
  # the forest's prediction for each stage of a split, row by row.
  observed = [1.0, 3.0]
  split = (0, 2, dp.boundaries[-1])
  cur = predictor_lib.boundaries_of_features(dp.features, dp.boundaries)
  new = predictor_lib.boundaries_of_features(dp.features, split)
  direct = forest.predict(predictor_lib.sample_features(3.0, cur[1], new[1]))
  np.testing.assert_allclose(
    dp.slowdowns_of(observed)(split), [1.0, max(float(direct), 1.0)]
  )
