"""A training run described once: the config checked and resolved into
what the training loop asks of it again and again.

``describe(config)`` validates the config (every invalid field in one
message, before any work) and returns a frozen ``Run``: which loop mode
runs it (one pipeline, several in data parallel, or one that
re-partitions), what a checkpoint must match to be resumed (its
fingerprint), and how many optimizer steps one pipeline step takes.
"""

import dataclasses
import hashlib
import os

from jpipe.train import config_check

# Where the config decides it; kept here for its callers.
from jpipe.train.config_options import steps_per_call as steps_per_call
from jpipe.train.data_parallel_mode import uses_data_parallel
from jpipe.train.errors import UsageError

MODES = ("pipeline", "data_parallel", "dynamic")


@dataclasses.dataclass(frozen=True)
class Run:
  """What the loop needs to know of a config, resolved once.

  Attributes:
    mode: "pipeline", "data_parallel" (SD-Pipe: ``data_parallel.*``) or
      "dynamic" (DynPipe: ``dynamic.enabled``).
    steps: pipeline steps (``train.steps``).
    steps_per_call: optimizer steps one pipeline step takes (async: one
      per ``step_every`` microbatches; 2bw: one per minibatch).
    fingerprint: what a checkpoint must match to be resumed (model,
      its arguments, the optimizer; the pipeline count where several):
      not the partition, which may change.
    data_order: the fields that decide which examples step k reads
      (``DATA_ORDER_FIELDS``: ``{"data.batch_size": 32, ...}``); a
      resumed run must keep them (``check_data_order``).
  """

  mode: str
  steps: int
  steps_per_call: int
  fingerprint: dict
  data_order: dict = dataclasses.field(default_factory=dict)

  @property
  def dynamic(self) -> bool:
    return self.mode == "dynamic"

  @property
  def data_parallel(self) -> bool:
    return self.mode == "data_parallel"


def describe(config) -> Run:
  """The config checked (``config_check.check``) and resolved."""
  config_check.check(config)
  if uses_data_parallel(config):
    mode = "data_parallel"
  elif config.dynamic.enabled:
    mode = "dynamic"
  else:
    mode = "pipeline"
  return Run(
    mode,
    config.train.steps,
    steps_per_call(config),
    fingerprint(config),
    data_order(config),
  )


# The fields that decide which examples a step reads: a run's data
# position is its step (a task's batches are a pure function of it).
DATA_ORDER_FIELDS = ("data.batch_size", "seed", "data.sequence_length")


def data_order(config) -> dict:
  """``DATA_ORDER_FIELDS``' values in ``config`` (those it has)."""
  out = {}
  for field in DATA_ORDER_FIELDS:
    node, *path = field.split(".")
    value = config.get(node)
    for key in path:
      value = value.get(key) if hasattr(value, "get") else None
    if value is not None:
      out[field] = value
  return out


def check_data_order(meta: dict | None, run: Run, workdir: str) -> None:
  """A UsageError where the checkpoint to resume (``meta``) read its
  data in another order than this run would: its step would then stand
  for other examples (another batch size skips or repeats them)."""
  saved = (meta or {}).get("data_order")
  if not isinstance(saved, dict):
    return  # (A checkpoint from before it was recorded.)
  changed = [
    f for f in run.data_order if f in saved and saved[f] != run.data_order[f]
  ]
  if not changed:
    return
  fields = "; ".join(
    f"config.{f}: saved {saved[f]!r}, now {run.data_order[f]!r}"
    for f in changed
  )
  keep = " ".join(f"--config.{f}={saved[f]}" for f in changed)
  raise UsageError(
    f"{fields}: a resumed run reads the examples of its step, which "
    "another value moves (examples skipped or read twice). Resume with "
    f"{keep}; or train on from these weights in a new run: "
    f"--config.init_from={workdir} --workdir NEW_DIR (the optimizer state "
    "starts anew)"
  )


def fingerprint(config) -> dict:
  """What a checkpoint must match to be resumed (not the partition)."""
  task = {"task": config.task} if config.task else {}
  tokenizer = _tokenizer_identity(config.data.get("tokenizer", ""))
  size = config.model.get("size", "")
  return (
    task
    | ({"tokenizer": tokenizer} if tokenizer else {})
    | ({"model_size": size} if size else {})
    | (  # Params saved in another dtype: another model's layout.
      {"param_dtype": config.model.param_dtype}
      if config.model.get("param_dtype")
      else {}
    )
    | {
      "model": config.model.name,
      "model_kwargs": repr(sorted(config.model.kwargs.to_dict().items())),
      "optimizer": config.optimizer.name,
    }
    | (  # Frozen leaves have no optimizer state: another layout.
      {"freeze": config.optimizer.freeze} if config.optimizer.freeze else {}
    )
    | (  # Each replica is saved: resume with as many.
      {"pipelines": config.data_parallel.pipelines}
      if config.data_parallel.pipelines > 1
      else {}
    )
  )


def _tokenizer_identity(tokenizer: str) -> str:
  """A tokenizer file by its contents (another file with other ids at the
  same path is another model's; the same file moved is not); a name
  ("bytes") as it is."""
  if not tokenizer or not os.path.isfile(tokenizer):
    return tokenizer
  digest = hashlib.sha256()
  with open(tokenizer, "rb") as f:
    for block in iter(lambda: f.read(1 << 20), b""):
      digest.update(block)
  return f"sha256:{digest.hexdigest()[:32]}"
