"""The model a training config would partition, traced and costed.

``python -m jpipe.train.plan --config configs/X.py[:VARIANT]`` uses this:
the config's model and loss are traced on one microbatch of its data
and costed exactly as ``python -m jpipe.train`` does before it splits them.
"""

import importlib.util
import os

import ml_collections

from jpipe import partition as partition_lib
from jpipe.train import config_check
from jpipe.train.tasks import build_task


def load_config_file(spec: str) -> ml_collections.ConfigDict:
  """``PATH[:VARIANT]`` -> the file's ``get_config(VARIANT)``, locked."""
  path, _, variant = spec.partition(":")
  if not os.path.isfile(path):
    raise ValueError(f"config file {path!r} does not exist")
  module_spec = importlib.util.spec_from_file_location("jpipe_config", path)
  module = importlib.util.module_from_spec(module_spec)
  module_spec.loader.exec_module(module)
  config = module.get_config(variant) if variant else module.get_config()
  config.lock()
  return config


def trace_config(
  config: ml_collections.ConfigDict,
  cost_model: str | None = None,
  num_devices: int | None = None,
  method: str | None = None,
) -> tuple[partition_lib.TracedModel, partition_lib.NodeCosts]:
  """Traces and costs the config's model on one microbatch of its data,
  as ``python -m jpipe.train`` does before it partitions.

  Args:
    config: a training config.
    cost_model: "analytic", "xla" or "measured"; default the config's
      ``pipeline.cost_model``.
    num_devices: the devices the plan is for (default the config's
      ``pipeline.num_stages``): with ``pipeline.depth`` 0 the nodes' depth
      is chosen for them, as ``jpipe.Pipeline`` does.
    method: the partition method (default the config's).

  Returns:
    (traced model, node costs); pass them to ``jpipe.partition.plan_traced``.
  """
  config_check.check(config)
  task = build_task(config)
  batch = task.batch_at(0)
  m = config.pipeline.num_microbatches
  micro = {k: v[: len(v) // m] for k, v in batch.items()}
  loss_fn, inputs = task.loss_fn, micro
  if task.model_state is not None:
    loss_fn, inputs = partition_lib.with_model_state(
      task.loss_fn, micro, task.model_state
    )
  traced = partition_lib.trace(
    loss_fn,
    task.params,
    inputs,
    depth=config.pipeline.depth or 1,
    has_aux=task.model_state is not None,
  )
  if not config.pipeline.depth:  # Chosen as jpipe.Pipeline chooses it.
    stages = config.pipeline.num_stages
    if (method or config.pipeline.partition) != "mixed":
      stages = min(stages, num_devices or stages)
    traced, _ = partition_lib.choose_depth(traced, stages)
  costs = partition_lib.profile_nodes(
    traced,
    task.params,
    inputs,
    method=cost_model or config.pipeline.cost_model,
    recompute=config.pipeline.recompute,
  )
  return traced, costs
