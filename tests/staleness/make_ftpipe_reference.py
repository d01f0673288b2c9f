"""Writes ``ftpipe_reference.npz``: FTPipe's own Gap-Aware optimizers and
weight predictors (saareliad/FTPipe, the seed paper's code, run with
PyTorch) on fixed gradient streams, for the tests to hold jpipe's
staleness transforms to.

  pip install -e ".[reference]"    # torch (its CPU build)
  git clone https://github.com/saareliad/FTPipe /tmp/FTPipe
  python -m tests.staleness.make_ftpipe_reference --ftpipe /tmp/FTPipe

Written from FTPipe at 986014df with torch 2.14.1. FTPipe's modules are
imported from the checkout, not copied: ``pipe/optimizers``,
``pipe/pipeline/gap_aware``, ``pipe/pipeline/weight_prediction`` and
``pipe/pipeline/true_weights_storage.py`` (its package ``__init__``
pulls in the whole distributed runtime, so the folders go on the path
themselves), and each is driven as FTPipe's partition manager drives it:

- Gap-Aware with weight stashing: the stashed weights the forward used
  are loaded into the model, ``trainer.apply_gap_aware(real_theta=...)``
  runs ``update_running_stats()`` and, once the delay is positive,
  ``apply_on_theta(real_theta)``; the true weights are restored and the
  optimizer steps (FTPipe's ``sgd1`` -- torch's SGD -- with ``GapAware``,
  ``adam_record_step`` with ``AdamGapAware``, ``adamw_record_step`` with
  ``AdamWGapAware``).
- Gap-Aware without a stash (a stage one step late): the same, with
  ``apply_from_grad()`` estimating the gap from the gradient.
- Weight prediction (cloned weights; ``msnag``, and ``aggmsnag`` with
  the accumulated gradient in ``p.grad``): after some optimizer steps,
  ``setup(delay)``, ``forward()`` loads the predicted weights,
  ``revert()`` restores the true ones.

Stored per case: the initial params, the stream (gradients; offsets of the
stashed weights from the true ones), and the params after each step or
the prediction at each delay, all float64.
"""

import argparse
import collections
import collections.abc
import os
import sys

import numpy as np

OUT = os.path.join(os.path.dirname(__file__), "ftpipe_reference.npz")
STEPS = 6
SIZE = 5
DELAYS = (1, 2, 5)

# Gap-Aware cases: (name, FTPipe optimizer, its keyword arguments).
GAP_AWARE = (
  [
    (f"sgd_m{m}_wd{wd}", "sgd1", dict(lr=0.1, momentum=m, weight_decay=wd))
    for m in (0.0, 0.9)
    for wd in (0.0, 0.05)
  ]
  + [
    (
      f"{opt}_wd{wd}",
      f"{opt}_record_step",
      dict(lr=0.01, betas=(0.9, 0.99), eps=1e-8, weight_decay=wd),
    )
    for opt in ("adam", "adamw")
    for wd in (0.0, 0.05)
  ]
  + [
    (
      "sgd_m0.9_wd0.05_scheduled",
      "sgd1",
      dict(lr=0.1, momentum=0.9, weight_decay=0.05),
    )
  ]
)

# Gap-Aware from the gradient (no stash: a stage one step late; FTPipe's
# apply_from_grad), for what FTPipe estimates it for: SGD, and Adam
# without weight decay.
GAP_FROM_GRAD = [
  (f"sgd_m{m}_wd{wd}", "sgd1", dict(lr=0.1, momentum=m, weight_decay=wd))
  for m in (0.0, 0.9)
  for wd in (0.0, 0.05)
] + [
  (
    "adam_wd0.0",
    "adam_record_step",
    dict(lr=0.01, betas=(0.9, 0.99), eps=1e-8, weight_decay=0.0),
  )
]

# The learning rate of the scheduled case per step (torch's LambdaLR, its
# running max tracked by FTPipe's patch_scheduler): a warm-up, a decay.
SCHEDULE = [
  0.1 * min((t + 1) / 3, 1.0) * 0.7 ** max(t - 2, 0) for t in range(STEPS)
]

_SGD = dict(lr=0.05, momentum=0.9)
_ADAM = dict(lr=0.05, betas=(0.9, 0.99), eps=1e-6)

# Weight prediction cases: (name, FTPipe optimizer, keyword arguments,
# predictor). aggmsnag takes the gradient accumulated so far (p.grad) as
# the first step's (for SGD with weight decay, FTPipe's sympy-derived form).
PREDICTION = [
  ("sgd", "sgd1", dict(_SGD, weight_decay=0.0), "msnag"),
  ("adam", "adam", dict(_ADAM, weight_decay=0.0), "msnag"),
  ("adam_wd", "adam", dict(_ADAM, weight_decay=0.05), "msnag"),
  ("adamw", "adamw", dict(_ADAM, weight_decay=0.05), "msnag"),
  ("sgd_wd_agg", "sgd1", dict(_SGD, weight_decay=0.05), "aggmsnag"),
  ("adam_agg", "adam", dict(_ADAM, weight_decay=0.0), "aggmsnag"),
  ("adamw_agg", "adamw", dict(_ADAM, weight_decay=0.05), "aggmsnag"),
]


def _import_ftpipe(root: str):
  """FTPipe's optimizer, Gap-Aware and weight prediction modules, imported
  from the checkout as ``pipe.*`` with the packages ``pipe`` and
  ``pipe.pipeline`` opened as bare folders (their ``__init__`` imports
  FTPipe's models and distributed runtime, which these modules do not
  use)."""
  import importlib
  import types

  for name in ("pipe", "pipe.pipeline"):
    package = types.ModuleType(name)
    package.__path__ = [os.path.join(root, *name.split("."))]
    sys.modules[name] = package
  # (FTPipe targets Python 3.7: its cow_dict imports this name.)
  collections.MutableMapping = collections.abc.MutableMapping
  return tuple(
    importlib.import_module(f"pipe.{m}")
    for m in (
      "optimizers",
      "pipeline.gap_aware",
      "pipeline.weight_prediction",
      "pipeline.true_weights_storage",
    )
  )


def _stream(seed: int):
  rng = np.random.default_rng(seed)
  grads = rng.normal(size=(STEPS, SIZE))
  offsets = rng.normal(size=(STEPS, SIZE)) * 0.05
  offsets[0] = 0.0  # The first step has no delay yet.
  return grads, offsets


def _gap_aware_of(gap_aware, name, opt):
  if name == "sgd1":
    return gap_aware.get_sgd_gap_aware_cls("sgd1")(opt)
  if name == "adam_record_step":
    return gap_aware.get_adam_gap_aware_cls()(opt)
  return gap_aware.get_adamw_gap_aware_cls()(opt)


def from_grad_trajectory(ftpipe, name, kwargs, theta0, grads):
  """The params after each step of a stage one step late without a
  stash: ``apply_gap_aware(delay=1)`` with neither theta runs
  ``apply_from_grad`` (the first step has no delay yet)."""
  import torch

  optimizers, gap_aware, _, _ = ftpipe
  p = torch.nn.Parameter(torch.tensor(theta0))
  opt = optimizers.AVAILBALE_OPTIMIZERS[name]([p], **kwargs)
  ga = _gap_aware_of(gap_aware, name, opt)
  out = []
  for i, g in enumerate(grads):
    p.grad = torch.tensor(g)
    ga.update_running_stats()
    if i:
      ga.apply_from_grad()
    opt.step()
    out.append(p.detach().numpy().copy())
  return np.stack(out)


def gap_aware_trajectory(ftpipe, case, name, kwargs, theta0, grads, offsets):
  import torch

  optimizers, gap_aware, _, _ = ftpipe
  p = torch.nn.Parameter(torch.tensor(theta0))
  opt = optimizers.AVAILBALE_OPTIMIZERS[name]([p], **kwargs)
  scheduler = None
  if "scheduled" in case:  # Made before Gap-Aware, as prepare_pipeline does.
    scheduler = torch.optim.lr_scheduler.LambdaLR(
      opt, lambda t: SCHEDULE[min(t, STEPS - 1)] / kwargs["lr"]
    )
  ga = _gap_aware_of(gap_aware, name, opt)
  if scheduler is not None:  # (The trainer's GapAwareTrainerMixin does.)
    ga.patch_scheduler(scheduler)
  out = []
  for i, (g, offset) in enumerate(zip(grads, offsets, strict=True)):
    real = p.detach().clone()
    p.data = real + torch.tensor(offset)  # The stashed weights, loaded.
    p.grad = torch.tensor(g)
    ga.update_running_stats()
    if i:  # (The delay: the partition manager's delay_at_batch.)
      ga.apply_on_theta([[real]])
    p.data = real  # true_weights_storage.restore_if_needed()
    opt.step()
    if scheduler is not None:
      scheduler.step()
    out.append(p.detach().numpy().copy())
  return np.stack(out)


def predictions(ftpipe, name, kwargs, pred_type, theta0, grads, phi):
  import torch

  optimizers, _, weight_prediction, true_weights_storage = ftpipe
  p = torch.nn.Parameter(torch.tensor(theta0))
  opt = optimizers.AVAILBALE_OPTIMIZERS[name]([p], **kwargs)
  storage = true_weights_storage.TrueWeightsStorage(opt)
  kind = "sgd1" if name == "sgd1" else name
  predictor = weight_prediction.get_weight_predictor(
    kind, "clone", pred_type, opt, None, False, storage, None
  )
  for g in grads:
    p.grad = torch.tensor(g)
    opt.step()
  p.grad = torch.tensor(phi) if pred_type == "aggmsnag" else None
  true = p.detach().numpy().copy()
  out = []
  for d in DELAYS:
    predictor.setup(d)
    predictor.forward()
    out.append(p.detach().numpy().copy())
    predictor.revert()
    assert np.array_equal(p.detach().numpy(), true)
  return true, np.stack(out)


def main():
  parser = argparse.ArgumentParser()
  parser.add_argument("--ftpipe", required=True, help="a checkout of FTPipe")
  root = parser.parse_args().ftpipe
  ftpipe = _import_ftpipe(root)
  theta0 = np.linspace(-1.0, 1.0, SIZE)
  arrays = {
    "theta0": theta0,
    "delays": np.array(DELAYS),
    "schedule": np.array(SCHEDULE),
  }
  for i, (case, name, kwargs) in enumerate(GAP_AWARE):
    grads, offsets = _stream(seed=i)
    arrays[f"gap_aware/{case}/grads"] = grads
    arrays[f"gap_aware/{case}/offsets"] = offsets
    arrays[f"gap_aware/{case}/params"] = gap_aware_trajectory(
      ftpipe, case, name, kwargs, theta0, grads, offsets
    )
  for i, (case, name, kwargs) in enumerate(GAP_FROM_GRAD):
    grads, _ = _stream(seed=200 + i)
    arrays[f"gap_from_grad/{case}/grads"] = grads
    arrays[f"gap_from_grad/{case}/params"] = from_grad_trajectory(
      ftpipe, name, kwargs, theta0, grads
    )
  for i, (case, name, kwargs, pred_type) in enumerate(PREDICTION):
    grads, phi = _stream(seed=100 + i)
    phi = phi[-1] * 20  # (A gradient's size.)
    true, predicted = predictions(
      ftpipe, name, kwargs, pred_type, theta0, grads, phi
    )
    arrays[f"prediction/{case}/grads"] = grads
    if pred_type == "aggmsnag":
      arrays[f"prediction/{case}/phi"] = phi
    arrays[f"prediction/{case}/params"] = true
    arrays[f"prediction/{case}/predicted"] = predicted
  np.savez(OUT, **arrays)
  print("wrote", len(arrays), "arrays to", OUT)


if __name__ == "__main__":
  main()
