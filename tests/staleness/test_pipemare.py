"""PipeMare's learning-rate rescheduling against its formula."""

import numpy as np
import optax
import pytest

from jpipe import staleness
from tests.staleness import numpy_reference as ref


@pytest.mark.parametrize("delay", [0, 1, 2, 7])
def test_factor_is_pipemare_t1(delay):
  for step in [0, 1, 5, 9, 10, 50]:
    got = float(staleness.pipemare_factor(delay, step, 10))
    assert got == pytest.approx(ref.pipemare_lr(1.0, delay, step, 10), rel=1e-6)


def test_factor_anneals_from_one_over_delay_to_one():
  factors = [float(staleness.pipemare_factor(8, k, 20)) for k in range(30)]
  assert factors[0] == pytest.approx(8 ** -(1 - 1 / 20), rel=1e-6)
  assert all(a <= b for a, b in zip(factors, factors[1:], strict=False))
  assert factors[19:] == [1.0] * 11


def test_chained_after_sgd_scales_the_learning_rate():
  rng = np.random.default_rng(0)
  theta = rng.normal(size=(6,)).astype(np.float32)
  grads = [rng.normal(size=(6,)).astype(np.float32) for _ in range(8)]
  tx = optax.chain(optax.sgd(0.1), staleness.pipemare_learning_rate(4, 5))
  state = tx.init(theta)
  want = theta.astype(np.float64)
  for k, g in enumerate(grads):
    updates, state = tx.update(g, state, theta)
    theta = optax.apply_updates(theta, updates)
    want = want - ref.pipemare_lr(0.1, 4, k, 5) * g
  np.testing.assert_allclose(theta, want, rtol=1e-5)


def test_bad_arguments_are_refused():
  with pytest.raises(ValueError, match="anneal_steps"):
    staleness.pipemare_learning_rate(2, 0)
  with pytest.raises(ValueError, match="delay"):
    staleness.pipemare_learning_rate(-1, 10)
