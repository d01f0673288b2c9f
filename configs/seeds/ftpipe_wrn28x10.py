r"""FTPipe's staleness experiment at its size: WRN-28-10 on CIFAR-100,
asynchronous 1F1B with FTPipe's mitigations.

Seed 000/004 (FTPipe, its asynchronous pipeline): WRN-28-10 (36.5M
parameters) on CIFAR-100, 4 stages from PipeDream's method, SGD with
momentum 0.9 (Nesterov for "stale"), lr 0.1, weight decay 5e-4, batch
128, 205 epochs, lr x0.2 at epochs 60, 120 and 160 (FTPipe also warms up
for 5 epochs; jpipe's multistep schedule has no warm-up). Its
partitioner predicts 2.51x on 4 GPUs (spec: ftpipe_staleness_and_
partitioner.md, 8-9). Variants as configs/wrn_stale.py: stale (default),
ws, wp, ga and their "+" combinations, gpipe; "small" is
configs/wrn_stale.py itself (WRN-10-2 on the embedded digits, the same
code path in under a minute on 2 CPU cores; small:VARIANT picks its
mitigation).

Plan:   python -m jpipe.train.plan --config configs/seeds/ftpipe_wrn28x10.py
Train (4 GPUs; tfds build cifar100 --data_dir DATA):
  python -m jpipe.train --config configs/seeds/ftpipe_wrn28x10.py:ws \
      --workdir /tmp/wrn --config.data.data_dir=DATA
"""

from configs import wrn_stale
from jpipe.train.base_config import apply_variant, base_config, image_data

STEPS_PER_EPOCH = 50_000 // 128


def _small(variant: str):
  return wrn_stale.get_config(variant or "stale")


def get_config(variant: str = "stale"):
  if variant.split(":")[0] == "small":
    return _small(variant.partition(":")[2])
  c = base_config()
  c.data = image_data("cifar100")
  c.data.batch_size = 128
  c.model.name = "resnet"
  c.model.size = "28-10"
  c.optimizer.name = "sgd"
  c.optimizer.learning_rate = 0.1
  c.optimizer.momentum = 0.9
  c.optimizer.weight_decay = 5e-4
  c.optimizer.schedule = "multistep"
  c.optimizer.decay_steps = ",".join(
    str(e * STEPS_PER_EPOCH) for e in (60, 120, 160)
  )
  c.optimizer.decay_factor = 0.2
  c.pipeline.num_stages = 4
  c.pipeline.num_microbatches = 4
  c.pipeline.partition = "pipedream"
  c.train.steps = 205 * STEPS_PER_EPOCH
  c.train.eval_every = 5 * STEPS_PER_EPOCH
  c.train.checkpoint_every = 5 * STEPS_PER_EPOCH
  apply_variant(c, variant)
  return c
