r"""Fine-tuning on TFDS text tasks: GLUE / SuperGLUE classification, SQuAD,
translation; text-to-text for T5, with a head for GPT.

The argument is DATASET[,MODEL]: DATASET one of the rows below, MODEL
``t5`` (default: text-to-text with T5 as published, ``jpipe.models.t5_v1``,
as FTPipe fine-tunes T5 on RTE, BoolQ, WiC and SQuAD; its greedy decoding
scores the generated text as the papers do: label accuracy, SQuAD's exact
match and F1, BLEU) or ``gpt`` (a classification head on the last token, a span
head for SQuAD, a prefix language model for translation). Fields:
jpipe/train/base_config.py (``text_classification_data``, ``qa_data``,
``translation_data``); how each task is posed: jpipe/train/text_tasks.py.

The datasets are TFDS's and are not embedded: prepare one where there is
internet, e.g. ``tfds build glue/rte --data_dir DIR --file_format
array_record``, then run:

  python -m jpipe.train --config configs/text_tasks.py:rte,t5 \
      --workdir /tmp/jpipe_rte --config.data.data_dir=DIR

Expected: not measured yet -- no TFDS text dataset can be prepared on the
machine jpipe is built on (no internet). The tests train every variant on
TFDS mock data through the real data-source path, and a 2-layer GPT with
a span head learns a synthetic SQuAD-style task (exact match > 0.8 after
120 steps through 2 stages).

Byte-level tokens unless ``--config.data.tokenizer=PATH`` names T5's
``spiece.model`` or a ``tokenizer.json`` (then set
``--config.model.kwargs.vocab_size`` to its size, plus one where it does
not pad with 0). Start from pretrained params with ``--config.init_from``
(``--config.init_keep=head/`` keeps a new GPT head random).
"""

from jpipe.train.base_config import (
  base_config,
  qa_data,
  text_classification_data,
  translation_data,
)

# Dataset variants: (data fields, a new head's classes for GPT).
DATASETS = {
  "rte": (
    lambda: text_classification_data("glue/rte", "sentence1,sentence2"),
    2,
  ),
  "sst2": (lambda: text_classification_data("glue/sst2", "sentence"), 2),
  "mnli": (
    lambda: text_classification_data("glue/mnli", "premise,hypothesis"),
    3,
  ),
  "boolq": (
    lambda: text_classification_data("super_glue/boolq", "question,passage"),
    2,
  ),
  "wic": (
    lambda: text_classification_data(
      "super_glue/wic", "word,sentence1,sentence2"
    ),
    2,
  ),
  "squad": (lambda: qa_data("squad"), 2),
  "wmt16_en_de": (lambda: translation_data("wmt16_translate/de-en"), 0),
}


def get_config(arg: str = "rte"):
  dataset, _, model = arg.partition(",")
  model = model or "t5"
  if dataset not in DATASETS or model not in ("t5", "gpt"):
    raise ValueError(
      f"configs/text_tasks.py:{arg}: use DATASET[,MODEL] with DATASET one "
      f"of {sorted(DATASETS)} and MODEL t5 or gpt"
    )
  data, classes = DATASETS[dataset]
  c = base_config()
  c.data = data()
  if dataset == "mnli":
    c.data.eval_split = "validation_matched"
  c.model.name = "gpt" if model == "gpt" else "t5_v1"
  c.model.kwargs.vocab_size = 257  # Bytes shifted past padding id 0.
  c.model.kwargs.num_heads = 4
  if model == "gpt":
    c.model.kwargs.width = 128
    c.model.kwargs.num_layers = 4
    # The whole input: source + target for translation.
    c.model.kwargs.max_length = c.data.sequence_length
    c.model.kwargs.num_classes = classes
  else:  # A small T5 (--config.model.size=... for a published one).
    c.model.kwargs.d_model = 128
    c.model.kwargs.d_kv = 32
    c.model.kwargs.d_ff = 512
    c.model.kwargs.num_layers = 2  # Per stack (encoder, decoder).

  c.optimizer.name = "adamw"
  c.optimizer.learning_rate = 1e-3
  c.optimizer.weight_decay = 0.01
  c.optimizer.schedule = "warmup_linear"  # BERT's fine-tuning schedule.
  c.optimizer.warmup_steps = 100
  c.optimizer.clip_norm = 1.0

  c.pipeline.num_stages = 4
  c.pipeline.num_microbatches = 4
  c.schedule.name = "1f1b"
  c.train.steps = 1000
  c.train.eval_every = 250
  c.train.checkpoint_every = 250
  return c
