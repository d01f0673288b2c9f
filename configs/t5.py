r"""A T5-style encoder-decoder on span corruption, synchronous 1F1B.

T5's pre-training objective on bytes: 15% of each 128-byte window is
replaced by sentinels (mean span 3) and the decoder writes the missing
spans. Every decoder layer attends to the encoder's output, so the
partitioner sends that output to every decoder stage; the embedding is
shared by encoder, decoder and output head (tied across stages). Data: the
Python standard library's source (embedded). Fields:
jpipe/train/base_config.py.

Run:
  python -m jpipe.train --config configs/t5.py --workdir /tmp/jpipe_t5

Expected: held-out perplexity of the masked bytes falls from ~290
(uniform) to about 11 after 300 steps (about 2 minutes on 2 CPU cores).
Asynchronous variant: --config.schedule.name=async
--config.staleness.stashing=True.
"""

from jpipe.train.base_config import base_config, text_data


def get_config():
  c = base_config()
  c.data = text_data("stdlib_text", span_corruption=True)
  c.model.name = "t5"
  c.model.kwargs.vocab_size = 257 + 32  # Byte tokens + span sentinels.
  c.model.kwargs.width = 128  # Embedding width.
  c.model.kwargs.num_layers = 3  # Encoder layers (and decoder layers).
  c.model.kwargs.num_heads = 4  # Attention heads.

  c.optimizer.name = "adam"
  c.optimizer.learning_rate = 2e-3  # Peak, after warm-up.
  c.optimizer.schedule = "warmup_cosine"
  c.optimizer.warmup_steps = 30  # Optimizer steps (1 per pipeline step).

  c.pipeline.num_stages = 4  # Encoder stages feed every decoder stage.
  c.pipeline.num_microbatches = 4
  c.schedule.name = "1f1b"
  return c
