r"""DynPipe's BERT: pre-training on BookCorpus on 8 devices, re-partitioning
when a device slows down.

Seed 003 (DynPipe): BERT pre-training on BookCorpus in PipeDream's
asynchronous 1F1B with weight stashing on 8 GPUs; under interference its
predictor re-partitions the layers. Throughput: GPipe 76.1, PipeDream
150.7, DynPipe 180.9 sequences/s (spec: pipedream_dynpipe_sdpipe.md, B;
its BERT's size and optimizer are not in the spec: BERT-base, AdamW 1e-4
with warm-up, sequence length 128 here). "small": the same code path
(BERT's pre-training on the embedded text, 4 stages, async with
stashing, DynPipe's policy with device 1 slowed 3x mid-run, simulated
compute) in under two minutes on 2 CPU cores.

BookCorpus is not in TFDS: name its text files.
Plan:   python -m jpipe.train.plan --config configs/seeds/dynpipe_bert.py
Train (8 GPUs; bert-base-uncased's tokenizer.json):
  python -m jpipe.train --config configs/seeds/dynpipe_bert.py \
      --workdir /tmp/dyn_bert --config.data.tokenizer=tokenizer.json \
      --config.data.train_split='/data/bookcorpus/books_*.txt' \
      --config.data.eval_split=/data/bookcorpus/held_out.txt
"""

from jpipe.train.base_config import base_config, text_data


def get_config(variant: str = ""):
  c = base_config()
  c.model.name = "bert"
  c.model.kwargs.head = "pretraining"
  c.optimizer.name = "adamw"
  c.optimizer.weight_decay = 1e-2
  c.optimizer.schedule = "warmup_linear"
  c.schedule.name = "async"
  c.staleness.stashing = True
  c.dynamic.enabled = True
  c.dynamic.policy = "dynpipe"
  if variant == "small":
    c.data = text_data("stdlib_text", masked_lm=True)
    c.data.batch_size = 16
    c.data.sequence_length = 32
    c.data.eval_sequences = 64
    c.model.kwargs.vocab_size = 260  # Bytes, shifted, + [CLS] [SEP] [MASK].
    c.model.kwargs.max_position = 32
    c.model.kwargs.d_model = 32
    c.model.kwargs.d_ff = 64
    c.model.kwargs.num_layers = 4
    c.model.kwargs.num_heads = 2
    c.model.kwargs.dropout = 0.0
    c.optimizer.learning_rate = 2e-3
    c.optimizer.warmup_steps = 10
    c.pipeline.num_stages = 4
    c.pipeline.num_microbatches = 4
    c.dynamic.window = 10
    c.dynamic.horizon_steps = 40
    c.dynamic.simulated_ms = 40.0
    c.dynamic.inject = "1:3.0:30:80"
    c.train.steps = 100
    c.train.eval_every = 50
    c.train.checkpoint_every = 100
    return c
  if variant:
    raise ValueError(f"variant {variant!r}: '' or small")
  c.data = text_data("text_files", masked_lm=True)
  c.data.train_split = "books_*.txt"
  c.data.eval_split = "held_out.txt"
  c.data.batch_size = 64
  c.data.sequence_length = 128
  c.model.size = "base"
  c.optimizer.learning_rate = 1e-4
  c.optimizer.warmup_steps = 10_000
  c.pipeline.num_stages = 8
  c.pipeline.num_microbatches = 8
  c.train.steps = 1_000_000
  c.train.eval_every = 10_000
  c.train.checkpoint_every = 10_000
  return c
