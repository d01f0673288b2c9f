"""DynPipe's re-partitioning policies as classes: decisions round-trip
through JSON (process 0 sends them to the others), names map to classes,
and jpipe's rule acts on two windows in a row when the gain pays."""

import types

import numpy as np
import pytest

from jpipe import dynamic
from jpipe.dynamic import Decision


def test_decision_round_trips_through_json():
  d = Decision.of(
    np.array([0, 3, 7]), np.array([1.0, 2.5]), 0.25, np.float32(0.125), [1, 2]
  )
  assert Decision.from_json(d.to_json()) == d
  assert Decision.from_json("null") is None
  assert d.boundaries == (0, 3, 7) and isinstance(d.new_seconds, float)


def test_make_policy_by_name():
  kinds = {
    "jpipe": dynamic.JpipePolicy,
    "dynpipe": dynamic.DynpipePolicy,
    "static": dynamic.Policy,
  }
  assert set(kinds) == set(dynamic.POLICIES)
  for name, kind in kinds.items():
    policy = dynamic.make_policy(
      name, high=2.0, low=0.5, warmup_windows=1, top_k=2
    )
    assert type(policy) is kind and policy.name == name
  with pytest.raises(ValueError, match="unknown policy 'magic'"):
    dynamic.make_policy("magic", high=2.0, low=0.5, warmup_windows=1, top_k=2)


def _controller(cost):
  """What a policy reads of ``DynamicPipeline``: two stages, the split
  in force (0, 4, 8); slot 1 slowed moves nodes 3 left."""
  return types.SimpleNamespace(
    assumed=np.ones(2),
    boundaries=(0, 4, 8),
    horizon_steps=10,
    best_split=lambda sigma: ((0, 5, 8), np.asarray(sigma)),
    predict_measured=lambda seconds: float(np.sum(seconds)),
    predict=lambda boundaries, sigma: 1.0,
    switch_cost=lambda boundaries: cost,
  )


def _window(sigma, seconds):
  return dynamic.Window(0, tuple(seconds), tuple(sigma), 1.0)


def test_jpipe_policy_acts_on_two_windows_in_a_row_when_the_gain_pays():
  policy = dynamic.JpipePolicy(high=2.0, low=0.5)
  pipe = _controller(cost=5.0)
  slow = _window([1.0, 3.0], [1.0, 2.0])
  assert policy.decide(pipe, _window([1.0, 1.2], [1.0, 1.0])) is None
  assert policy.decide(pipe, slow) is None  # One window: a noisy sample.
  got = policy.decide(pipe, slow)
  # Old: the measured 3.0 s per call; new: 1.0; (3 - 1) x 10 > 5.
  assert got == Decision.of((0, 5, 8), (1.0, 3.0), 3.0, 1.0, (1.0, 3.0))
  policy.switched()  # Windows before a switch no longer count.
  assert policy.decide(pipe, slow) is None
  dear = dynamic.JpipePolicy(high=2.0, low=0.5)
  expensive = _controller(cost=25.0)  # (3 - 1) x 10 < 25: stay.
  assert dear.decide(expensive, slow) is None
  assert dear.decide(expensive, slow) is None


def test_static_policy_never_moves():
  policy = dynamic.make_policy(
    "static", high=2.0, low=0.5, warmup_windows=0, top_k=2
  )
  assert policy.decide(_controller(0.0), _window([1.0, 9.0], [1, 9])) is None
