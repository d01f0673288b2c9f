"""FTPipe's no-recompute staleness (``nr``) against a per-layer NumPy
restatement: an asynchronous stage without recomputation and without
stashing takes its weight gradient from the forward-time activations and
its input gradient at the current weights (PipeDream without stashing)."""

import numpy as np
import optax
import pytest

from tests.runtime.test_pipeline_async import (
  NUM_STAGES,
  _build,
  _mlp_data,
  _run_calls,
)

LR, MOMENTUM = 0.3, 0.9


def _layers(params):
  """(name, W, b) per Dense layer in order, float64."""
  names = [f"dense_{i}" for i in range(5)] + ["head"]
  p = params["params"]
  return [
    (
      n,
      np.asarray(p[n]["kernel"], np.float64),
      np.asarray(p[n]["bias"], np.float64),
    )
    for n in names
  ]


def _reference(layers, stage_of, microbatches, prediction):
  """Final (W, b) per layer after one stream over ``microbatches``.

  Stage s of n (w = n - 1 - s warm-up forwards) runs F(b) at its version
  after max(b - w, 0) steps -- predicted d = min(b, w) steps ahead with
  FTPipe's msnag for momentum SGD when asked -- and B(b) reading the
  version after b steps (the current one). Per layer: z = h W + b, relu
  but for the head; the loss is the mean softmax cross-entropy. The
  backward's dW = h_fwd^T delta uses the forward's input h, its relu mask
  the forward's z; dh = delta W^T uses the current W.
  """
  n = max(stage_of.values()) + 1
  # versions[s][k]: {layer: (W, b, vW, vb)} after k steps of stage s.
  versions = [
    [
      {
        name: (w, b, np.zeros_like(w), np.zeros_like(b))
        for name, w, b in layers
        if stage_of[name] == s
      }
    ]
    for s in range(n)
  ]
  names = [name for name, _, _ in layers]
  for b_idx, (x, y) in enumerate(microbatches):
    h, saved = x, {}
    for i, name in enumerate(names):
      s = stage_of[name]
      depth = n - 1 - s
      version = versions[s][max(b_idx - depth, 0)][name]
      w, bias, vw, vb = version
      delay = min(b_idx, depth)
      if prediction and delay:
        c = sum(MOMENTUM**k for k in range(1, delay + 1))
        w, bias = w - LR * c * vw, bias - LR * c * vb
      z = h @ w + bias
      saved[name] = (h, z)
      h = z if i == len(names) - 1 else np.maximum(z, 0.0)
    logits = h
    p = np.exp(logits - logits.max(1, keepdims=True))
    p /= p.sum(1, keepdims=True)
    delta = (p - np.eye(logits.shape[1])[y]) / len(y)
    grads = {}
    for i in reversed(range(len(names))):
      name = names[i]
      s = stage_of[name]
      h_fwd, _ = saved[name]
      grads[name] = (h_fwd.T @ delta, delta.sum(0))
      w_current = versions[s][b_idx][name][0]
      dh = delta @ w_current.T
      if i > 0:
        _, z_prev = saved[names[i - 1]]
        delta = dh * (z_prev > 0)
    for s in range(n):
      new = {}
      for name, (w, bias, vw, vb) in versions[s][-1].items():
        gw, gb = grads[name]
        vw, vb = MOMENTUM * vw + gw, MOMENTUM * vb + gb
        new[name] = (w - LR * vw, bias - LR * vb, vw, vb)
      versions[s].append(new)
  final = {}
  for s in range(n):
    final.update(versions[s][-1])
  return final


@pytest.mark.parametrize("prediction", [None, "msnag"])
def test_no_recompute_reads_forward_activations_and_current_weights(
  prediction,
):
  calls = (2, 3, "flush")  # Two calls of one stream, then its drain.
  tx = optax.sgd(LR, momentum=MOMENTUM)
  opts = dict(recompute=False, prediction=prediction)
  pipe, params, _ = _build(opts, tx)
  assert pipe.stages.num_stages == NUM_STAGES
  data = _mlp_data(sum(c for c in calls if c != "flush"))
  state = pipe.init(params)
  state, _, streams, _ = _run_calls(pipe, state, data, calls)
  (stream,) = streams
  microbatches = [
    (np.asarray(mb["x"], np.float64), np.asarray(mb["y"])) for mb in stream
  ]
  layers = _layers(params)
  stage_of = {name: pipe.plan.stage_of[name] for name, _, _ in layers}
  assert len(set(stage_of.values())) == NUM_STAGES
  want = _reference(layers, stage_of, microbatches, prediction)
  got = _layers(pipe.gather_params(state))
  for name, w, b in got:
    np.testing.assert_allclose(w, want[name][0], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(b, want[name][1], rtol=1e-5, atol=1e-6)
  # Not what a recomputing backward gives (the test can tell them apart).
  recomputing, _, _ = _build(dict(opts, recompute=True), tx)
  other = recomputing.init(params)
  other, _, _, _ = _run_calls(recomputing, other, data, calls)
  differ = [
    np.abs(w - w2).max()
    for (_, w, _), (_, w2, _) in zip(
      got, _layers(recomputing.gather_params(other)), strict=True
    )
  ]
  assert max(differ) > 1e-4
