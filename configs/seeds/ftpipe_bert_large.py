r"""FTPipe's BERT-large on SQuAD: fine-tuning with the mixed pipe on 8 x 11
GiB GPUs, asynchronously.

Seed 000 (FTPipe) fine-tunes BERT-large (whole-word masking, 336M
parameters) on SQuAD at 384 tokens: Adam lr 3e-5, no weight decay,
microbatch 12, step_every 2 (spec: ftpipe_staleness_and_partitioner.md,
9); its partitioner predicts 6.69x async (7.37x synchronous) on 8 GPUs,
3.51x on 4 (ibid., 8). Here: the span head on BERT-large, the mixed pipe
on 8 devices, asynchronous ("stale", recomputing), 24 examples per step
in 2 microbatches of 12.

Variants: "" (default); "small": the same code path (BERT's
architecture at 2 layers with the span head, the mixed pipe on 2
devices, async, Adam) on SQuAD's first 2 % -- prepare SQuAD with TFDS
(the tests run it on TFDS mock records of SQuAD's features).

Plan:   python -m jpipe.train.plan --config configs/seeds/ftpipe_bert_large.py
Train (8 GPUs; bert-large-uncased-whole-word-masking's safetensors and
tokenizer.json in DIR; tfds build squad --data_dir DATA):
  python -m jpipe.train --config configs/seeds/ftpipe_bert_large.py \
      --workdir /tmp/bert_large --config.init_from=hf:DIR \
      --config.init_keep=qa_outputs/ \
      --config.data.tokenizer=DIR/tokenizer.json --config.data.data_dir=DATA
"""

from jpipe.train.base_config import base_config, qa_data


def get_config(variant: str = ""):
  c = base_config()
  c.data = qa_data("squad")
  c.model.name = "bert"
  c.model.kwargs.head = "qa"
  c.optimizer.name = "adam"
  c.optimizer.learning_rate = 3e-5
  c.optimizer.weight_decay = 0.0
  c.pipeline.partition = "mixed"
  c.schedule.name = "async"  # "stale".
  c.pipeline.recompute = True
  if variant == "small":
    c.data.train_split = "train[:2%]"
    c.data.eval_split = "validation[:2%]"
    c.data.batch_size = 8
    c.data.sequence_length = 64
    c.data.eval_examples = 64
    c.model.kwargs.vocab_size = 260  # Bytes (+ offset).
    c.model.kwargs.max_position = 64
    c.model.kwargs.d_model = 32
    c.model.kwargs.d_ff = 64
    c.model.kwargs.num_layers = 2
    c.model.kwargs.num_heads = 2
    c.model.kwargs.dropout = 0.0
    c.optimizer.learning_rate = 3e-3
    c.pipeline.num_stages = 2
    c.pipeline.num_microbatches = 2
    c.train.steps = 100
    c.train.eval_every = 50
    c.train.checkpoint_every = 100
    return c
  if variant:
    raise ValueError(f"variant {variant!r}: '' or small")
  c.data.sequence_length = 384
  c.data.batch_size = 24  # Microbatch 12 x step_every 2.
  c.model.size = "large"
  c.pipeline.num_stages = 8  # 8 GPUs; the mixed pipe makes more stages.
  c.pipeline.num_microbatches = 2
  c.pipeline.memory_limit = "11GiB"  # RTX 2080 Ti.
  c.pipeline.bandwidth = 12e9  # Bytes/s: PCIe 3 x16.
  c.train.steps = 2 * 88_000 // 24  # 2 epochs of SQuAD v1.1.
  c.train.eval_every = 1_000
  c.train.checkpoint_every = 1_000
  return c
