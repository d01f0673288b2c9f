"""How a pipeline is split into stages and placed, as one value.

``Partitioning`` holds ``jpipe.Pipeline``'s options of the split and the
placement (the stage count, the partition method or a Plan, the node
depth, the bandwidth and cost model the partitioner plans with, the last
stage's fusion, the transport between processes, the memory limit); the
construction phases (``_build.py``) read it whole. It checks what it can
without the model or the devices.
"""

import dataclasses
from collections.abc import Mapping
from typing import Any

from jpipe.runtime._transport import TRANSPORTS


@dataclasses.dataclass(frozen=True)
class Partitioning:
  """The split and placement options; each field is ``jpipe.Pipeline``'s
  keyword argument of the same name (see its Args).

  Attributes:
    num_stages: pipeline stages (with a Plan, ignored).
    partition: a partition method's name or a ``jpipe.partition.Plan``.
    depth: module-path depth of the traced nodes (None: automatic).
    bandwidth: bytes/s between devices for the partitioner (None: plan on
      compute alone).
    cost_model: "analytic", "xla" or "measured".
    fuse_last_stage: the last stage's forward and backward as one program
      where the result is the same.
    transport: "pull" or "collective", across processes.
    memory_limit: bytes per device, "device", or None (no check).
  """

  num_stages: int
  partition: Any = "contiguous"
  depth: int | None = None
  bandwidth: float | None = None
  cost_model: str = "analytic"
  fuse_last_stage: bool = True
  transport: str = "pull"
  memory_limit: float | str | None = None

  def __post_init__(self):
    if self.num_stages < 1:
      raise ValueError(f"num_stages must be >= 1, got {self.num_stages}")
    if self.transport not in TRANSPORTS:
      raise ValueError(
        f"unknown transport {self.transport!r}: one of {TRANSPORTS}"
      )


def partitioning_from_keywords(
  partitioning: Partitioning | None, num_stages: int | None, **keywords
) -> Partitioning:
  """``partitioning``, or one made from ``Pipeline``'s keyword spelling
  of the same options; both at once is refused (which would win?)."""
  if partitioning is None:
    if num_stages is None:
      raise ValueError(
        "num_stages is required: how many pipeline stages (or pass "
        "partitioning=jpipe.runtime.Partitioning(num_stages=...))"
      )
    return Partitioning(num_stages, **keywords)
  defaults = {
    f.name: f.default
    for f in dataclasses.fields(Partitioning)
    if f.default is not dataclasses.MISSING
  }
  given = ["num_stages"] if num_stages is not None else []
  given += [k for k, v in keywords.items() if not _same(v, defaults[k])]
  if given:
    raise ValueError(
      f"partitioning options given twice: partitioning=Partitioning(...) "
      f"and {given}; put them all in the Partitioning value"
    )
  return partitioning


def partition_of(options: Mapping[str, Any]) -> Any:
  """The partition method or Plan ``jpipe.Pipeline``'s keyword
  ``options`` ask for (in their ``partitioning`` value, or as the
  ``partition`` keyword)."""
  if options.get("partitioning") is not None:
    return options["partitioning"].partition
  return options.get("partition", Partitioning.partition)


def with_partition(options: Mapping[str, Any], partition) -> dict:
  """``jpipe.Pipeline``'s keyword ``options`` with ``partition`` (e.g. a
  solved Plan) as their partition, in the spelling they use."""
  options = dict(options)
  if options.get("partitioning") is not None:
    options["partitioning"] = dataclasses.replace(
      options["partitioning"], partition=partition
    )
  else:
    options["partition"] = partition
  return options


def _same(value, default) -> bool:
  """``value`` is the keyword's default (a Plan is never a default)."""
  return type(value) is type(default) and value == default
