"""Fit DynPipe's slowdown predictor on this config's own pipeline:
``python -m jpipe.train.slowdowns --config configs/dynpipe.py --out
/tmp/rf.pkl``.

Builds the config's model, data and pipeline as ``python -m jpipe.train``
does, measures each stage's time on several splits with its devices
slowed by known factors (``jpipe.dynamic.collect``: injected sleeps,
``config.dynamic.simulated_ms`` as in training), fits DynPipe's random
forest on the samples (``jpipe.dynamic.SlowdownPredictor``), prints its
held-out error against the measured rule's, and writes the predictor to
``--out`` (for ``--config.dynamic.predictor=PATH``) and the measurements
beside it (``PATH.json``). The training steps it runs are thrown away.
Across processes: under ``python -m jpipe.launch`` like training.
"""

import functools
import os
import sys

from jpipe.train import host_devices

host_devices.default_cpu_device_count()

import jax  # noqa: E402
from absl import app, flags, logging  # noqa: E402
from ml_collections import config_flags  # noqa: E402

from jpipe import distributed, dynamic  # noqa: E402
from jpipe.train import (  # noqa: E402
  config_check,
  config_cli,
  dynamic_mode,
  errors,
  train_lib,
)

_CONFIG = config_flags.DEFINE_config_file(
  "config", None, "Training config file (configs/*.py).", lock_config=True
)
_OUT = flags.DEFINE_string(
  "out", None, "Where the fitted predictor goes (a pickle; PATH.json: data)."
)
_FACTORS = flags.DEFINE_list(
  "factors", ["1.5", "2", "3", "4"], "Injected slowdown factors, each > 1."
)
_SPLITS = flags.DEFINE_integer("splits", 8, "Splits to measure on.")
_STEPS = flags.DEFINE_integer(
  "steps_per_window", 3, "Training steps per measured window (averaged)."
)
_TREES = flags.DEFINE_integer(
  "trees", 500, "Trees of the random forest (DynPipe: 500)."
)
flags.mark_flags_as_required(["config", "out"])


def collect_and_fit(config, out, factors, splits, steps_per_window, trees):
  """Measures, fits, writes ``out`` and ``out.json`` (process 0);
  returns the predictor's ``info`` (other processes: {})."""
  config_check.check(config)
  factors = _check_arguments(out, factors, splits, steps_per_window, trees)
  config = config.copy_and_resolve_references()
  with config.unlocked():
    # Measure on the config's pipeline with no slowdown of its own; the
    # collection injects its own.
    config.dynamic.policy = "static"
    config.dynamic.inject = ""
    config.dynamic.predictor = ""
  task = train_lib.build_task(config)
  example = task.batch_at(0)
  lr = train_lib.learning_rate(config)
  pipe = dynamic_mode.build(
    config,
    task,
    example,
    train_lib.build_optimizer(config, lr),
    train_lib.pipeline_options(config, task, lr),
  )
  main = jax.process_index() == 0
  say = print if main else (lambda *a, **k: None)
  state = pipe.init(task.params, task.model_state)
  try:
    _, measured = dynamic.collect(
      pipe,
      state,
      task.batch_at,
      factors=factors,
      num_splits=splits,
      steps_per_window=steps_per_window,
      progress=say,
    )
  except ValueError as e:
    raise errors.UsageError(str(e)) from e
  if not main:  # Process 0 fits and writes.
    return {}
  predictor = dynamic.SlowdownPredictor.fit(
    measured, n_estimators=trees, model=config.model.name
  )
  predictor.save(out)
  with open(out + ".json", "w") as f:
    f.write(measured.to_json())
  info = predictor.info
  nan = float("nan")
  print(
    f"{info['samples']} samples from {len(measured.splits)} splits x "
    f"{len(measured.factors)} factors; held-out mean absolute error of "
    f"the slowdown: forest {info.get('heldout_mae', nan):.3f}, "
    "measured rule (the device's slowdown for any layers) "
    f"{info.get('heldout_mae_measured_rule', nan):.3f}"
  )
  print(f"Predictor: {out} (use --config.dynamic.predictor={out})")
  return info


def _check_arguments(out, factors, splits, steps_per_window, trees):
  """The factors as numbers, once the flags are known to be usable
  (``errors.UsageError`` naming the flag otherwise)."""
  try:
    factors = [float(f) for f in factors]
  except ValueError:
    raise errors.UsageError(
      f"--factors: {factors} are not numbers (e.g. --factors=1.5,2,3)"
    ) from None
  if splits < 1 or steps_per_window < 1 or trees < 1:
    raise errors.UsageError("--splits, --steps_per_window and --trees: >= 1")
  directory = os.path.dirname(os.path.abspath(out))
  if not os.access(directory, os.W_OK):
    raise errors.UsageError(f"--out: cannot write in {directory}")
  return factors


def main(argv):
  del argv  # (parse_flags refuses positional arguments.)
  logging.set_verbosity(logging.WARNING)
  distributed.initialize()
  try:
    collect_and_fit(
      _CONFIG.value,
      _OUT.value,
      _FACTORS.value,
      _SPLITS.value,
      _STEPS.value,
      _TREES.value,
    )
  except errors.USER_ERRORS as e:
    sys.stderr.write(f"error: {e}\n")
    sys.exit(2)


_USAGE = f"""\
usage: python -m jpipe.train.slowdowns --config CONFIG.py[:VARIANT] --out \
PATH [--config.KEY=VALUE ...]

{__doc__.split(chr(10) * 2, 1)[1].strip()}
"""
COMMAND = config_cli.command_of_flags(
  "jpipe.train.slowdowns",
  _USAGE,
  ("out", "factors", "splits", "steps_per_window", "trees"),
)

if __name__ == "__main__":
  app.run(
    main,
    flags_parser=functools.partial(config_cli.parse_flags, command=COMMAND),
  )
