"""The staleness options as one value: ``jpipe.runtime.Staleness``."""

import jax
import numpy as np
import optax
import pytest

import jpipe
from jpipe.runtime import Staleness
from tests.runtime.test_pipeline_async import NUM_STAGES, mlp_pipeline

GA = {"optimizer": "sgd", "learning_rate": 0.1}


def _pipe(**options):
  return mlp_pipeline(
    "async",
    optax.sgd(0.1, momentum=0.9),
    NUM_STAGES,
    num_stages=NUM_STAGES,
    **options,
  )


@pytest.mark.slow
def test_a_staleness_value_trains_as_its_keywords_do():
  keywords = dict(
    weight_stashing=True,
    prediction="msnag",
    gap_aware="ga",
    gap_aware_options=GA,
  )
  by_value, params, batch = _pipe(staleness=Staleness(**keywords))
  by_keywords, _, _ = _pipe(**keywords)
  assert by_value.staleness == by_keywords.staleness == Staleness(**keywords)
  results = []
  for pipe in (by_value, by_keywords):
    state = pipe.init(params)
    for _ in range(2):
      state, _ = pipe.step(state, batch)
    state, _ = pipe.flush(state)
    results.append(jax.tree.leaves(pipe.gather_params(state)))
  for a, b in zip(*results, strict=True):
    np.testing.assert_array_equal(a, b)


def test_staleness_given_twice_is_refused():
  with pytest.raises(ValueError, match=r"given twice.*\['weight_stashing'\]"):
    _pipe(staleness=Staleness(prediction="msnag"), weight_stashing=True)


@pytest.mark.parametrize(
  "schedule, value, message",
  [
    ("gpipe", Staleness(weight_stashing=True), "apply to the asynchronous"),
    (
      "async",
      Staleness(recompute=False, gap_aware="ga_jfl", gap_aware_options=GA),
      "ga_jfl.*recompute=True",
    ),
    ("async", Staleness(gap_aware="ga"), "needs gap_aware_options"),
    ("async", Staleness(prediction="nag"), "unknown prediction"),
    ("2bw", Staleness(), "2bw needs step_every"),
  ],
)
def test_check_refuses_undefined_combinations(schedule, value, message):
  with pytest.raises(ValueError, match=message):
    value.check(schedule)


def test_check_names_a_gap_aware_optimizer_that_is_not_the_pipelines():
  value = Staleness(gap_aware="ga", gap_aware_options=GA)
  params = {"w": np.zeros(3, np.float32)}
  value.check("async", optax.sgd(0.1, momentum=0.9), params)  # matches
  with pytest.raises(ValueError, match="Adam-like"):
    value.check("async", optax.adam(1e-3), params)


def test_derived_facts_follow_their_definitions():
  # Stashing: asked for. Without recomputation or stashing, an async
  # backward reads its saved activations with the current params.
  assert Staleness(weight_stashing=True).stashes
  assert not Staleness(recompute=False).stashes
  assert not Staleness().stashes
  assert Staleness(recompute=False).residuals_from_current_params("async")
  assert not Staleness(recompute=False).residuals_from_current_params("1f1b")
  assert not Staleness(
    recompute=False, weight_stashing=True
  ).residuals_from_current_params("async")
  assert not Staleness().residuals_from_current_params("async")
  # Gap-Aware by FTPipe's stage policies, restated: depth = n - 1 - s.
  rules = {
    "all_except_last": lambda d: d != 0,
    "almost_last_partition": lambda d: d == 1,
    "all_except_last_two": lambda d: d >= 2,
  }
  for policy, rule in rules.items():
    value = Staleness(
      gap_aware="ga", gap_aware_options=GA, gap_aware_policy=policy
    )
    for delay in range(5):
      assert (value.gap_aware_at(delay) == GA) == rule(delay)
      assert (value.gap_aware_at(delay) is None) == (not rule(delay))
  assert Staleness().gap_aware_at(3) is None
  # Prediction: the optimizer's replay unless a predictor is given.
  tx = optax.sgd(0.1)
  assert Staleness().stage_predictor(tx) is None
  assert Staleness(prediction="msnag").stage_predictor(tx) is not None
  given = jpipe.staleness.weight_predictor("sgd", learning_rate=0.1)
  assert (
    Staleness(prediction="msnag", predictor=given).stage_predictor(tx) is given
  )


@pytest.mark.parametrize(
  "policy, stages",
  [  # Depths 2, 1, 0 on 3 stages.
    ("all_except_last", [True, True, False]),
    ("almost_last_partition", [False, True, False]),
    ("all_except_last_two", [True, False, False]),
  ],
)
def test_stage_optimizers_apply_gap_aware_where_the_policy_says(policy, stages):
  pipe, _, _ = _pipe(
    gap_aware="ga", gap_aware_options=GA, gap_aware_policy=policy
  )
  assert NUM_STAGES == 3
  assert [opt.gap_aware for opt in pipe.stage_optimizers] == stages
