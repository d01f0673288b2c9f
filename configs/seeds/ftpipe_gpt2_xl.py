r"""FTPipe's GPT-2 XL (1.5B): fine-tuning the language model on WikiText-2
with the mixed pipe on 8 x 11 GiB GPUs, asynchronously.

Seed 000 (FTPipe) fine-tunes GPT-2 XL (1.56B parameters) on WikiText-2
on 8 RTX 2080 Ti (its abstract: up to 3x faster than the synchronous
pipeline; the repository holds no GPT-2 figure, spec:
ftpipe_staleness_and_partitioner.md, 8). The optimizer and batch are not
in the spec: HuggingFace's language-model fine-tuning defaults (AdamW
5e-5, linear decay after warm-up), 8 sequences of 1024 tokens per step
in 8 microbatches. "small" runs the same code path (GPT-2's
architecture at 2 layers, the mixed pipe on 2 devices, async, AdamW) on
the embedded text in under a minute on 2 CPU cores.

WikiText-2 is not in TFDS: download wikitext-2-raw and name its files.
Plan:   python -m jpipe.train.plan --config configs/seeds/ftpipe_gpt2_xl.py
Train (8 GPUs; GPT-2 XL's safetensors and tokenizer.json in DIR):
  python -m jpipe.train --config configs/seeds/ftpipe_gpt2_xl.py \
      --workdir /tmp/gpt2_xl --config.init_from=hf:DIR \
      --config.data.tokenizer=DIR/tokenizer.json \
      --config.data.train_split=/data/wikitext-2-raw/wiki.train.raw \
      --config.data.eval_split=/data/wikitext-2-raw/wiki.valid.raw
The small one:
  python -m jpipe.train --config configs/seeds/ftpipe_gpt2_xl.py:small \
      --workdir /tmp/gpt2_small
"""

from jpipe.train.base_config import base_config, text_data


def get_config(variant: str = ""):
  c = base_config()
  c.model.name = "gpt2"
  # True: the blocks run under one nn.scan, params stacked as MaxText /
  # T5X's scan_layers (the partitioner still splits per layer; hf: loads
  # stack the checkpoint's per-layer tensors).
  c.model.kwargs.scan_layers = False
  c.optimizer.name = "adamw"
  c.optimizer.schedule = "warmup_linear"
  c.pipeline.partition = "mixed"
  c.schedule.name = "async"  # "stale".
  c.pipeline.recompute = True
  if variant == "small":
    c.data = text_data("stdlib_text")
    c.data.batch_size = 16
    c.data.sequence_length = 64
    c.data.eval_sequences = 64
    c.model.kwargs.vocab_size = 257
    c.model.kwargs.n_positions = 64
    c.model.kwargs.d_model = 64
    c.model.kwargs.num_layers = 2
    c.model.kwargs.num_heads = 4
    c.model.kwargs.dropout = 0.0
    c.optimizer.learning_rate = 3e-3
    c.optimizer.warmup_steps = 10
    c.pipeline.num_stages = 2
    c.pipeline.num_microbatches = 4
    c.train.steps = 150
    c.train.eval_every = 50
    c.train.checkpoint_every = 150
    return c
  if variant:
    raise ValueError(f"variant {variant!r}: '' or small")
  c.data = text_data("text_files")
  c.data.train_split = "wiki.train.raw"
  c.data.eval_split = "wiki.valid.raw"
  c.data.batch_size = 8
  c.data.sequence_length = 1024
  c.data.eval_sequences = 256
  c.model.size = "xl"
  c.optimizer.learning_rate = 5e-5
  c.optimizer.weight_decay = 0.0
  c.optimizer.warmup_steps = 100
  c.pipeline.num_stages = 8  # 8 GPUs; the mixed pipe makes more stages.
  c.pipeline.num_microbatches = 8
  c.pipeline.memory_limit = "11GiB"  # RTX 2080 Ti.
  c.pipeline.bandwidth = 12e9  # Bytes/s: PCIe 3 x16.
  c.train.steps = 3 * 2_400  # ~3 epochs of WikiText-2's 2.4M tokens / 8k.
  c.train.eval_every = 600
  c.train.checkpoint_every = 600
  return c
