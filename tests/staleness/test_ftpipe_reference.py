"""jpipe's staleness transforms against FTPipe's own code (the seed
paper's Gap-Aware optimizers and weight predictors, run with PyTorch by
``make_ftpipe_reference.py``; the tests read the recorded
``ftpipe_reference.npz``): the same gradients and stashed-weight gaps give
the same params, step by step -- under a warm-up-then-decay learning rate
too, whose running max Gap-Aware's SGD scale follows -- and the same
predicted weights."""

import os

import jax.numpy as jnp
import numpy as np
import optax
import pytest

from jpipe import staleness

REFERENCE = np.load(
  os.path.join(os.path.dirname(__file__), "ftpipe_reference.npz")
)


def _gap_aware(case: str, **kwargs):
  """jpipe's counterpart of FTPipe's optimizer and Gap-Aware class."""
  if case.startswith("sgd"):
    momentum = float(case.split("_m")[1].split("_")[0])
    wd = float(case.split("_wd")[1].split("_")[0])
    lr = 0.1
    if case.endswith("_scheduled"):  # torch's LambdaLR, step by step.
      lrs = jnp.asarray(REFERENCE["schedule"], jnp.float32)
      lr = lambda count: lrs[jnp.minimum(count, lrs.size - 1)]  # noqa: E731
    sgd = optax.sgd(lr, momentum=momentum or None)
    base = optax.chain(optax.add_decayed_weights(wd), sgd) if wd else sgd
    return staleness.gap_aware(
      base, optimizer="sgd", learning_rate=lr, weight_decay=wd, **kwargs
    )
  optimizer, wd = case.split("_wd")[0], float(case.split("_wd")[1])
  if optimizer == "adamw":
    base = optax.adamw(0.01, b1=0.9, b2=0.99, eps=1e-8, weight_decay=wd)
  else:
    adam = optax.adam(0.01, b1=0.9, b2=0.99, eps=1e-8)
    base = optax.chain(optax.add_decayed_weights(wd), adam) if wd else adam
  return staleness.gap_aware(
    base,
    optimizer=optimizer,
    beta=0.99,
    learning_rate=0.01,
    weight_decay=wd,
    **kwargs,
  )


GAP_AWARE_CASES = sorted(
  {k.split("/")[1] for k in REFERENCE.files if k.startswith("gap_aware/")}
)


@pytest.mark.parametrize("case", GAP_AWARE_CASES)
def test_gap_aware_steps_are_ftpipes(case):
  grads = REFERENCE[f"gap_aware/{case}/grads"]
  offsets = REFERENCE[f"gap_aware/{case}/offsets"]
  want = REFERENCE[f"gap_aware/{case}/params"]
  for step, params in enumerate(_gap_aware_steps(case, grads, offsets)):
    np.testing.assert_allclose(
      params, want[step], rtol=2e-5, atol=2e-6, err_msg=f"step {step}"
    )
  # The gaps mattered: the same steps without them end elsewhere.
  plain = _gap_aware_steps(case, grads, np.zeros_like(offsets))[-1]
  assert not np.allclose(plain, want[-1], atol=1e-3)


def _gap_aware_steps(case, grads, offsets) -> list[np.ndarray]:
  """The params after each step of jpipe's Gap-Aware, each gradient's
  forward having run at the params plus its offset."""
  tx = _gap_aware(case)
  params = jnp.asarray(REFERENCE["theta0"], jnp.float32)
  state = tx.init(params)
  out = []
  for g, offset in zip(grads, offsets, strict=True):
    stale = params + jnp.asarray(offset, jnp.float32)
    updates, state = tx.update(
      jnp.asarray(g, jnp.float32), state, params, stale_params=stale
    )
    params = optax.apply_updates(params, updates)
    out.append(np.asarray(params))
  return out


FROM_GRAD_CASES = sorted(
  {k.split("/")[1] for k in REFERENCE.files if k.startswith("gap_from_grad/")}
)


@pytest.mark.parametrize("case", FROM_GRAD_CASES)
def test_gap_from_grad_steps_are_ftpipes(case):
  """A stage one step late without a stash: FTPipe's apply_from_grad
  estimates the gap from the gradient (delay 0 at the first step)."""
  grads = REFERENCE[f"gap_from_grad/{case}/grads"]
  want = REFERENCE[f"gap_from_grad/{case}/params"]
  got = _from_grad_steps(case, grads, delays=[0] + [1] * (len(grads) - 1))
  for step, params in enumerate(got):
    np.testing.assert_allclose(
      params, want[step], rtol=2e-5, atol=2e-6, err_msg=f"step {step}"
    )
  # The estimate mattered: at delay 0 throughout the steps end elsewhere.
  plain = _from_grad_steps(case, grads, delays=[0] * len(grads))[-1]
  assert not np.allclose(plain, want[-1], atol=1e-3)


def _from_grad_steps(case, grads, delays) -> list[np.ndarray]:
  tx = _gap_aware(case, gap_from_grad=True, adam_betas=(0.9, 0.99))
  params = jnp.asarray(REFERENCE["theta0"], jnp.float32)
  state = tx.init(params)
  out = []
  for g, delay in zip(grads, delays, strict=True):
    updates, state = tx.update(
      jnp.asarray(g, jnp.float32), state, params, delay=delay
    )
    params = optax.apply_updates(params, updates)
    out.append(np.asarray(params))
  return out


_ADAM = dict(b1=0.9, b2=0.99, eps=1e-6)

# FTPipe's case -> jpipe's optimizer, weight_predictor's kind and args.
PREDICTORS = {
  "sgd": (optax.sgd(0.05, momentum=0.9), "sgd", dict(momentum=0.9)),
  "adam": (optax.adam(0.05, **_ADAM), "adam", _ADAM),
  "adam_wd": (
    optax.chain(optax.add_decayed_weights(0.05), optax.adam(0.05, **_ADAM)),
    "adam",
    dict(_ADAM, weight_decay=0.05),
  ),
  "adamw": (
    optax.adamw(0.05, **_ADAM, weight_decay=0.05),
    "adamw",
    dict(_ADAM, weight_decay=0.05),
  ),
  "sgd_wd_agg": (
    optax.chain(optax.add_decayed_weights(0.05), optax.sgd(0.05, momentum=0.9)),
    "sgd",
    dict(momentum=0.9, weight_decay=0.05),
  ),
  "adam_agg": (optax.adam(0.05, **_ADAM), "adam", _ADAM),
  "adamw_agg": (
    optax.adamw(0.05, **_ADAM, weight_decay=0.05),
    "adamw",
    dict(_ADAM, weight_decay=0.05),
  ),
}


@pytest.mark.parametrize("case", PREDICTORS)
def test_weight_predictions_are_ftpipes(case):
  """FTPipe's predictors (cloned weights) after the same steps of its
  optimizer, at delays 1, 2 and 5: msnag, and aggmsnag (``_agg``: the
  gradient accumulated so far taken as the first predicted step's; for
  SGD with weight decay FTPipe's form is derived by sympy)."""
  tx, optimizer, hyper = PREDICTORS[case]
  params = jnp.asarray(REFERENCE["theta0"], jnp.float32)
  state = tx.init(params)
  for g in REFERENCE[f"prediction/{case}/grads"]:
    updates, state = tx.update(jnp.asarray(g, jnp.float32), state, params)
    params = optax.apply_updates(params, updates)
  np.testing.assert_allclose(
    params, REFERENCE[f"prediction/{case}/params"], rtol=2e-5, atol=2e-6
  )
  phi = None
  if f"prediction/{case}/phi" in REFERENCE:
    phi = jnp.asarray(REFERENCE[f"prediction/{case}/phi"], jnp.float32)
  predict = staleness.weight_predictor(optimizer, learning_rate=0.05, **hyper)
  for d, want in zip(
    REFERENCE["delays"],
    REFERENCE[f"prediction/{case}/predicted"],
    strict=True,
  ):
    got = predict(params, state, int(d), grad=phi)
    np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-6, err_msg=d)
    assert not np.allclose(want, params)  # A prediction moves the weights.
