r"""PipeDream's GNMT-16 on WMT16 English-German: a straight pipeline,
asynchronous 1F1B with weight stashing.

Seed 001 (PipeDream): GNMT-16 (8 + 8 LSTM layers, width 1024, attention;
245M parameters here) on WMT16 En-De: PipeDream's optimizer keeps it
straight (14 stages on 16 GPUs in its checked-in configuration) and
reports 2.34x (epoch time) / 2.92x (time to accuracy) over data
parallelism on 4 x 4 V100 (Cluster A, 10 Gbps), 3.14x on 2 x 8 (Cluster
B); GNMT-8 straight on 4 GPUs: 1.5x (spec: pipedream_dynpipe_sdpipe.md,
A5). Optimizer as MLPerf's GNMT reference (Adam 2e-3 with warm-up),
sentences of up to 50 tokens, 64 per GPU. Variants: ws (PipeDream,
default: on this straight plan PipeDream's 1F1B-RR, ws+rr, has no
replicas to deal microbatches to and is the same run), stale, 1f1b,
2bw, gpipe; "small" runs the same code path
(GNMT's architecture at width 64, PipeDream's straight partitioner,
async 1F1B with stashing, Adam) on the embedded ``stdlib_translation``
(a standard-library docstring line to its words reversed: a seq2seq
task that needs no download) in a few minutes on 2 CPU cores.

Metric: BLEU (sacrebleu's corpus BLEU-4, the target PipeDream times to)
of the held-out sources translated by greedy decoding through the stages
(``Pipeline.generate``: the encoder once, each decoder LSTM's state and
the attention's encoder outputs kept on their stages), beside the token
loss and perplexity ("small": BLEU on stdlib_translation).

Plan:   python -m jpipe.train.plan --config configs/seeds/pipedream_gnmt16.py
Train (16 GPUs; tfds build wmt16_translate/de-en --data_dir DATA; a
32k-token tokenizer.json):
  python -m jpipe.train --config configs/seeds/pipedream_gnmt16.py \
      --workdir /tmp/gnmt16 --config.data.data_dir=DATA \
      --config.data.tokenizer=tokenizer.json
The small one:
  python -m jpipe.train --config configs/seeds/pipedream_gnmt16.py:small \
      --workdir /tmp/gnmt_small
"""

from jpipe.train.base_config import (
  apply_variant,
  base_config,
  translation_data,
)


def get_config(variant: str = "ws"):
  c = base_config()
  c.model.name = "gnmt"
  c.optimizer.name = "adam"
  c.optimizer.schedule = "warmup_constant"
  c.pipeline.partition = "pipedream"  # Straight: PipeDream's choice.
  if variant.split(":")[0] == "small":  # small or small:VARIANT.
    variant = variant.partition(":")[2]
    # Embedded (built on first use): a line -> its words reversed.
    c.data = translation_data("stdlib_translation", "source", "target")
    c.data.eval_split = "test"
    c.data.eval_examples = 64  # Held-out sources translated per evaluation.
    c.data.batch_size = 16
    c.data.sequence_length = 64  # Source bytes (lines of up to 60).
    c.data.target_length = 64
    c.model.kwargs.vocab_size = 257  # Bytes (+ padding).
    c.model.kwargs.hidden = 64
    c.model.kwargs.num_layers = 2
    c.model.kwargs.dropout = 0.0
    c.optimizer.learning_rate = 3e-3
    c.optimizer.warmup_steps = 10
    c.pipeline.num_stages = 4
    c.pipeline.num_microbatches = 4
    c.train.steps = 150
    c.train.eval_every = 50
    c.train.checkpoint_every = 150
    apply_variant(c, variant or "ws")
    return c
  c.data = translation_data("wmt16_translate/de-en", "en", "de")
  c.data.sequence_length = 50
  c.data.target_length = 50
  c.data.batch_size = 64 * 16
  c.model.size = "16"
  c.optimizer.learning_rate = 2e-3
  c.optimizer.warmup_steps = 200
  c.pipeline.num_stages = 16
  c.pipeline.num_microbatches = 16
  c.pipeline.bandwidth = 1.25e9  # 10 Gbps between Cluster A's servers.
  c.pipeline.memory_limit = "16GiB"  # V100 16 GB.
  c.train.steps = 20_000
  c.train.eval_every = 1_000
  c.train.checkpoint_every = 1_000
  apply_variant(c, variant or "ws")
  return c
