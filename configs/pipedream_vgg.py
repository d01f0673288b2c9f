r"""PipeDream's VGG experiment, scaled: 1F1B with weight stashing.

PipeDream (seed 001) profiles VGG-16, lets its optimizer split it (here the
"pipedream" partitioner, PipeDream's antichain dynamic program) and trains
it with asynchronous 1F1B: each stage steps after every microbatch and
weight stashing makes each backward use the weights of its own forward.
Here: a VGG with six 3x3 conv layers (three pools) on the embedded 8x8
digits, 4 stages. Fields: jpipe/train/base_config.py.

Run (variants: ws (PipeDream, default), stale, 1f1b (PipeDream-Flush), 2bw,
gpipe):
  python -m jpipe.train --config configs/pipedream_vgg.py --workdir /tmp/jpipe_vgg

The pipeline streams (no drain between steps; only at evaluations and
checkpoints, every 100 steps): stage s of 4 sees delay 3 - s.

Expected: (re-measured 2026-11-23, one run each) test accuracy after 300
steps ws 96.4%, stale 94.4%, 1f1b 97.5%, 2bw 70.3% (2BW steps once per 4
microbatches on a gradient one minibatch old: VGG, without normalisation,
leaves its initial plateau later -- 33% at step 200); about 60 seconds on
2 CPU cores. Full VGG-16 on CIFAR-10 prepared by TFDS:
  --config.data.name=cifar10 --config.data.data_dir=DIR
  --config.model.kwargs.config="(64,64,'M',128,128,'M',256,256,256,'M',512,512,512,'M',512,512,512,'M')"
"""

from jpipe.train.base_config import apply_variant, base_config, image_data


def get_config(variant: str = "ws"):
  c = base_config()
  c.data = image_data("digits")
  c.model.name = "vgg"
  # Output channels per conv layer, "M" = 2x2 max pool (8x8 -> 1x1).
  c.model.kwargs.config = (32, 32, "M", 64, 64, "M", 128, 128, "M")
  c.model.kwargs.hidden = 256  # Width of the two fully connected layers.
  c.model.kwargs.num_classes = 10

  c.optimizer.name = "sgd"
  c.optimizer.learning_rate = 0.02  # PipeDream's VGG-16: 0.01 at batch 64.
  c.optimizer.momentum = 0.9
  c.optimizer.weight_decay = 5e-4

  c.pipeline.num_stages = 4
  c.pipeline.num_microbatches = 4
  c.pipeline.partition = "pipedream"  # PipeDream's optimizer picks stages.
  apply_variant(c, variant)
  return c
