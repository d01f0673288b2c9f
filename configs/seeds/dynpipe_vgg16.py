r"""DynPipe's VGG-16 on CIFAR-10 on 8 devices: re-partitioning when a
device slows down.

Seed 003 (DynPipe): VGG-16 on CIFAR-10 on 8 GPUs, PipeDream's
asynchronous 1F1B with weight stashing; when interference slows a GPU
its predictor re-partitions the layers (its 2-GPU trace: [10, 28] ->
[5, 33] with GPU 0 3.08x slower, and back). Throughput VGG16/CIFAR-10:
GPipe 32.9, PipeDream 147.1, DynPipe 179.3 images/s; GPU utilisation on
8 GPUs: DynPipe 39.3 %, PipeDream 13.7 % (spec: pipedream_dynpipe_
sdpipe.md, B). Batch 72 per step (its vgg16/gpus=8 configuration), SGD
lr 0.01 momentum 0.9, weight decay 5e-4. "small" is configs/dynpipe.py
(a 4-stage MLP on the embedded digits with a device slowed 3x mid-run).

Plan:   python -m jpipe.train.plan --config configs/seeds/dynpipe_vgg16.py
Train (8 GPUs; tfds build cifar10 --data_dir DATA):
  python -m jpipe.train --config configs/seeds/dynpipe_vgg16.py \
      --workdir /tmp/dyn_vgg16 --config.data.data_dir=DATA
"""

from configs import dynpipe
from jpipe.train.base_config import base_config, image_data


def get_config(variant: str = ""):
  if variant == "small":
    return dynpipe.get_config()
  if variant:
    raise ValueError(f"variant {variant!r}: '' or small")
  c = base_config()
  c.data = image_data("cifar10")
  c.data.batch_size = 72
  c.model.name = "vgg"
  c.model.size = "16-cifar"
  c.optimizer.name = "sgd"
  c.optimizer.learning_rate = 0.01
  c.optimizer.momentum = 0.9
  c.optimizer.weight_decay = 5e-4
  c.pipeline.num_stages = 8
  c.pipeline.num_microbatches = 8
  c.schedule.name = "async"
  c.staleness.stashing = True
  c.dynamic.enabled = True
  c.dynamic.policy = "dynpipe"
  c.train.steps = 50 * (50_000 // 72)
  c.train.eval_every = 50_000 // 72
  c.train.checkpoint_every = 50_000 // 72
  return c
