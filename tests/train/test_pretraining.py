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


@pytest.mark.slow
def test_loss_is_masked_lm_plus_next_sentence():
  config = config_plan.load_config_file("configs/seeds/sdpipe_bert.py:small")
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
