r"""PipeDream's VGG-16 on ImageNet: its optimizer's hybrid 15-1 split on 16
GPUs, asynchronous 1F1B-RR (weight stashing, round-robin replicas).

Seed 001 (PipeDream): VGG-16 (138M parameters) on ImageNet, 4 servers x
4 V100 (Cluster A, 10 Gbps between servers): PipeDream's optimizer picks
15-1 (the convolutions data-parallel on 15 GPUs, the dense layers on 1)
and reports 5.28x over data parallelism (Cluster B, 8 x V100 NVLink, 25
Gbps: 2.98x); SGD lr 0.01 at batch 64 per GPU, momentum 0.9, weight
decay 5e-4 (spec: pipedream_dynpipe_sdpipe.md, A5). Here the same DP
(``pipedream_hybrid``) plans the 16 devices at the 10 Gbps link: 14-1-1
(15-1 from 4e9 bytes/s; PipeDream's own DP on its profile picks 15-1
only as one flat level at 3e9 to 1.6e10 bytes/s: experiments/RESULTS.md,
"The seeds as the papers ran them").
Variants: ws+rr (PipeDream's runtime, 1F1B-RR: default), ws (weight
stashing, each microbatch split over a stage's replicas), stale, 1f1b,
2bw, gpipe; "small" is configs/pipedream_vgg.py (a 6-conv VGG on the
embedded digits, straight 4 stages, where 1F1B-RR is 1F1B with
stashing: small defaults to ws; small:VARIANT, e.g. small:ws+rr with
--config.pipeline.partition=contiguous --config.pipeline.replicas=2,1,1).

1F1B-RR (``pipeline.replica_routing = "round_robin"``): microbatch b runs
whole on replica b mod r of a replicated stage, as PipeDream's runtime
does. On 4 servers x 4 GPUs (a process per GPU or per server) the
replicated stage's group spans processes, as in the paper: both routings
run there (a round-robin last stage across processes is refused in one
line; the plans here end in one device), equal to one process
(tests/distributed/test_train_processes.py: 2-1-1 over 4 processes).

Plan:   python -m jpipe.train.plan --config configs/seeds/pipedream_vgg16.py
Train (16 GPUs; tfds build imagenet2012 --data_dir DATA: read per batch,
cropped and resized to 224 x 224):
  python -m jpipe.train --config configs/seeds/pipedream_vgg16.py \
      --workdir /tmp/vgg16 --config.data.data_dir=DATA
"""

from configs import pipedream_vgg
from jpipe.train.base_config import apply_variant, base_config, image_data


def _small(variant: str):
  return pipedream_vgg.get_config(variant or "ws")


def get_config(variant: str = "ws+rr"):
  if variant.split(":")[0] == "small":
    return _small(variant.partition(":")[2])
  c = base_config()
  c.data = image_data("imagenet2012")
  c.data.eval_split = "validation"
  c.data.image_shape = (224, 224, 3)
  c.data.batch_size = 64 * 16  # 64 per GPU.
  c.model.name = "vgg"
  c.model.size = "16"
  c.optimizer.name = "sgd"
  c.optimizer.learning_rate = 0.01
  c.optimizer.momentum = 0.9
  c.optimizer.weight_decay = 5e-4
  c.pipeline.num_stages = 16  # Devices: the DP replicates stages on them.
  c.pipeline.num_microbatches = 16
  c.pipeline.partition = "pipedream_hybrid"
  c.pipeline.bandwidth = 1.25e9  # 10 Gbps between Cluster A's servers.
  c.pipeline.memory_limit = "16GiB"  # V100 16 GB.
  c.train.steps = 100_000
  c.train.eval_every = 5_000
  c.train.checkpoint_every = 5_000
  apply_variant(c, variant)
  return c
