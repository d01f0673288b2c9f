"""A Pipeline's arguments kept, to build it again for any plan."""

import dataclasses
import functools
from collections.abc import Callable, Mapping
from typing import Any

import jax

from jpipe.runtime._pipeline import Pipeline
from jpipe.runtime.build.partitioning import partition_of, with_partition


@functools.partial(
  jax.tree_util.register_dataclass,
  # (A pytree of its arrays: a caller's mesh-typed ones come in plain,
  # build/user_mesh.py, as Pipeline's own arguments do.)
  data_fields=["params", "example_batch"],
  meta_fields=["loss_fn", "options"],
)
@dataclasses.dataclass(frozen=True)
class PipelineBuilder:
  """Builds ``jpipe.Pipeline``s of one model and one set of options, for a
  plan, on devices, with hooks: what training made of several pipelines
  takes (``DataParallelPipelines``: one per replica, on its devices;
  ``DynamicPipeline``: one per plan it switches to).

  Attributes:
    loss_fn, params, example_batch: as ``jpipe.Pipeline``.
    options: its keyword arguments (``num_stages``, ``schedule``,
      ``num_microbatches``, ``optimizer``, ``partition`` or
      ``partitioning``, ...).
  """

  loss_fn: Callable[..., Any]
  params: Any
  example_batch: Any
  options: Mapping[str, Any] = dataclasses.field(default_factory=dict)

  @classmethod
  def of(cls, loss_fn, params, example_batch, **options) -> "PipelineBuilder":
    """``PipelineBuilder(loss_fn, params, example_batch, options)``, the
    options spelled as ``jpipe.Pipeline``'s keywords."""
    return cls(loss_fn, params, example_batch, options)

  @property
  def partition(self) -> Any:
    """The partition method or Plan the options ask for."""
    return partition_of(self.options)

  def with_options(self, **options) -> "PipelineBuilder":
    """This builder with some options replaced."""
    return dataclasses.replace(self, options={**self.options, **options})

  def __call__(self, plan=None, *, devices=None, hooks=None) -> Pipeline:
    """A Pipeline of ``plan`` (a ``jpipe.partition.Plan``; None: the
    options' partition), on ``devices`` and with ``hooks`` (None: the
    options')."""
    options = dict(self.options)
    if plan is not None:
      options = with_partition(options, plan)
    if devices is not None:
      options["devices"] = devices
    if hooks is not None:
      options["hooks"] = hooks
    return Pipeline(self.loss_fn, self.params, self.example_batch, **options)
