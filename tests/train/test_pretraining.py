"""BERT's pre-training task: its loss is HuggingFace's BertForPreTraining
loss restated in NumPy; the seeds' BERT configs train through it."""

import os
import subprocess
import sys

import jax
import numpy as np
import pytest

from jpipe.train import config_plan, tasks
from jpipe.train.errors import UsageError

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(__file__)))
pytestmark = pytest.mark.usefixtures("fast_compiles")


def _log_softmax(x):
  x = x - x.max(-1, keepdims=True)
  return x - np.log(np.exp(x).sum(-1, keepdims=True))


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


@pytest.mark.slow
@pytest.mark.parametrize("name", ["sdpipe_bert.py", "dynpipe_bert.py"])
def test_bert_seed_small_variants_train(tmp_path, name):
  """As the docstrings run them (steps shortened): SD-Pipe's 4 pipelines
  with partial reduce, DynPipe's policy under a slowed device; the
  held-out masked-LM loss falls."""
  done = subprocess.run(
    [
      sys.executable,
      "-m",
      "jpipe.train",
      "--config",
      f"configs/seeds/{name}:small",
      "--workdir",
      str(tmp_path / "small"),
      "--config.train.steps=40",
      "--config.train.eval_every=20",
    ],
    cwd=ROOT,
    capture_output=True,
    text=True,
    timeout=600,
    env=dict(os.environ, PYTHONPATH=ROOT, JAX_DISABLE_MOST_OPTIMIZATIONS="1"),
  )
  assert done.returncode == 0, done.stderr[-3000:]
  out = done.stdout + done.stderr
  losses = [
    float(line.split("eval mlm_loss ")[1].split(",")[0])
    for line in out.splitlines()
    if "eval mlm_loss " in line and line.startswith("step ")
  ]
  assert len(losses) >= 2 and losses[-1] < losses[0], out[-2000:]
