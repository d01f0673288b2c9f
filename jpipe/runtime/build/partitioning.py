"""How a pipeline is split into stages and placed, as one value.

``Partitioning`` holds ``jpipe.Pipeline``'s options of the split and the
placement (the stage count, the partition method or a Plan, the node
depth, the bandwidth and cost model the partitioner plans with, the last
stage's fusion, the transport between processes, the memory limit); the
construction phases (``build/phases.py``) read it whole. It checks what it can
without the model or the devices.
"""

import dataclasses
from collections.abc import Mapping
from typing import Any

from jpipe.partition import Split
from jpipe.runtime.build.transport import TRANSPORTS

# How a replicated stage shares its microbatches (``replica_routing``).
REPLICA_ROUTINGS = ("split", "round_robin", "weighted")


@dataclasses.dataclass(frozen=True)
class Partitioning:
  """How a pipeline is split and placed: ``jpipe.Pipeline``'s split and
  placement options, each also its keyword argument of the same name.

  Attributes:
    num_stages: pipeline stages (ignored when ``partition`` is a Plan);
      with "pipedream_hybrid", the devices the plan may use (its DP picks
      the stages and their replicas).
    partition: "contiguous", "acyclic", "mixed", "pipedream",
      "pipedream_hybrid"
      (see ``jpipe.partition.plan_traced``), a jpipe.partition.Split (nodes
      and replicas per stage, given; num_stages must be its stage count),
      or a jpipe.partition.Plan. A Plan
      may put a stage on several devices (``stage_devices[s]`` =
      ``(0, 1)``): the stage then runs data parallel over them, each
      microbatch split among the replicas (it must divide evenly), with
      the same results as on one device. Stages share all their devices
      or none.
    depth: module-path depth of the traced nodes; None (the default)
      chooses it: the shallowest depth whose split into the stages is as
      balanced (within 5 %) as the deepest's (``Pipeline.granularity`` says
      which and why; with a Plan, the depth its nodes were cut at).
    bandwidth: bytes/s between devices, for the partitioner (None: plan on
      compute alone; "pipedream" / "pipedream_hybrid" then assume 1e9 for
      the all-reduce of replicated stages).
    cost_model: how the partitioner costs nodes (see
      ``jpipe.partition.profile_nodes``): "analytic" (FLOPs from the jaxpr;
      default, no compilation), "xla" (XLA's cost analysis) or "measured"
      (each node compiled and timed on the default device: slower to
      start, right where FLOPs mislead, e.g. small or memory-bound ops).
      With recomputation, a fused last stage and ``price_last_stage`` the
      nodes are costed both ways and the last stage priced without it.
    fuse_last_stage: run the backward of a stage no other stage reads
      from (the last, which computes the loss) together with its forward,
      as one program, wherever the result is the same: B(s, k) needs
      nothing but F(s, k), so it may run early unless a step of s comes
      between them (async) or it would differentiate at other params.
      One program instead of a forward and a backward-from-residuals lets
      XLA fuse across them and keeps no residuals: GPipe's last stage no
      longer holds every microbatch's activations. A measured timeline
      shows such an F spanning both and its B as an instant. Only the
      order of the gradient sum changes (float rounding).
    fuse_step: in an asynchronous stream, run a stage's step in the
      program of the backward right before it (the stage's next action is
      its step: every microbatch with ``step_every=1``, a window's last
      backward otherwise), the gradient applied inside the program: one
      program call fewer per step, and no accumulator crosses the host.
      Where the step reads the gradient as accumulated (not with gradient
      clipping, data-parallel replicas' reduction, round-robin or weighted
      replica groups; a stage owning tied leaves only where its holders'
      gradients of them arrive before its backward, which then adds
      them). A measured timeline shows such a B spanning both and its S
      as an instant. On a CPU the results are
      the separate programs' to the bit (tested); a GPU's compiler may
      fuse the update into the gradient's kernels (float rounding).
    price_last_stage: FTPipe's async meta-algorithm (its partitioner's
      ``-a``): with recomputation and a fused last stage (which never
      recomputes), price the last stage's nodes without recomputation
      (``plan_traced``'s ``last_stage_costs``). False: every stage alike.
    transport: how values cross processes when the devices belong to
      several (``jax.distributed``; each process runs its own stages):
      "pull" (``jax.experimental.transfer``: never blocks a device) or
      "collective" (a ppermute pair program: gloo / NCCL, but it ties the
      two stages' streams together). See ``runtime/build/transport.py``.
    memory_limit: bytes each device may hold, or "device" (each device's
      own capacity, where the platform reports it: GPUs and TPUs); None
      (default) checks nothing. The partitioner ("contiguous",
      "pipedream*") then only considers splits that fit, and the built
      pipeline's prediction (``Pipeline.memory``: params and their stashed
      versions, gradients, optimizer state, microbatches in flight for
      the schedule) must fit, or construction fails naming the stage, the
      predicted bytes and the fixes -- before anything compiles.
    gpu_command_buffers: whether XLA records the stage programs' and
      optimizer steps' kernels as CUDA graphs (its command buffers) on
      GPUs. A recorded graph is re-pointed at every argument buffer that
      moved since its last run, so graphs pay where most buffers keep
      their place between calls -- a synchronous schedule's params, the
      same all step -- and cost where they move every call: a stream
      steps each stage after every microbatch, so each forward reads new
      params. None (default): on for synchronous schedules, off for
      streams, as measured on an H100 (``experiments/RESULTS.md``, "The
      GPU campaign, second run": 1f1b 134 ms a step with graphs, 180
      without; async 287 with, 234 without). No effect off GPUs.
    replica_routing: how a stage on several devices shares the work:
      "split" (default: each microbatch split among the replicas, SPMD;
      every delay and result as on one device) or "round_robin"
      (PipeDream's 1F1B-RR: microbatch b whole on replica b mod r, the
      replicas' gradients summed at each step; under ``async`` each
      replica runs PipeDream's warm-up, (R - 1 - sum of the replicas of
      the stages before) // r forwards, a stage steps once per round of
      its r replicas on their mean gradient, at PipeDream's rate per
      stage, the optimizer's times r_s / r_0). Each replica keeps its
      own model state (batch statistics), in its own process where the
      group spans processes (not the last stage's); not with tied
      params, weight prediction or Gap-Aware. (The partitioner plans
      replicas as split; the built pipeline's memory check counts whole
      microbatches.) Or
      "weighted" (DynPipe's DP-stage load balancing): each microbatch
      split unevenly, replica j taking ``rows[j]`` of its examples (even
      at first; ``Pipeline.set_replica_rows``, or ``DynamicPipeline``
      from each replica's measured speed), each replica running its slice
      as its own program, the replicas' gradients summed at each step:
      any microbatch size. The loss must be a mean over the microbatch's
      examples; one process; not with tied params, model state, weight
      prediction, Gap-Aware or split backwards (zero-bubble schedules).
    own_buffer_bytes: the size from which a gradient leaf (in a stage's
      accumulator) or a residual (a saving forward's, for its backward)
      is its own array in the stage programs' arguments; smaller ones
      travel packed, one flat buffer per dtype, and a stage's optimizer
      state is stored alike (gradient-sized). A packed leaf costs a
      copy, an array a few microseconds of the host's dispatch per
      call. None (default): the platform's
      (``jpipe.runtime.build.flat.own_buffer_bytes``: 16 KiB on a CPU; 4 MiB
      for gradients and optimizer states, 1 MiB for residuals on
      accelerators). The math is the same either way; gradients and
      residuals keep their bits, but an optimizer's moments stored in a
      shared buffer may round differently in the last bits (XLA fuses
      the update otherwise): 0 keeps every bit of unpacked leaves.
    mixed_blocks: ``partition="mixed"`` only: the block counts L its
      solver tries, the best kept (FTPipe's ``--L``; at most L stages
      after same-device runs merge). None (default): P, 2P, 3P, 4P (and
      6P to 16P with a memory limit) for P devices.
  """

  num_stages: int
  partition: Any = "contiguous"
  depth: int | None = None
  bandwidth: float | None = None
  cost_model: str = "analytic"
  fuse_last_stage: bool = True
  fuse_step: bool = True
  price_last_stage: bool = True
  transport: str = "pull"
  memory_limit: float | str | None = None
  gpu_command_buffers: bool | None = None
  replica_routing: str = "split"
  own_buffer_bytes: float | None = None
  mixed_blocks: tuple[int, ...] | None = None

  def __post_init__(self):
    if self.num_stages < 1:
      raise ValueError(f"num_stages must be >= 1, got {self.num_stages}")
    split = self.partition
    if isinstance(split, Split) and split.num_stages != self.num_stages:
      raise ValueError(
        f"num_stages={self.num_stages} but the split "
        f"{split.describe()} has {split.num_stages} stages: give "
        f"num_stages={split.num_stages}"
      )
    if self.own_buffer_bytes is not None and not self.own_buffer_bytes >= 0:
      raise ValueError(
        f"own_buffer_bytes must be a size in bytes >= 0 (0: pack nothing, "
        f"math.inf: pack everything) or None for the platform's default, "
        f"got {self.own_buffer_bytes!r}"
      )
    if self.mixed_blocks is not None and self.partition != "mixed":
      raise ValueError(
        f"mixed_blocks={self.mixed_blocks} is for partition='mixed', not "
        f"{self.partition!r}: drop it or use the mixed pipe"
      )
    if self.replica_routing not in REPLICA_ROUTINGS:
      raise ValueError(
        f"unknown replica_routing {self.replica_routing!r}: one of "
        f"{REPLICA_ROUTINGS}"
      )
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
  # The mixed solver's block counts go with it (a Plan has its stages).
  blocks = {} if partition == "mixed" else {"mixed_blocks": None}
  if options.get("partitioning") is not None:
    options["partitioning"] = dataclasses.replace(
      options["partitioning"], partition=partition, **blocks
    )
  else:
    options["partition"] = partition
    if "mixed_blocks" in options:
      options.update(blocks)
  return options


def _same(value, default) -> bool:
  """``value`` is the keyword's default (a Plan is never a default)."""
  return type(value) is type(default) and value == default
