r"""SD-Pipe's ResNet-50 on ImageNet: 4 pipelines x 4 stages over 2 hosts,
stage replicas averaged by partial reduce.

Seed 002 (SD-Pipe): ResNet-50 in 4 stages of [4, 4, 4, 4] bottleneck
blocks (a hand-given split: SD-Pipe has no partitioner) x 4 pipelines on
2 x 8 GPUs, each pipeline PipeDream's 1F1B with weight stashing, the
replicas of a stage averaged within groups the scheduler forms at run
time; momentum SGD lr 1e-2, weight decay 1e-4, batch 256, one warm-up
epoch, x0.2 every 30 epochs (spec: pipedream_dynpipe_sdpipe.md, C). Here
the contiguous partitioner splits each pipeline (its plan is printed;
``--config.pipeline.depth`` and ``python -m jpipe.train.plan`` show it).
"small" is configs/sdpipe.py (4 pipelines x 2 stages of an MLP on the
embedded digits).

Plan (one pipeline): python -m jpipe.train.plan --config configs/seeds/sdpipe_resnet50.py
Train (2 hosts x 8 GPUs, one process per host; tfds build imagenet2012
--data_dir DATA: read per batch, cropped and resized to 224 x 224):
  python -m jpipe.launch --nprocs 2 --devices-per-process 8 -- \
      python -m jpipe.train --config configs/seeds/sdpipe_resnet50.py \
      --workdir /tmp/sd_resnet50 --config.data.data_dir=DATA
"""

from configs import sdpipe
from jpipe.train.base_config import base_config, image_data

STEPS_PER_EPOCH = 1_281_167 // 256


def get_config(variant: str = ""):
  if variant == "small":
    return sdpipe.get_config()
  if variant:
    raise ValueError(f"variant {variant!r}: '' or small")
  c = base_config()
  c.data = image_data("imagenet2012")
  c.data.eval_split = "validation"
  c.data.image_shape = (224, 224, 3)
  c.data.batch_size = 256 // 4  # Per pipeline.
  c.model.name = "imagenet_resnet"
  c.model.size = "50"
  c.optimizer.name = "sgd"
  c.optimizer.learning_rate = 1e-2
  c.optimizer.momentum = 0.9
  c.optimizer.weight_decay = 1e-4
  c.optimizer.schedule = "multistep"
  c.optimizer.decay_steps = ",".join(
    str(e * STEPS_PER_EPOCH) for e in (30, 60, 90)
  )
  c.optimizer.decay_factor = 0.2
  c.pipeline.num_stages = 4
  c.pipeline.num_microbatches = 4
  c.schedule.name = "async"
  c.staleness.stashing = True
  c.data_parallel.pipelines = 4
  c.data_parallel.sync = "preduce"
  c.data_parallel.epoch_batches = STEPS_PER_EPOCH
  c.train.steps = 120 * STEPS_PER_EPOCH
  c.train.eval_every = STEPS_PER_EPOCH
  c.train.checkpoint_every = STEPS_PER_EPOCH
  return c
