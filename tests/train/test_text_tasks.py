"""Text tasks of TFDS datasets by format (GLUE-style classification,
SQuAD-style QA, translation) on TFDS mock data: the records are the
tests' own, well-formed and learnable, served through the real
``tfds.data_source`` path."""

import contextlib
import math
import os

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import tensorflow_datasets as tfds

from jpipe.train import (
  base_config,
  config_check,
  config_plan,
  input_pipeline,
  tasks,
  text_tasks,
  train_lib,
)
from jpipe.train.errors import UsageError
from jpipe.train.tasks import check_task
from tests.tiers import slow

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(__file__)))
WORDS = "red green blue cyan gold pink gray jade lime navy plum rose".split()


def _words(rng, n):
  return " ".join(rng.choice(WORDS, size=n))


def _rte_records(n, seed):
  """Pairs labelled 0 (entailment) when sentence2's first word occurs in
  sentence1, else 1."""
  rng = np.random.default_rng(seed)
  out = []
  for i in range(n):
    first = _words(rng, 4)
    word = rng.choice(WORDS)
    out.append(
      {
        "idx": np.int32(i),
        "sentence1": first,
        "sentence2": f"{word} {_words(rng, 2)}",
        "label": np.int64(0 if word in first.split() else 1),
      }
    )
  return out


def _squad_records(n, seed):
  """Contexts holding "answer: WORD" somewhere among other words."""
  rng = np.random.default_rng(seed)
  out = []
  for i in range(n):
    before, after = _words(rng, rng.integers(0, 4)), _words(rng, 3)
    word = rng.choice(WORDS)
    context = f"{before} answer: {word} {after}".strip()
    start = context.index(f"answer: {word}") + len("answer: ")
    out.append(
      {
        "id": str(i),
        "title": "t",
        "question": "which word?",
        "context": context,
        "answers": {
          "text": np.array([word]),
          "answer_start": np.array([start], np.int32),
        },
      }
    )
  return out


def _translation_records(n, seed):
  """Portuguese -> English: the words in reverse order."""
  rng = np.random.default_rng(seed)
  out = []
  for _ in range(n):
    words = list(rng.choice(WORDS, size=3))
    out.append({"pt": " ".join(words), "en": " ".join(words[::-1])})
  return out


DATASETS = {
  "classification": (
    lambda: base_config.text_classification_data(
      "glue/rte", "sentence1,sentence2"
    ),
    _rte_records,
  ),
  "qa": (lambda: base_config.qa_data("squad"), _squad_records),
  "translation": (
    lambda: base_config.translation_data(
      "ted_hrlr_translate/pt_to_en", "pt", "en"
    ),
    _translation_records,
  ),
}


@contextlib.contextmanager
def _mock(fmt, train=64, test=24):
  """TFDS mock data serving the format's records by split."""
  records = DATASETS[fmt][1]
  by_split = {"train": records(train, 0), "validation": records(test, 1)}

  def as_data_source(builder, split, **kwargs):
    del builder, kwargs
    return by_split[str(split)]

  with tfds.testing.mock_data(as_data_source_fn=as_data_source):
    yield


def _config(fmt, model, **kwargs):
  c = base_config.base_config()
  c.data = DATASETS[fmt][0]()
  c.data.batch_size = 8
  c.data.sequence_length = 48
  c.data.target_length = 16
  c.model.name = model
  c.model.kwargs.vocab_size = 257  # Bytes shifted past padding.
  c.model.kwargs.width = 32
  if model == "gpt":
    c.model.kwargs.num_layers = 2
    c.model.kwargs.max_length = 48
    c.model.kwargs.num_classes = {"translation": 0}.get(fmt, 2)
  c.optimizer.name = "adam"
  c.optimizer.learning_rate = 3e-3
  c.pipeline.num_stages = 2
  c.pipeline.num_microbatches = 2
  c.train.steps = 2
  c.train.eval_every = 2
  c.train.log_every = 1
  c.train.profile_last_step = False
  for key, value in kwargs.items():
    section, name = key.split(".")
    c[section][name] = value
  return c


TOKEN_LOSS = {"loss", "perplexity", "tokens"}  # (Tokens: those scored.)
METRICS = {
  ("classification", "gpt"): {"accuracy"},
  ("classification", "t5"): {"accuracy", *TOKEN_LOSS},
  ("qa", "gpt"): {"span_exact_match", "span_f1"},
  ("qa", "t5"): {"teacher_forced_exact_match", *TOKEN_LOSS},
  ("translation", "gpt"): TOKEN_LOSS,
  ("translation", "t5"): {"teacher_forced_exact_match", *TOKEN_LOSS},
}


@pytest.mark.parametrize(
  "fmt, model",
  [slow(*k) if k[0] == "classification" else k for k in sorted(METRICS)],
)
def test_every_format_is_posed_for_both_kinds_of_model(fmt, model):
  config = _config(fmt, model)
  with _mock(fmt):
    task = check_task(tasks.build_task(config), "test")
  posing = {"classification": "classify", "qa": "span"}.get(fmt, "prefix_lm")
  if model == "t5":
    posing = "text_to_text"
  assert task.kind == f"{fmt} ({posing})"
  batch = task.batch_at(0)
  loss = jax.jit(task.loss_fn)(task.params, batch)
  assert math.isfinite(float(loss))
  metrics = task.evaluation.on_one_device(task.params, None)
  assert set(metrics) == METRICS[fmt, model]
  assert all(math.isfinite(v) for v in metrics.values())


def _reference_loss(fmt, model, logits, batch):
  """The task's loss restated in NumPy from the model's output."""
  logits = np.asarray(logits, np.float64)
  logp = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
  if model == "t5":
    t = batch["targets"]
    picked = np.take_along_axis(logp, t[..., None], -1)[..., 0]
    return -(picked * (t > 0)).sum() / (t > 0).sum()
  if fmt == "classification":
    rows = np.arange(len(batch["y"]))
    return -logp[rows, batch["last"], batch["y"]].mean()
  if fmt == "qa":
    start, end = batch["start"][:, 0], batch["end"][:, 0]
    has = start >= 0
    scores = logits.transpose(0, 2, 1)  # [B, 2, L]
    lp = scores - np.log(np.exp(scores).sum(-1, keepdims=True))
    rows = np.arange(len(start))
    per = -(lp[rows, 0, np.maximum(start, 0)] + lp[rows, 1, np.maximum(end, 0)])
    return (0.5 * per * has).sum() / has.sum()
  y, mask = batch["y"], batch["mask"]
  picked = np.take_along_axis(logp, y[..., None], -1)[..., 0]
  return -(picked * mask).sum() / mask.sum()


@pytest.mark.parametrize("fmt, model", sorted(METRICS))
def test_loss_equals_its_restatement(fmt, model):
  config = _config(fmt, model)
  with _mock(fmt):
    task = tasks.build_task(config)
  batch = task.batch_at(3)
  from jpipe.models import gpt, t5

  module = {"gpt": gpt, "t5": t5}[model].Model(**config.model.kwargs)
  inputs = (
    (batch["inputs"], batch["targets"]) if model == "t5" else (batch["x"],)
  )
  logits = module.apply({"params": task.params}, *inputs, train=False)
  expected = _reference_loss(fmt, model, logits, batch)
  np.testing.assert_allclose(
    float(task.loss_fn(task.params, batch)), expected, rtol=2e-5
  )


def test_best_span_against_brute_force():
  rng = np.random.default_rng(0)
  start, end = rng.normal(size=(2, 5, 40)).astype(np.float32)
  ps, pe = text_tasks.best_span(jnp.asarray(start), jnp.asarray(end))
  for b in range(5):
    best = max(
      (start[b, s] + end[b, e], s, e)
      for s in range(40)
      for e in range(s, min(40, s + text_tasks.MAX_ANSWER_TOKENS))
    )
    assert (int(ps[b]), int(pe[b])) == best[1:]


def _f1_reference(ps, pe, golds):
  """SQuAD's F1 on token sets, the best over the gold spans."""
  best = 0.0
  predicted = set(range(ps, pe + 1))
  for gs, ge in golds:
    if gs < 0:
      continue
    gold = set(range(gs, ge + 1))
    common = len(predicted & gold)
    if common:
      p, r = common / len(predicted), common / len(gold)
      best = max(best, 2 * p * r / (p + r))
  return best


def test_span_scores_against_token_set_f1():
  rng = np.random.default_rng(1)
  ps = rng.integers(0, 20, size=50)
  pe = ps + rng.integers(-2, 6, size=50)  # Some empty predictions.
  gs = rng.integers(-1, 20, size=(50, 3))
  ge = np.where(gs >= 0, gs + rng.integers(0, 5, size=(50, 3)), -1)
  pe[:5] = ps[:5] + 1  # Some exact matches.
  gs[:5, 1], ge[:5, 1] = ps[:5], pe[:5]
  exact, f1 = text_tasks.span_scores(
    jnp.asarray(ps), jnp.asarray(pe), jnp.asarray(gs), jnp.asarray(ge)
  )
  for i in range(50):
    golds = list(zip(gs[i], ge[i], strict=True))
    np.testing.assert_allclose(
      float(f1[i]), _f1_reference(ps[i], pe[i], golds), atol=1e-6
    )
    hit = any(g == (ps[i], pe[i]) for g in golds if g[0] >= 0)
    assert bool(exact[i]) == hit
  assert float(f1[:5].min()) == 1.0


def test_pooled_reads_the_last_real_token():
  logits = jnp.arange(2 * 4 * 3, dtype=jnp.float32).reshape(2, 4, 3)
  last = jnp.array([1, 3])
  np.testing.assert_array_equal(
    text_tasks.pooled(logits, last), np.stack([logits[0, 1], logits[1, 3]])
  )
  np.testing.assert_array_equal(
    text_tasks.pooled(logits[:, 0], last), logits[:, 0]
  )


@pytest.mark.slow
def test_span_task_learns_through_the_pipeline(tmp_path):
  """GPT with a span head finds "answer: WORD" in the context: exact
  match far above chance after training through 2 stages (1F1B), the
  evaluation run forward through the stages."""
  config = _config("qa", "gpt", **{"train.steps": 120, "train.eval_every": 120})
  config.train.log_every = 40
  with _mock("qa", train=256, test=32):
    summary = train_lib.train_and_evaluate(config, str(tmp_path))
  assert summary["eval"]["span_exact_match"] > 0.8, summary["eval"]


@pytest.mark.parametrize(
  "fmt, model, change, message",
  [
    ("classification", "gpt", {"model.kwargs": {}}, "num_classes=2"),
    ("qa", "gpt", {}, "vocab_size=200 cannot hold the 257 ids"),
    ("classification", "t5", {"data.eval_split": "test"}, "label -1"),
    ("translation", "gpt", {"data.source_key": "fr"}, "no feature 'fr'"),
    ("qa", "t5", {"data.format": "squad"}, "config.data.format='squad'"),
  ],
)
def test_bad_text_task_configs_are_one_clear_error(fmt, model, change, message):
  config = _config(fmt, model)
  if change == {"model.kwargs": {}}:
    config.model.kwargs.num_classes = 0
  elif not change:
    config.model.kwargs.vocab_size = 200
  else:
    for key, value in change.items():
      section, name = key.split(".")
      config[section][name] = value
  test_records = DATASETS[fmt][1](8, 2)
  for r in test_records:
    if "label" in r:
      r["label"] = np.int64(-1)  # As GLUE's hidden test labels.

  def as_data_source(builder, split, **kwargs):
    del builder, kwargs
    return test_records if str(split) == "test" else DATASETS[fmt][1](16, 0)

  with tfds.testing.mock_data(as_data_source_fn=as_data_source):
    with pytest.raises(UsageError, match=message.replace("(", r"\(")):
      tasks.build_task(config)


def _by_name(records):
  """as_data_source_fn serving ``records(n, seed)`` for every split."""

  def as_data_source(builder, split, **kwargs):
    del builder, kwargs
    return records(16, 0 if str(split) == "train" else 1)

  return as_data_source


def _wmt_records(n, seed):
  return [{"en": r["pt"], "de": r["en"]} for r in _translation_records(n, seed)]


@pytest.mark.parametrize(
  "variant, records, generated",
  [
    ("rte", _rte_records, {"generated_accuracy"}),
    ("squad", _squad_records, {"generated_exact_match", "generated_f1"}),
    ("wmt16_en_de", _wmt_records, {"bleu"}),
    ("squad,gpt", _squad_records, set()),
    ("wmt16_en_de,gpt", _wmt_records, set()),
  ],
)
@pytest.mark.slow
def test_text_tasks_config_trains_on_mock_data(
  variant, records, generated, tmp_path, capsys
):
  """Each variant trains; T5's (an outside check found the config's T5
  decoded nothing: no BLEU, no SQuAD scores) score generated text."""
  path = os.path.join(ROOT, "configs", "text_tasks.py")
  config = config_plan.load_config_file(f"{path}:{variant}")
  config.unlock()
  config.data.batch_size = 8
  config.data.sequence_length = 48
  config.data.target_length = 8
  config.model.kwargs.num_layers = 1  # (The data and config under test.)
  if config.model.name == "gpt":
    config.model.kwargs.width = 32
    config.model.kwargs.max_length = 48
  else:
    config.model.kwargs.update(d_model=32, d_kv=8, d_ff=64)
  config.optimizer.warmup_steps = 1
  config.pipeline.num_stages = 2  # (Quick to compile; 4 in the config.)
  config.train.steps = 2
  config.train.eval_every = 2
  config.train.checkpoint_every = 2
  config.train.profile_last_step = False
  config_check.check(config)
  with tfds.testing.mock_data(as_data_source_fn=_by_name(records)):
    summary = train_lib.train_and_evaluate(config, str(tmp_path))
  assert all(math.isfinite(v) for v in summary["eval"].values())
  assert generated <= set(summary["eval"]), summary["eval"]
  if variant == "wmt16_en_de":  # 8 tokens hold no reference sentence.
    assert "their generated scores are capped" in capsys.readouterr().out


def test_every_text_tasks_variant_is_a_valid_config():
  path = os.path.join(ROOT, "configs", "text_tasks.py")
  for dataset in (
    "rte",
    "sst2",
    "mnli",
    "boolq",
    "wic",
    "squad",
    "wmt16_en_de",
  ):
    for model in ("t5", "gpt"):
      config = config_plan.load_config_file(f"{path}:{dataset},{model}")
      config_check.check(config)
  with pytest.raises(ValueError, match="DATASET one of"):
    config_plan.load_config_file(f"{path}:cola")


def test_t5_text_to_text_with_a_sentencepiece_tokenizer(tmp_path):
  """T5's tokenizer pads with 0 and ends with </s>: ids are not shifted,
  targets are the label's name then </s>."""
  from jpipe.data import tokenizers
  from tests.data import tokenizer_files

  path = tokenizer_files.sentencepiece_model(tmp_path)
  config = _config("classification", "t5")
  config.data.tokenizer = path
  config.model.kwargs.vocab_size = tokenizer_files.VOCAB
  with _mock("classification"):
    task = tasks.build_task(config)
  spiece = tokenizers.load(path)
  batch = task.batch_at(0)
  records = {r["sentence1"]: r for r in _rte_records(64, 0)}
  names = ["entailment", "not_entailment"]
  for inputs, targets in zip(batch["inputs"], batch["targets"], strict=True):
    text = spiece.decode([i for i in inputs if i > 1])
    sentence1 = text.split("sentence1: ")[1].split(" sentence2:")[0]
    label = int(records[sentence1]["label"])
    ids = [int(i) for i in targets if i > 0]
    assert ids[-1] == spiece.end_id == 1
    assert spiece.decode(ids[:-1]) == names[label]


class MeanPooled(nn.Module):
  """The user's one-input classifier: embedded tokens, two named blocks,
  scores [B, classes] of the mean over real tokens."""

  classes: int = 2
  width: int = 16

  @nn.compact
  def __call__(self, tokens, deterministic: bool = True):
    real = (tokens > 0)[..., None].astype(jnp.float32)
    x = nn.Embed(257, self.width, name="embed")(tokens)
    for i in range(2):
      x = x + nn.relu(nn.Dense(self.width, name=f"block_{i}")(x))
    pooled = (x * real).sum(1) / jnp.maximum(real.sum(1), 1.0)
    return nn.Dense(self.classes, name="head")(pooled)


@pytest.mark.slow
def test_the_users_module_by_path_on_text_classification(tmp_path):
  config = _config("classification", "gpt")
  config.model.name = "tests.train.test_text_tasks:MeanPooled"
  config.model.kwargs = {"classes": 2}
  with _mock("classification"):
    summary = train_lib.train_and_evaluate(config, str(tmp_path))
  assert set(summary["eval"]) == {"accuracy"}
  config.model.kwargs = {"classes": 3}
  with _mock("classification"):
    with pytest.raises(UsageError, match=r"scores \[batch, 2\]"):
      tasks.build_task(config)


@pytest.mark.parametrize(
  "fmt, head", [slow("classification", "classification"), ("qa", "qa")]
)
def test_bert_heads_on_text_tasks(fmt, head):
  """BERT as published with its classification head (pooled [CLS]) or
  span head, posed like any one-input model."""
  config = _config(fmt, "gpt")
  config.model.name = "bert"
  config.model.kwargs = {
    "vocab_size": 257,
    "max_position": 48,
    "d_model": 24,
    "num_layers": 2,
    "num_heads": 3,
    "d_ff": 40,
    "dropout": 0.0,
    "head": head,
    "num_classes": 2,
  }
  with _mock(fmt):
    task = check_task(tasks.build_task(config), "test")
  assert (
    task.kind == f"{fmt} ({'classify' if head == 'classification' else 'span'})"
  )
  metrics = task.evaluation.on_one_device(task.params, None)
  assert all(math.isfinite(v) for v in metrics.values())
  config.data = base_config.text_data()
  with pytest.raises(UsageError, match="trains on a text task's data"):
    tasks.build_task(config)


def test_an_unprepared_text_dataset_suggests_only_what_fits(tmp_path):
  """It suggested the embedded stdlib_text for any text task (a byte
  stream: no 'validation' split, no 'label'); a data_dir that does not
  exist got TFDS's 'already prepared ... TFRECORD' text."""
  config = _config("classification", "t5")
  config.data.data_dir = str(tmp_path)
  with pytest.raises(UsageError) as error:
    input_pipeline.records(config, "train")
  assert "tfds build glue/rte" in str(error.value)
  assert "embedded" not in str(error.value)
  config = _config("qa", "t5")
  config.data.data_dir = str(tmp_path)
  with pytest.raises(UsageError, match="config.data.name='stdlib_qa'"):
    input_pipeline.records(config, "train")
  config.data.data_dir = str(tmp_path / "nowhere")
  with pytest.raises(UsageError, match=r"nowhere' does not exist\. Prepare"):
    input_pipeline.records(config, "train")
