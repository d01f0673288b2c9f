"""The delay-aware Nesterov method: PyTorch's NAdam against a NumPy
restatement of its documented algorithm, and the per-stage momentum."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from jpipe import staleness
from tests.staleness import numpy_reference as ref


def _run(tx, theta, grads):
  state = tx.init(theta)
  out = []
  for g in grads:
    updates, state = tx.update(g, state, theta)
    theta = optax.apply_updates(theta, updates)
    out.append(np.asarray(theta))
  return out, state


@pytest.mark.parametrize(
  "b1,wd,psi", [(0.9, 0.0, 4e-3), (0.99, 0.1, 4e-3), (0.95, 0.01, 0.5)]
)
def test_nadamw_matches_pytorch_algorithm(b1, wd, psi):
  rng = np.random.default_rng(0)
  theta = rng.normal(size=(3, 4)).astype(np.float32)
  grads = [rng.normal(size=(3, 4)).astype(np.float32) for _ in range(12)]
  tx = staleness.nadamw(1e-2, b1=b1, weight_decay=wd, momentum_decay=psi)
  got, state = _run(tx, theta, grads)
  want = ref.nadamw_steps(theta, grads, 1e-2, b1, 0.999, 1e-8, wd, psi)
  for g, w in zip(got, want, strict=True):
    np.testing.assert_allclose(g, w, rtol=2e-5, atol=2e-6)
  assert int(state[0].count) == len(grads)


def test_nadam_without_momentum_is_adam_without_momentum():
  # b1 = 0: mu_t = 0, so m_hat = g and NAdam is Adam(b1=0) exactly.
  rng = np.random.default_rng(1)
  theta = jnp.asarray(rng.normal(size=(5,)), jnp.float32)
  grads = [jnp.asarray(rng.normal(size=(5,)), jnp.float32) for _ in range(6)]
  got, _ = _run(staleness.nadamw(0.1, b1=0.0), theta, grads)
  want, _ = _run(optax.adam(0.1, b1=0.0), theta, grads)
  np.testing.assert_allclose(got[-1], want[-1], rtol=1e-6)


def test_nadamw_state_keeps_its_shape_across_momenta():
  # Stages with different delays step with different beta1: one
  # checkpoint layout must hold them all.
  params = {"w": jnp.ones((2, 3)), "b": jnp.zeros((3,))}
  shapes = {
    jax.tree.structure(
      jax.eval_shape(
        staleness.delay_aware_nesterov(
          1e-3, delay=d, num_stages=4, adaptive=True, weight_decay=0.1
        ).init,
        params,
      )
    )
    for d in range(4)
  }
  assert len(shapes) == 1


def test_adaptive_momentum_is_the_authors_formula():
  # main_with_runtime.py: momentum + (num_versions - 1) (0.99 - momentum) / n
  for d, n in [(0, 4), (1, 4), (3, 4), (7, 8)]:
    assert staleness.adaptive_momentum(0.9, d, n) == pytest.approx(
      0.9 + d * (0.99 - 0.9) / n
    )
  momenta = [staleness.adaptive_momentum(0.9, d, 8) for d in range(8)]
  assert momenta == sorted(momenta) and momenta[0] == 0.9 and momenta[-1] < 0.99


def test_delay_aware_nesterov_picks_the_stage_optimizer():
  rng = np.random.default_rng(2)
  theta = jnp.asarray(rng.normal(size=(4,)), jnp.float32)
  grads = [jnp.asarray(rng.normal(size=(4,)), jnp.float32) for _ in range(5)]
  b1 = staleness.adaptive_momentum(0.9, 2, 4)
  got, _ = _run(
    staleness.delay_aware_nesterov(
      0.01, delay=2, num_stages=4, optimizer="sgd", momentum=0.9, adaptive=True
    ),
    theta,
    grads,
  )
  want, _ = _run(optax.sgd(0.01, momentum=b1, nesterov=True), theta, grads)
  np.testing.assert_allclose(got[-1], want[-1], rtol=1e-6)
  got, _ = _run(
    staleness.delay_aware_nesterov(0.01, delay=2, num_stages=4), theta, grads
  )
  want = ref.nadamw_steps(theta, grads, 0.01, 0.99, 0.999, 1e-8, 0.0, 4e-3)
  np.testing.assert_allclose(got[-1], want[-1], rtol=2e-5, atol=2e-6)


def test_bad_arguments_are_refused():
  with pytest.raises(ValueError, match="delay < num_stages"):
    staleness.adaptive_momentum(0.9, 4, 4)
  with pytest.raises(ValueError, match="use optimizer='adamw'"):
    staleness.delay_aware_nesterov(
      1e-3, delay=0, num_stages=2, optimizer="adam", weight_decay=0.1
    )
  with pytest.raises(ValueError, match="unknown optimizer"):
    staleness.delay_aware_nesterov(1e-3, delay=0, num_stages=2, optimizer="x")
  with pytest.raises(ValueError, match="b1 must be in"):
    staleness.nadamw(1e-3, b1=1.0)
