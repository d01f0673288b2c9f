r"""SD-Pipe's BERT pre-training: 4 pipelines x 4 stages over 2 hosts, stage
replicas averaged by partial reduce.

Seed 002 (SD-Pipe): BERT-base pre-training (masked LM + next sentence)
on Wikipedia at sequence length 128, 4 pipelines x 4 stages on 2 x 8 GPUs
(its hand split: [2, 4, 4, 2] layers), each pipeline PipeDream's 1F1B
with weight stashing, the replicas of a stage averaged within groups
formed at run time; AdamW lr 1e-5, weight decay 1e-2, 2000 warm-up
iterations (spec: pipedream_dynpipe_sdpipe.md, C). Here the contiguous
partitioner splits each pipeline. "small": the same code path (BERT's
pre-training on the embedded text, 4 pipelines x 2 stages, preduce,
async with stashing) in under two minutes on 2 CPU cores.

Plan (one pipeline): python -m jpipe.train.plan --config configs/seeds/sdpipe_bert.py
Train (2 hosts x 8 GPUs, one process per host; tfds build
wikipedia/20230601.en --data_dir DATA; bert-base-uncased's tokenizer.json):
  python -m jpipe.launch --nprocs 2 --devices-per-process 8 -- \
      python -m jpipe.train --config configs/seeds/sdpipe_bert.py \
      --workdir /tmp/sd_bert --config.data.data_dir=DATA \
      --config.data.tokenizer=tokenizer.json
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
  c.data_parallel.sync = "preduce"
  if variant == "small":
    c.data = text_data("stdlib_text", masked_lm=True)
    c.data.batch_size = 16  # Per pipeline.
    c.data.sequence_length = 32
    c.data.eval_sequences = 64
    c.model.kwargs.vocab_size = 260  # Bytes, shifted, + [CLS] [SEP] [MASK].
    c.model.kwargs.max_position = 32
    c.model.kwargs.d_model = 32
    c.model.kwargs.d_ff = 64
    c.model.kwargs.num_layers = 2
    c.model.kwargs.num_heads = 2
    c.model.kwargs.dropout = 0.0
    c.optimizer.learning_rate = 2e-3
    c.optimizer.warmup_steps = 10
    c.pipeline.num_stages = 2
    c.pipeline.num_microbatches = 2
    c.data_parallel.pipelines = 4
    c.data_parallel.epoch_batches = 10
    c.train.steps = 60
    c.train.eval_every = 30
    c.train.checkpoint_every = 60
    return c
  if variant:
    raise ValueError(f"variant {variant!r}: '' or small")
  c.data = text_data("wikipedia/20230601.en", masked_lm=True)
  c.data.batch_size = 32  # Per pipeline.
  c.data.sequence_length = 128
  c.data.eval_split = "train[-1%:]"
  c.data.train_split = "train[:99%]"
  c.model.size = "base"
  c.optimizer.learning_rate = 1e-5
  c.optimizer.warmup_steps = 2000
  c.pipeline.num_stages = 4
  c.pipeline.num_microbatches = 4
  c.data_parallel.pipelines = 4
  c.data_parallel.epoch_batches = 1000
  c.train.steps = 100_000
  c.train.eval_every = 5_000
  c.train.checkpoint_every = 5_000
  return c
