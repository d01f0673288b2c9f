r"""PipeDream's ResNet-50 on ImageNet: its optimizer's choice on 16 GPUs.

Seed 001 (PipeDream): ResNet-50 (25.6M parameters) on ImageNet, 4 x 4
V100 (Cluster A, 10 Gbps): PipeDream's optimizer chooses plain data
parallelism (1x over it: the activations are large, the weights
small); SGD lr 0.1 at batch 256, momentum 0.9, weight decay 1e-4, x0.1
every 30 epochs (spec: pipedream_dynpipe_sdpipe.md, A5). The same DP
(``pipedream_hybrid``) plans the 16 devices here. Variants: ws+rr
(PipeDream's runtime, 1F1B-RR: default), ws (weight stashing, each
microbatch split over a stage's replicas), stale, 1f1b, 2bw, gpipe;
"small" is configs/pipedream_resnet.py (a ResNet-16 on the embedded
digits, straight 4 stages, where 1F1B-RR is 1F1B with stashing: small
defaults to ws; small:VARIANT, e.g. small:ws+rr with
--config.pipeline.partition=contiguous --config.pipeline.replicas=2,1,1).

1F1B-RR (``pipeline.replica_routing = "round_robin"``): microbatch b runs
whole on replica b mod r of a replicated stage, as PipeDream's runtime
does, and each replica keeps its own BatchNorm statistics, updated only
by the microbatches it runs (PipeDream's replicas are separate model
copies: torch DDP without SyncBatchNorm); checkpoints and evaluation
read replica 0's, as PipeDream saves and evaluates from each stage's
first rank. Across processes (4 servers) a replica group may span
them: 1F1B-RR keeps each replica's statistics in its own process; ws
(each microbatch split over a stage's replicas, with the same delays as
one device) keeps the group's statistics of the whole microbatch in each
of its processes.

Plan:   python -m jpipe.train.plan --config configs/seeds/pipedream_resnet50.py
Train (16 GPUs; tfds build imagenet2012 --data_dir DATA: read per batch,
cropped and resized to 224 x 224):
  python -m jpipe.train --config configs/seeds/pipedream_resnet50.py \
      --workdir /tmp/resnet50 --config.data.data_dir=DATA
"""

from configs import pipedream_resnet
from jpipe.train.base_config import apply_variant, base_config, image_data

STEPS_PER_EPOCH = 1_281_167 // 256


def _small(variant: str):
  return pipedream_resnet.get_config(variant or "ws")


def get_config(variant: str = "ws+rr"):
  if variant.split(":")[0] == "small":
    return _small(variant.partition(":")[2])
  c = base_config()
  c.data = image_data("imagenet2012")
  c.data.eval_split = "validation"
  c.data.image_shape = (224, 224, 3)
  c.data.batch_size = 256
  c.model.name = "imagenet_resnet"
  c.model.size = "50"
  c.optimizer.name = "sgd"
  c.optimizer.learning_rate = 0.1
  c.optimizer.momentum = 0.9
  c.optimizer.weight_decay = 1e-4
  c.optimizer.schedule = "multistep"
  c.optimizer.decay_steps = ",".join(
    str(e * STEPS_PER_EPOCH) for e in (30, 60, 80)
  )
  c.optimizer.decay_factor = 0.1
  c.pipeline.num_stages = 16
  c.pipeline.num_microbatches = 16
  c.pipeline.partition = "pipedream_hybrid"
  c.pipeline.bandwidth = 1.25e9  # 10 Gbps between Cluster A's servers.
  c.pipeline.memory_limit = "16GiB"  # V100 16 GB.
  c.train.steps = 90 * STEPS_PER_EPOCH
  c.train.eval_every = STEPS_PER_EPOCH
  c.train.checkpoint_every = STEPS_PER_EPOCH
  apply_variant(c, variant)
  return c
