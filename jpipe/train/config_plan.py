"""The model a training config would partition, traced and costed.

``python -m jpipe.train.plan --config configs/X.py[:VARIANT]`` uses this:
the config's model and loss are traced on one microbatch of its data
and costed exactly as ``python -m jpipe.train`` does before it splits them.
"""

import importlib.util
import inspect
import os

import ml_collections

from jpipe import partition as partition_lib
from jpipe import runtime
from jpipe import schedule as schedule_lib
from jpipe.train import config_check, config_options, train_lib
from jpipe.train.tasks import build_task


def load_config_file(spec: str) -> ml_collections.ConfigDict:
  """``PATH[:VARIANT]`` -> the file's ``get_config(VARIANT)``, locked."""
  path, _, variant = spec.partition(":")
  if os.path.isdir(path):
    raise ValueError(f"{path!r} is a folder: name a config file in it")
  if not os.path.isfile(path):
    raise ValueError(f"config file {path!r} does not exist")
  module_spec = importlib.util.spec_from_file_location("jpipe_config", path)
  module = importlib.util.module_from_spec(module_spec)
  module_spec.loader.exec_module(module)
  if not callable(getattr(module, "get_config", None)):
    raise ValueError(f"{path} defines no get_config() returning the config")
  takes = inspect.signature(module.get_config).parameters
  if variant and not takes:
    raise ValueError(
      f"{path} has no variants (its get_config takes no argument): drop "
      f"':{variant}'"
    )
  config = module.get_config(variant) if variant else module.get_config()
  config.lock()
  return config


def trace_config(
  config: ml_collections.ConfigDict,
  cost_model: str | None = None,
  num_devices: int | None = None,
  method: str | None = None,
  abstract: bool = False,
  with_last_stage_costs: bool = False,
) -> tuple:
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
    abstract: trace on the params' shapes and a stand-in batch of the
      config's shapes (``build_task(config, abstract=True)``): nothing of
      the model's size is allocated and the dataset is not read (cost
      models "analytic" and "xla"; "measured" runs the nodes).

    with_last_stage_costs: also return the nodes' costs without
      recomputation where training prices the last stage so
      (``prices_last_stage``; else None).

  Returns:
    (traced model, node costs, params: the task's -- the trained ones where
    ``optimizer.freeze`` holds some as model state --, ShapeDtypeStructs when
    ``abstract``) and, ``with_last_stage_costs``, the last stage's costs;
    pass them to ``jpipe.partition.plan_traced`` (``last_stage_costs``).
  """
  config_check.check(config)
  method_costs = cost_model or config.pipeline.cost_model
  if abstract and method_costs == "measured":
    raise ValueError(
      "cost model 'measured' runs each node on real params: plan a model "
      "you cannot hold with --cost-model analytic or xla"
    )
  task = build_task(config, abstract=abstract)
  batch = task.batch_at(0)
  m = config.pipeline.num_microbatches
  micro = {k: v[: len(v) // m] for k, v in batch.items()}
  loss_fn, params, model_state = task.loss_fn, task.params, task.model_state
  if config.optimizer.freeze:  # Held as model state, as the run holds them.
    frozen = runtime.frozen_loss(
      loss_fn,
      params,
      config.optimizer.freeze,
      model_state=model_state,
      has_aux=task.has_aux,
    )
    loss_fn, params, model_state = (
      frozen.loss_fn,
      frozen.params,
      frozen.model_state,
    )
  inputs = micro
  if model_state is not None:
    loss_fn, inputs = partition_lib.with_model_state(
      loss_fn, micro, model_state
    )
  traced = partition_lib.trace(
    loss_fn,
    params,
    inputs,
    depth=config.pipeline.depth or 1,
    has_aux=model_state is not None or task.has_aux,
  )
  split = config_options.partition(config)
  if not config.pipeline.depth and isinstance(split, partition_lib.Split):
    traced, _ = split.depth_of(traced)  # Where its node counts apply.
  elif not config.pipeline.depth:  # Chosen as jpipe.Pipeline chooses it.
    stages = config.pipeline.num_stages
    if (method or config.pipeline.partition) != "mixed":
      stages = min(stages, num_devices or stages)
    traced, _ = partition_lib.choose_depth(traced, stages)
  costs = partition_lib.profile_nodes(
    traced,
    params,
    inputs,
    method=method_costs,
    recompute=config.pipeline.recompute,
  )
  if with_last_stage_costs:
    last = None
    if prices_last_stage(config):
      last = partition_lib.profile_nodes(
        traced, params, inputs, method=method_costs, recompute=False
      )
    return traced, costs, params, last
  return traced, costs, params


def prices_last_stage(config) -> bool:
  """Whether training prices the last stage without recomputation (the
  Pipeline's ``price_last_stage``: recomputation and a fused last stage;
  a re-partitioning run prices every stage alike)."""
  return (
    config.pipeline.recompute
    and config.pipeline.fuse_last_stage
    and not config.dynamic.enabled
  )


def memory_budget(
  config, params, stages: int, limit, kind=None
) -> partition_lib.MemoryBudget:
  """``jpipe.partition.plan_traced``'s memory for the config, as
  ``jpipe.Pipeline`` gives it when training: the limit (None: none), the
  config's optimizer's state per param byte, its schedule's (or
  ``kind``'s; auto: 1f1b's) in-flight and stash counts over ``stages``
  stages, recomputation."""
  if kind is None:
    kind = schedule_lib.REGISTRY.get(config.schedule.name)
  return runtime.partitioner_memory_model(
    limit,
    optimizer_of(config),
    params,
    kind or schedule_lib.REGISTRY["1f1b"],
    config.pipeline.num_microbatches,
    stages,
    recompute=config.pipeline.recompute,
    stashes=config.staleness.stashing,
    fused_last=config.pipeline.fuse_last_stage,
    grad_accum_dtype=config.optimizer.grad_accum_dtype or None,
  )


def optimizer_of(config):
  """The config's optax optimizer, as training builds it."""
  return train_lib.build_optimizer(config, train_lib.learning_rate(config))
