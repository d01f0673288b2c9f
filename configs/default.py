r"""The embedded default: an MLP on the handwritten digits, 4-stage 1F1B.

Real data that needs no download: the 8x8 digits that ship inside
scikit-learn, built into a local TFDS dataset on first use.

Run:
  python -m jpipe.train --config configs/default.py --workdir /tmp/jpipe_default

Expected: about 97% test accuracy after 300 steps, one to two minutes on
2 CPU cores (the pipeline runs on 4 of 8 fake CPU devices). Overrides:
  --config.schedule.name=async --config.staleness.stashing=True
  --config.pipeline.num_stages=2 --config.train.steps=100
"""

import ml_collections


def get_config() -> ml_collections.ConfigDict:
  c = ml_collections.ConfigDict()
  c.seed = 0  # Seeds the params and the data order.

  # Data.
  c.data = ml_collections.ConfigDict()
  c.data.name = "digits"  # "digits" (embedded) or a TFDS image dataset name.
  c.data.data_dir = ""  # TFDS data dir; "" = the default for the dataset.
  c.data.image_key = "image"  # Feature names of a TFDS dataset.
  c.data.label_key = "label"
  c.data.batch_size = 64  # Examples per step (split into microbatches).
  c.data.eval_split = "test"  # Split for the periodic evaluation.

  # Model: jpipe.models.<name>.Model(**kwargs).
  c.model = ml_collections.ConfigDict()
  c.model.name = "mlp"
  c.model.kwargs = ml_collections.ConfigDict(
    {"hidden": (128, 128, 128, 128), "num_classes": 10}
  )

  # Optimizer (optax): sgd (with momentum), adam or adamw.
  c.optimizer = ml_collections.ConfigDict()
  c.optimizer.name = "sgd"
  c.optimizer.learning_rate = 0.05  # Peak learning rate.
  c.optimizer.momentum = 0.9  # SGD only.
  c.optimizer.weight_decay = 0.0  # L2 for sgd/adam, decoupled for adamw.
  c.optimizer.schedule = "constant"  # "constant" or "warmup_cosine".
  c.optimizer.warmup_steps = 0  # Optimizer steps of linear warm-up.

  # Pipeline: how the model is split and placed.
  c.pipeline = ml_collections.ConfigDict()
  c.pipeline.num_stages = 4  # Stages (devices used: min(stages, devices)).
  c.pipeline.num_microbatches = 4  # Microbatches per step; divides batch.
  c.pipeline.partition = "contiguous"  # "contiguous" or "mixed".
  c.pipeline.recompute = False  # Recompute forwards in the backward.
  c.pipeline.depth = 1  # Module-path depth of the partitioner's nodes.

  # Schedule: seq, gpipe, 1f1b, interleaved (synchronous), async, 2bw.
  c.schedule = ml_collections.ConfigDict()
  c.schedule.name = "1f1b"
  c.schedule.step_every = 1  # async: microbatches per step; 2bw: minibatch.

  # Staleness mitigation (schedule "async" only).
  c.staleness = ml_collections.ConfigDict()
  c.staleness.stashing = False  # Weight stashing.
  c.staleness.prediction = ""  # "", "msnag" or "aggmsnag".
  c.staleness.gap_aware = ""  # "", "ga" or "ga_jfl".
  c.staleness.gap_aware_policy = "all_except_last"  # FTPipe's stage policy.

  # Training loop.
  c.train = ml_collections.ConfigDict()
  c.train.steps = 300  # Pipeline steps (each covers batch_size examples).
  c.train.log_every = 25  # Steps between metric logs.
  c.train.eval_every = 100  # Steps between evaluations (and at the end).
  c.train.checkpoint_every = 100  # Steps between checkpoints (and at end).
  c.train.keep_checkpoints = 2  # Checkpoints kept in the workdir.
  c.train.profile_last_step = True  # Timeline PNG + trace of the last step.
  return c
