"""BERT's pre-training as a Task: masked LM + next sentence on a text.

``config.data`` from ``base_config.text_data(name, masked_lm=True)`` (the
embedded text, a TFDS text dataset such as ``wikipedia/20230601.en`` or
text files) and a model whose output is (masked-LM logits [B, L, vocab],
next-sentence logits [B, 2]) -- ``jpipe.models.bert`` with head
"pretraining". Examples: ``jpipe.data.masked_lm``. The loss is
HuggingFace's ``BertForPreTraining``'s: the mean cross entropy over the
chosen tokens plus the mean next-sentence cross entropy. Held out: the
same examples drawn from the evaluation split at fixed steps; metrics
masked-LM accuracy, loss and perplexity, next-sentence accuracy.
"""

import jax
import jax.numpy as jnp
import numpy as np

from jpipe.data import masked_lm
from jpipe.train import evaluation as evaluation_lib
from jpipe.train import model_calls
from jpipe.train.errors import UsageError
from jpipe.train.task import Task


def build(config, model, tokenizer, train, test, abstract=False) -> Task:
  """The pre-training Task of ``model`` on token streams ``train`` and
  ``test`` (``tokenizer``'s ids); ``abstract`` as ``tasks.build_task``'s."""
  data = config.data
  vocab = masked_lm.Vocabulary.of(tokenizer)
  have = getattr(model, "vocab_size", None)
  if isinstance(have, int) and have < vocab.size:
    raise UsageError(
      f"config.model.kwargs.vocab_size={have} cannot hold the {vocab.size} "
      f"ids of {tokenizer.name} with [CLS], [SEP] and [MASK] "
      f"({vocab.cls}, {vocab.sep}, {vocab.mask}): use >= {vocab.size}"
    )

  def examples_at(step, stream=train, seed=config.seed):
    return masked_lm.pretraining_batch(
      stream,
      step,
      data.batch_size,
      data.sequence_length,
      seed,
      vocab,
      data.mask_rate,
    )

  example = examples_at(0)
  first = jax.tree.map(lambda x: x[:1], example)
  train_kw = model_calls.mode_kwargs(model, True)
  eval_kw = model_calls.mode_kwargs(model, False)
  params = model_calls.initialize(
    model, abstract, config.seed, first["x"], first["types"], **eval_kw
  )["params"]
  out = jax.eval_shape(
    lambda p: model.apply(
      {"params": p}, example["x"], example["types"], **eval_kw
    ),
    params,
  )
  _check_outputs(config, out, example["x"].shape)
  batch_at, rngs_of = model_calls.with_dropout(
    config,
    examples_at,
    model_calls.needs_dropout_key(
      model, {"params": params}, first["x"], first["types"]
    ),
  )

  batches = max(1, -(-data.eval_sequences // data.batch_size))
  held = [examples_at(k, test, config.seed + 1) for k in range(batches)]
  held_out = {k: np.concatenate([h[k] for h in held]) for k in held[0]}
  return Task(
    "masked_lm",
    _loss_fn(model, rngs_of, train_kw),
    params,
    None,
    batch_at,
    evaluation=evaluation_lib.held_out(
      _sums_fn(model, eval_kw), held_out, data.batch_size, _metrics
    ),
  )


def _loss_fn(model, rngs_of, train_kw):
  """``loss(params, batch)``: HF ``BertForPreTraining``'s, the mean cross
  entropy over the chosen tokens plus the mean next-sentence one."""

  def loss_fn(params, batch):
    mlm, nsp = model.apply(
      {"params": params},
      batch["x"],
      batch["types"],
      rngs=rngs_of(batch),
      **train_kw,
    )
    mlm_loss = model_calls.mean_token_loss(
      mlm, batch["mlm_labels"], batch["mlm_weights"]
    )
    nsp_loss = model_calls.cross_entropy(nsp, batch["nsp_labels"]).mean()
    return mlm_loss + nsp_loss

  return loss_fn


def _sums_fn(model, eval_kw):
  """``sums(params, batch)``: a held-out batch's weighted totals (token
  loss sums, masked-LM and next-sentence hits, examples)."""

  def sums(params, batch):
    mlm, nsp = model.apply(
      {"params": params}, batch["x"], batch["types"], **eval_kw
    )
    weight = batch["weight"]
    chosen = batch["mlm_weights"] * weight[:, None]
    hits = jnp.argmax(mlm, -1) == batch["mlm_labels"]
    nsp_hits = jnp.argmax(nsp, -1) == batch["nsp_labels"]
    return {
      **model_calls.token_sums(mlm, batch["mlm_labels"], chosen),
      "mlm_correct": jnp.sum(hits * chosen),
      "nsp_correct": jnp.sum(nsp_hits * weight),
      "count": jnp.sum(weight),
    }

  return sums


def _metrics(totals: dict) -> dict:
  """Masked-LM accuracy, loss and perplexity; next-sentence accuracy."""
  return {
    "mlm_accuracy": totals["mlm_correct"] / totals["tokens"],
    **{f"mlm_{k}": v for k, v in evaluation_lib.token_loss(totals).items()},
    "nsp_accuracy": totals["nsp_correct"] / totals["count"],
  }


def _check_outputs(config, out, shape) -> None:
  """The model's output must be (masked-LM logits [B, L, V], next-sentence
  logits [B, 2])."""
  ok = (
    isinstance(out, (tuple, list))
    and len(out) == 2
    and out[0].shape[:2] == tuple(shape)
    and out[1].shape == (shape[0], 2)
  )
  if not ok:
    got = jax.tree.map(lambda x: list(x.shape), out)
    raise UsageError(
      f"config.model ({config.model.name}) on masked-LM data must return "
      f"(masked-LM logits [B, L, vocab], next-sentence logits [B, 2]); it "
      f"returned {got} (jpipe's bert: config.model.kwargs.head='pretraining')"
    )
