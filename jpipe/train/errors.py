"""Errors a user fixes (config, data, workdir, checkpoint) and a diverged
run: ``python -m jpipe.train`` prints them as a few lines, not a
traceback."""

from jpipe.data import DatasetError


class UsageError(ValueError):
  """The command's inputs are wrong; the message names the fix. The CLI
  exits with status 2."""


# What the CLIs print as one line and exit 2 for: UsageError, and a
# dataset whose files cannot be read (``jpipe.data``'s, raised by reads
# anywhere in a run).
USER_ERRORS = (UsageError, DatasetError)


class CheckpointError(UsageError):
  """A checkpoint exists but cannot be used."""


class CheckpointLayoutError(CheckpointError):
  """A sound checkpoint whose state is laid out unlike this run's (an
  optimizer setting that shapes its state changed since it was written):
  its earlier checkpoints are laid out the same, so deleting it fixes
  nothing."""


class PretrainedError(UsageError):
  """Pretrained params (``config.init_from``) that cannot be read or do
  not fit the model."""


class PretrainedCheckpointError(PretrainedError, CheckpointError):
  """A pretrained orbax checkpoint whose files fail to restore (its reads
  still under way, the CLI ends at once: see ``CheckpointError``)."""


class TrainingDiverged(FloatingPointError):
  """The loss went non-finite or far above its start (the message names
  the step, and the stage when its params went non-finite). The CLI exits
  with status 1."""


def model_kwargs_error(where: str, error: TypeError, kwargs) -> UsageError:
  """A model class refusing ``config.model.kwargs``: the error, and (when
  the config gives any) that they may be the config's own model's."""
  hint = ""
  if kwargs:
    hint = (
      f" (the config gives {dict(kwargs)}, perhaps for the model it names "
      "itself: --config.model.kwargs='{...}' sets yours, '{}' none)"
    )
  return UsageError(f"config.model.kwargs of {where}: {error}{hint}")
