"""BERT's pre-training task: its loss is HuggingFace's BertForPreTraining
loss restated in NumPy (the seeds' BERT configs train through it:
tests/train/test_seed_plans.py)."""

import os

import jax
import numpy as np
import pytest

from jpipe.train import config_plan, tasks
from jpipe.train.errors import UsageError

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(__file__)))


def _log_softmax(x):
  x = x - x.max(-1, keepdims=True)
  return x - np.log(np.exp(x).sum(-1, keepdims=True))


def test_loss_is_masked_lm_plus_next_sentence():
  """The loss, and the held-out metrics (masked-LM accuracy and loss over
  the chosen tokens, next-sentence accuracy) restated over the held-out
  set, on the small config with eval_sequences 20 (held out: whole
  batches, two of 16)."""
  config = config_plan.load_config_file("configs/seeds/sdpipe_bert.py:small")
  config.data.eval_sequences = 20
  task = tasks.build_task(config)
  assert task.kind == "masked_lm"
  batch = task.batch_at(3)
  loss = float(task.loss_fn(task.params, batch))
  model = tasks._jpipe_model("bert").Model(**tasks.model_kwargs(config))
  mlm, nsp = model.apply(
    {"params": task.params}, batch["x"], batch["types"], train=False
  )
  mlm, nsp = np.asarray(mlm, np.float64), np.asarray(nsp, np.float64)
  chosen = batch["mlm_weights"] > 0
  token_nll = -np.take_along_axis(
    _log_softmax(mlm), batch["mlm_labels"][..., None], -1
  )[..., 0]
  nsp_nll = -np.take_along_axis(
    _log_softmax(nsp), batch["nsp_labels"][:, None], -1
  )[:, 0]
  want = token_nll[chosen].mean() + nsp_nll.mean()
  assert loss == pytest.approx(want, rel=1e-5)
  _check_evaluation(task, model)
  # Abstract (for planning): the same shapes.
  abstract = tasks.build_task(config, abstract=True)
  assert jax.tree.map(lambda x: x.shape, abstract.params) == jax.tree.map(
    lambda x: x.shape, task.params
  )


def test_a_model_without_the_pretraining_outputs_is_refused():
  config = config_plan.load_config_file("configs/seeds/sdpipe_bert.py:small")
  config.model.kwargs.head = "classification"
  with pytest.raises(UsageError, match=r"must return \(masked-LM logits"):
    tasks.build_task(config)
  config.model.kwargs.head = "pretraining"
  config.model.kwargs.vocab_size = 100
  with pytest.raises(UsageError, match="vocab_size=100 cannot hold the 260"):
    tasks.build_task(config)


def _check_evaluation(task, model):
  """``task.evaluation`` on one device against the metrics restated in
  NumPy over the held-out examples (any padding rows left out)."""
  got = task.evaluation.on_one_device(task.params, None)
  apply = jax.jit(
    lambda x, types: model.apply({"params": task.params}, x, types, train=False)
  )
  hits = tokens = nll = nsp_hits = count = 0.0
  for batch in task.evaluation.batches():
    real = batch["weight"] > 0
    mlm, nsp = apply(batch["x"], batch["types"])
    mlm, nsp = np.asarray(mlm, np.float64)[real], np.asarray(nsp)[real]
    chosen = batch["mlm_weights"][real] > 0
    labels = batch["mlm_labels"][real]
    token_nll = -np.take_along_axis(_log_softmax(mlm), labels[..., None], -1)
    nll += token_nll[..., 0][chosen].sum()
    hits += (mlm.argmax(-1) == labels)[chosen].sum()
    tokens += chosen.sum()
    nsp_hits += (nsp.argmax(-1) == batch["nsp_labels"][real]).sum()
    count += real.sum()
  assert count == 32
  assert got["mlm_accuracy"] == pytest.approx(hits / tokens, rel=1e-6)
  assert got["mlm_loss"] == pytest.approx(nll / tokens, rel=1e-5)
  assert got["mlm_perplexity"] == pytest.approx(np.exp(nll / tokens), rel=1e-4)
  assert got["nsp_accuracy"] == pytest.approx(nsp_hits / count, rel=1e-6)
