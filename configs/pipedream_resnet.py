r"""PipeDream's ResNet experiment, scaled: 1F1B with weight stashing.

PipeDream (seed 001) trains ResNet-50 with asynchronous 1F1B and weight
stashing; its optimizer cuts the residual graph at antichains (a skip
connection crossing a cut is sent along). Here: a pre-activation ResNet-16
with BatchNorm (jpipe.models.resnet at width 1) on the embedded 8x8
digits, 4 stages from the "pipedream" partitioner. Fields:
jpipe/train/base_config.py.

Run (variants: ws (PipeDream, default), stale, 1f1b (PipeDream-Flush), 2bw,
gpipe):
  python -m jpipe.train --config configs/pipedream_resnet.py --workdir /tmp/jpipe_resnet

Expected: (re-measured 2026-11-23, streaming, ws) 99.2% test accuracy
after 300 steps, about 30 seconds on 2 CPU cores. On CIFAR-10 prepared by TFDS: --config.data.name=cifar10
--config.data.data_dir=DIR.
"""

from jpipe.train.base_config import apply_variant, base_config, image_data


def get_config(variant: str = "ws"):
  c = base_config()
  c.data = image_data("digits")
  c.model.name = "resnet"
  c.model.kwargs.depth = 16  # 6n + 4: two residual blocks per group.
  c.model.kwargs.width = 1  # 16, 32, 64 channels: the classic ResNet.
  c.model.kwargs.num_classes = 10

  c.optimizer.name = "sgd"
  c.optimizer.learning_rate = 0.05  # PipeDream's ResNet-50: 0.1 at 256.
  c.optimizer.momentum = 0.9
  c.optimizer.weight_decay = 1e-4  # As PipeDream's ResNet-50.

  c.pipeline.num_stages = 4
  c.pipeline.num_microbatches = 4
  c.pipeline.partition = "pipedream"
  apply_variant(c, variant)
  return c
