r"""The embedded default: an MLP on the handwritten digits, 4-stage 1F1B.

Real data that needs no download: the 8x8 digits that ship inside
scikit-learn, built into a local TFDS dataset on first use. The fields and
their meaning: jpipe/train/base_config.py.

Run:
  python -m jpipe.train --config configs/default.py --workdir /tmp/jpipe_default

Expected: about 97% test accuracy after 300 steps, under a minute on
2 CPU cores (the pipeline runs on 4 of 8 fake CPU devices). Overrides:
  --config.schedule.name=async --config.staleness.stashing=True
  --config.pipeline.num_stages=2 --config.train.steps=100
"""

from jpipe.train.base_config import base_config, image_data


def get_config():
  c = base_config()
  c.data = image_data("digits")
  c.model.name = "mlp"
  c.model.kwargs.hidden = (128, 128, 128, 128)  # Four hidden layers.
  c.model.kwargs.num_classes = 10
  return c
