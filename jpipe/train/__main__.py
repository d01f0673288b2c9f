"""Train a model as a pipeline: ``python -m jpipe.train --config
configs/default.py --workdir DIR [--config.KEY=VALUE ...]``.

``--help`` lists every config field with its value and meaning. A DIR
with a checkpoint resumes, one a live run holds is refused (naming its
host and pid); SIGTERM / SIGINT save and exit with 143 / 130.
Across processes: ``python -m jpipe.launch --nprocs N -- python -m
jpipe.train ...``.
"""

import os
import sys

# Without an accelerator, 8 CPU devices so a pipeline has devices to run
# on (before jax starts its backend; harmless on GPU machines).
from jpipe.train import host_devices

host_devices.default_cpu_device_count()

from absl import app, flags, logging  # noqa: E402
from ml_collections import config_flags  # noqa: E402

from jpipe import distributed  # noqa: E402
from jpipe.train import config_cli, errors, train_lib  # noqa: E402

_CONFIG = config_flags.DEFINE_config_file(
  "config", None, "Training config file (configs/*.py).", lock_config=True
)
_WORKDIR = flags.DEFINE_string(
  "workdir", None, "Where checkpoints, logs and pictures go (resumes)."
)
flags.mark_flags_as_required(["config", "workdir"])


def main(argv):
  del argv  # (parse_flags refuses positional arguments.)
  logging.set_verbosity(logging.WARNING)  # orbax logs every save at INFO
  # Under `python -m jpipe.launch` (or SLURM): join the other processes.
  distributed.initialize()
  try:
    train_lib.train_and_evaluate(_CONFIG.value, _WORKDIR.value)
  except errors.USER_ERRORS as e:  # Names its fix: no traceback needed.
    sys.stderr.write(f"error: {e}\n")
    if isinstance(e, errors.CheckpointError):
      # A failed restore leaves tensorstore reads under way; finishing
      # into interpreter shutdown, they print "Event loop is closed"
      # tracebacks past every hook. The run's own files are closed by
      # now (the error came through train_and_evaluate's with-blocks):
      # end the process here.
      sys.stdout.flush()
      sys.stderr.flush()
      os._exit(2)
    sys.exit(2)
  except errors.TrainingDiverged as e:
    sys.stderr.write(f"error: {e}\n")
    sys.exit(1)


if __name__ == "__main__":
  # Flag and config errors as a few lines naming the fix, not tracebacks.
  app.run(main, flags_parser=config_cli.parse_flags)
