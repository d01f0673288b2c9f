r"""FTPipe's staleness study, scaled: a Wide ResNet, asynchronous pipeline.

FTPipe (seeds 000/004) trains WRN-28-10 on CIFAR with PipeDream-style
asynchronous 1F1B and compares stale updates with weight stashing (ws),
weight prediction (wp), Gap-Aware (ga) and their combinations. Here:
WRN-10-2 (BatchNorm; its statistics flow through the pipeline in order) on
the embedded 8x8 digits, 4 stages, momentum SGD with weight decay. The
variant after the colon picks the mitigation. Fields:
jpipe/train/base_config.py.

Run (variants: stale, ws, wp, ga, ws+wp, ws+ga, wp+ga, ws+wp+ga, gpipe;
FTPipe's options add nr, nag, nesterov: stale+nr is FTPipe's stale without
recomputation, wp+nag+nesterov its msnag WRN runs, aggmsnag aside):
  python -m jpipe.train --config configs/wrn_stale.py:ws+wp --workdir /tmp/jpipe_wrn

The pipeline streams: stage s of 4 sees delay 3 - s on every microbatch
after the warm-up (the stream drains only at evaluations and checkpoints,
every 100 steps). Variants without ws or nr recompute in the backward.

Expected: (re-measured 2026-11-23, one run each) test accuracy after 300
steps stale 99.2%, ws 98.9%, wp 99.7%, ws+wp 91.7% (99.7% at step 200:
the 360-image test set swings with BatchNorm statistics), gpipe 98.6%;
35-45 seconds on 2 CPU cores. With CIFAR-10 prepared by TFDS:
  --config.data.name=cifar10 --config.data.data_dir=DIR
  --config.model.kwargs.depth=28 --config.model.kwargs.width=10
"""

from jpipe.train.base_config import apply_variant, base_config, image_data


def get_config(variant: str = "stale"):
  c = base_config()
  c.data = image_data("digits")
  c.model.name = "resnet"
  c.model.kwargs.depth = 10  # WRN depth 6n + 4: one block per group.
  c.model.kwargs.width = 2  # Width factor k: 32, 64, 128 channels.
  c.model.kwargs.num_classes = 10

  c.optimizer.name = "sgd"
  c.optimizer.learning_rate = 0.05  # FTPipe: 0.1 at batch 128.
  c.optimizer.momentum = 0.9
  c.optimizer.weight_decay = 5e-4  # As FTPipe's WRN.

  c.pipeline.num_stages = 4
  c.pipeline.num_microbatches = 4
  apply_variant(c, variant)
  return c
