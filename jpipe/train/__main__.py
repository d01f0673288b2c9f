"""``python -m jpipe.train --config configs/X.py --workdir DIR``.

Kept short on purpose (the logic is in train_lib): flags, then
``train_and_evaluate`` (after joining a multi-process run, when the
environment describes one: ``python -m jpipe.launch``). Overrides: ``--config.a.b=value``; an unknown key
or a wrong type stops before any work (the config is locked).
"""

import os

# Without an accelerator, expose 8 CPU devices so a pipeline has devices to
# run on (must happen before jax starts; harmless on GPU machines).
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

from absl import app, flags, logging  # noqa: E402
from ml_collections import config_flags  # noqa: E402

from jpipe import distributed  # noqa: E402
from jpipe.train import train_lib  # noqa: E402

_CONFIG = config_flags.DEFINE_config_file(
  "config", None, "Training config file (configs/*.py).", lock_config=True
)
_WORKDIR = flags.DEFINE_string(
  "workdir", None, "Where checkpoints, logs and pictures go (resumes)."
)
flags.mark_flags_as_required(["config", "workdir"])


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  logging.set_verbosity(logging.WARNING)  # orbax logs every save at INFO
  # Under `python -m jpipe.launch` (or SLURM): join the other processes.
  distributed.initialize()
  train_lib.train_and_evaluate(_CONFIG.value, _WORKDIR.value)


if __name__ == "__main__":
  app.run(main)
