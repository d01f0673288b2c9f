r"""Fine-tune the GPT LM from pretrained params (FTPipe's setting, scaled).

FTPipe's headline (seed 000) is fine-tuning pretrained giants through an
asynchronous pipeline. Here, without a download: pretrain configs/gpt_lm.py
on one half of the training files, then fine-tune it on the other half,
a slice it never saw, with the same asynchronous pipeline (weight
prediction) at a lower learning rate. ``init_from`` takes the pretraining
workdir (its last checkpoint's params); the config's argument after ":"
overrides it. Fields: jpipe/train/base_config.py.

Run:
  python -m jpipe.train --config configs/gpt_lm.py --workdir /tmp/jpipe_gpt_pre \
    --config.data.train_split='train[:50%]'
  python -m jpipe.train --config configs/gpt_finetune.py --workdir /tmp/jpipe_gpt_ft
  (python -m experiments.finetune.finetune runs both and a from-scratch
  baseline, and writes the table in experiments/RESULTS.md.)

Expected: (measured 2026-11-24, 2 CPU cores; experiments/RESULTS.md) the
fine-tuned run's step-0 evaluation is the pretrained model's (held-out
perplexity 9.59 after 300 pretraining steps, against 256 at a random
init), and it improves from there: 8.76 after 100 steps, about 1.3 minutes.
From scratch, the same 100 steps on the same slice reach 11.85.
Compare:
  --config.optimizer.freeze='^embed/'   (freeze the tied embedding)
  --config.init_from=''                 (from scratch, same slice)
"""

import os

from jpipe.train import config_plan

PRETRAINED = "/tmp/jpipe_gpt_pre"  # The pretraining run's workdir.


def get_config(init_from: str = PRETRAINED):
  here = os.path.dirname(os.path.abspath(__file__))
  c = config_plan.load_config_file(os.path.join(here, "gpt_lm.py"))
  c.unlock()
  c.init_from = init_from
  c.data.train_split = "train[50%:]"  # The files pretraining did not see.
  c.optimizer.learning_rate = 1e-3  # Peak; pretraining's was 3e-3.
  c.optimizer.warmup_steps = 40  # Optimizer steps (4 per pipeline step).
  c.train.steps = 100
  c.train.eval_every = 50
  c.train.checkpoint_every = 50
  return c
