"""A pipeline built from option values, as one frozen value of its parts.

``build_pipeline`` runs ``build/phases.py``'s phases in order (cut the traced
model, partition it, place the stages, schedule the calls), then the
runtime phase here (stage programs, tied params, one optimizer per stage,
the version policy, the driver), and returns every part in one
``PipelineParts``: ``jpipe.Pipeline`` is a facade over it (it checks
the request first, ``_build.check_request``). The
``Pipeline`` keyword spelling of the staleness and partitioning options
is mapped to their values in one place, ``options_from_keywords``.
"""

import dataclasses
import difflib
from collections.abc import Mapping, Sequence
from typing import Any

import jax

from jpipe import partition as partition_lib
from jpipe import schedule as schedule_lib
from jpipe.runtime.build.auto_schedule import choose_schedule
from jpipe.runtime.build.flat import FlatLayout
from jpipe.runtime.build.grad_dtype import gradient_avals
from jpipe.runtime.build.optimizer_locality import check_pipeline_optimizer
from jpipe.runtime.build.options import Staleness, staleness_from_keywords
from jpipe.runtime.build.params_view import ParamsView
from jpipe.runtime.build.partitioning import (
  Partitioning,
  partitioning_from_keywords,
)
from jpipe.runtime.build.phases import (
  ModelCut,
  Partitioned,
  Placed,
  Request,
  Scheduled,
  cut_model,
  own_bytes,
  partition_model,
  place_stages,
  schedule_calls,
)
from jpipe.runtime.build.programs import StagePrograms
from jpipe.runtime.build.stage_optimizer import StageOptimizer, leaf_names
from jpipe.runtime.build.stored_params import StoredParams
from jpipe.runtime.build.tied import TiedParams
from jpipe.runtime.build.versions import VersionPolicy
from jpipe.runtime.execute.driver import Driver
from jpipe.runtime.execute.hooks import DriverHooks

STALENESS_KEYWORDS = tuple(f.name for f in dataclasses.fields(Staleness))
PARTITIONING_KEYWORDS = tuple(f.name for f in dataclasses.fields(Partitioning))


def options_from_keywords(
  staleness: Staleness | None,
  partitioning: Partitioning | None,
  keywords: Mapping[str, Any],
  own: Sequence[str] = (),
) -> tuple[Staleness, Partitioning]:
  """The staleness and partitioning values of ``Pipeline(...)``: the
  values given, or ones made from their keyword spelling (``keywords``:
  the options given by name). A name of neither is refused, with the
  nearest known one (of these and ``own``, the Pipeline's own
  arguments)."""
  known = STALENESS_KEYWORDS + PARTITIONING_KEYWORDS
  for name in keywords:
    if name not in known:
      near = difflib.get_close_matches(name, (*own, *known), n=1)
      hint = f" (did you mean {near[0]!r}?)" if near else ""
      raise TypeError(
        f"Pipeline() got an unexpected keyword argument {name!r}{hint}; "
        f"its options are the arguments of jpipe.runtime.Staleness "
        f"{STALENESS_KEYWORDS} and jpipe.runtime.Partitioning "
        f"{PARTITIONING_KEYWORDS}"
      )
  by_staleness = {k: v for k, v in keywords.items() if k in STALENESS_KEYWORDS}
  by_partition = {
    k: v for k, v in keywords.items() if k in PARTITIONING_KEYWORDS
  }
  num_stages = by_partition.pop("num_stages", None)
  return (
    staleness_from_keywords(staleness, **by_staleness),
    partitioning_from_keywords(partitioning, num_stages, **by_partition),
  )


@dataclasses.dataclass(frozen=True)
class Runtime:
  """What runs the stages (the last construction phase).

  Attributes:
    programs: each stage's jitted forward, backward and fused programs.
    tied: which stage owns each tied parameter, and their replicas.
    params_treedef: the params' structure.
    leaf_names: every param leaf's global path.
    stage_optimizers: each stage's ``StageOptimizer``.
    policy: which param version each forward and backward uses.
    driver: runs a call's actions over the stages.
  """

  programs: StagePrograms
  tied: TiedParams
  params_treedef: Any
  leaf_names: tuple[str, ...]
  stage_optimizers: tuple[StageOptimizer, ...]
  policy: VersionPolicy
  driver: Driver


def build_runtime(
  params,
  cut: ModelCut,
  stages,
  placed: Placed,
  stream,
  request: Request,
  *,
  record_params: bool,
  hooks: DriverHooks | None,
  stages_at=None,
) -> Runtime:
  """Stage programs, tied params, per-stage optimizers, the version
  policy and the driver, for stages placed as ``placed`` says."""
  staleness, traced = request.staleness, cut.traced
  sources = (  # per traced param leaf: (model leaf, row)
    traced.param_layout.source
    if traced.param_layout is not None
    else [(i, -1) for i in range(traced.num_param_leaves)]
  )
  # Before anything compiles: a whole-model step would run per stage.
  check_pipeline_optimizer(
    request.optimizer,
    params,
    [s.param_leaves for s in stages.specs],
    sources,
    traced.param_layout.axes if traced.param_layout is not None else (),
  )
  # A stage's gradients and optimizer state are packed alike: leaves of
  # at least this many bytes travel apart.
  own_sizes = tuple(
    own_bytes(request, place.devices[0].platform) for place in placed.placement
  )
  # (In grad_accum_dtype where given: pack casts each gradient into it.)
  grad_layouts = tuple(
    FlatLayout(
      gradient_avals(
        [traced.closed_jaxpr.in_avals[i] for i in spec.param_leaves],
        request.grad_accum_dtype,
      ),
      own,
    )
    for spec, own in zip(stages.specs, own_sizes, strict=True)
  )
  tied = TiedParams(stages, placed.transport, request.grad_accum_dtype)
  _check_replica_routing(placed, tied, cut, stages, request)
  programs = StagePrograms(
    stages,
    grad_layouts,
    staleness.recompute,
    stages.compiler_options,
    placed.placement,
    stages_at,
  )
  param_storage = _param_storage(traced, stages, own_sizes, tied)
  for weighted in programs.weighted.values():
    weighted.prepare()  # A model that changes with the size fails here.
  names = tuple(leaf_names(params))
  if traced.param_layout is not None:  # A stacked leaf's rows: "path[k]".
    names = traced.param_layout.traced_names(names)
  treedef = jax.tree.structure(params)
  stage_optimizers = _stage_optimizers(
    stages,
    tied,
    stream,
    (names, treedef, sources, _layer_axes(traced)),
    grad_layouts,
    own_sizes,
    request,
  )
  policy = VersionPolicy(
    stream,
    weight_stashing=staleness.weight_stashing,
    prediction=staleness.prediction,
    gap_aware=staleness.gap_aware,
    record=record_params,
    nag_with_predictor=staleness.nag_with_predictor,
    unpredicted=frozenset(
      {stages.num_stages - 1} if staleness.last_stage_optimizer else ()
    ),
  )
  _check_stream_clipping(request, stream, placed)
  driver = Driver(
    stages,
    programs,
    placed.placement,
    stage_optimizers,
    policy,
    tied,
    placed.transport,
    stream,
    num_batch_leaves=cut.num_batch_leaves,
    record_params=record_params,
    hooks=hooks,
    clip_global_norm=request.clip_global_norm,
    skip_nonfinite=request.skip_nonfinite_steps,
    partial_window=staleness.partial_window,
    param_storage=param_storage,
  )
  return Runtime(
    programs,
    tied,
    jax.tree.structure(params),
    names,
    stage_optimizers,
    policy,
    driver,
  )


def _param_storage(traced, stages, own_sizes, tied) -> tuple[StoredParams, ...]:
  """Per stage, its params stored packed while the driver runs (leaves
  of ``own_sizes[s]`` bytes or more apart, as the gradients are; tied
  leaves apart: swapped one by one)."""
  avals = traced.closed_jaxpr.in_avals
  return tuple(
    StoredParams(
      [avals[i] for i in spec.param_leaves],
      own,
      tied.positions(s),
      stages.compiler_options,
    )
    for s, (spec, own) in enumerate(zip(stages.specs, own_sizes, strict=True))
  )


def _check_stream_clipping(request, stream, placed) -> None:
  """Global-norm clipping of a stream reads every stage's latest norm:
  one process only."""
  if request.clip_global_norm and stream and placed.transport.multiprocess:
    raise ValueError(
      "clip_global_norm with a streaming schedule needs every stage in "
      "one process (each step reads the other stages' latest gradient "
      "norms, which no transfer carries between processes); use a "
      "synchronous schedule or one process"
    )


def _check_replica_routing(placed, tied, cut, stages, request) -> None:
  """Round-robin (1F1B-RR) and weighted replicas where they are built
  for: a replica runs a microbatch (or its slice) on its own copies of
  the params, and its group steps on the replicas' summed gradients. A
  round-robin replica keeps its own model state
  (``execute.replica_state``), in its own process where the group spans
  processes."""
  routing = request.partitioning.replica_routing
  if not any(p.round_robin or p.weighted for p in placed.placement):
    return
  staleness = request.staleness
  weighted = any(p.weighted for p in placed.placement)
  first_aux = cut.loss_outputs.first_aux
  makes_aux = [
    any(r >= first_aux for r in spec.results) for spec in stages.specs
  ]
  aux_on_weighted = any(
    p.weighted and aux
    for p, aux in zip(placed.placement, makes_aux, strict=True)
  )
  aux_across_processes = any(
    placed.placement[s].round_robin and makes_aux[s]
    for s in placed.transport.spanning
  )
  refused = {
    "a pipeline spanning processes (a weighted group slices each "
    "microbatch in one process)": weighted and placed.transport.multiprocess,
    "tied params (their exchange between stages is per stage, not per "
    "replica)": bool(tied.stages),
    "model state such as batch statistics (one value per stage, not per "
    "replica)": cut.num_state_leaves > 0 and weighted,
    "aux outputs made on a weighted group's stage (has_aux=True: each "
    "replica makes its slice's, and sums and means combine otherwise)": (
      aux_on_weighted
    ),
    "aux outputs made on a round-robin group spanning processes (has_aux="
    "True: each process holds its own replicas' microbatches' only)": (
      aux_across_processes
    ),
    "weight prediction (it predicts from the group's state, not a "
    "replica's)": staleness.prediction is not None,
    "Gap-Aware (its step reads a replica's stashed params)": (
      staleness.gap_aware is not None
    ),
  }
  for what, present in refused.items():
    if present:
      raise ValueError(
        f"replica_routing={routing!r} does not run with {what}: use "
        "replica_routing='split' (each microbatch split evenly over the "
        "replicas, SPMD) or drop that option"
      )


def _layer_axes(traced) -> dict[int, tuple[int, int]]:
  """``{model leaf: (layer axis, ndim)}`` of the leaves stacked on another
  axis than 0 (``ParamsView``'s ``axes``)."""
  layout = traced.param_layout
  if layout is None or not layout.axes:
    return {}
  return {
    i: (a, len(traced.closed_jaxpr.in_avals[r].shape))
    for r, (i, _) in enumerate(layout.source)
    if (a := layout.axis(i))
  }


def _stage_optimizers(
  stages, tied, stream, leaves_of_model, grad_layouts, own_sizes, request
) -> tuple[StageOptimizer, ...]:
  """Each stage's optimizer over the leaves it steps, seeing them in the
  model's params structure (``leaves_of_model``: every traced param
  leaf's path, the model's params treedef, each traced leaf's
  ``(model leaf, row)``, and ``_layer_axes``; ``grad_layouts``: each
  stage's packed gradient; ``own_sizes``: per stage, the bytes from which
  a leaf of its packed optimizer state is stored apart)."""
  names, treedef, sources, axes = leaves_of_model
  optimizer, staleness = request.optimizer, request.staleness
  predictor = staleness.stage_predictor(optimizer)  # One for every stage.
  last = stages.num_stages - 1
  # Per-stage optimizers must share one state layout: that of stage
  # delay 0's. (A last stage's own optimizer alone: Staleness.check
  # compared it with the optimizer already.)
  reference = staleness.stage_transform(optimizer, 0, stages.num_stages)
  per_delay = (
    staleness.stage_optimizer is not None
    or staleness.pipemare_anneal_steps is not None
  )
  optimizers = []
  for s, layout in enumerate(grad_layouts):
    own = s == last and staleness.last_stage_optimizer is not None
    horizon = stream.max_delay(s) if stream else 0
    leaves = stages.specs[s].param_leaves
    tx = staleness.stage_transform(
      staleness.last_stage_optimizer if own else optimizer,
      horizon,
      stages.num_stages,
    )
    if staleness.nag_with_predictor:
      horizon = max(horizon, 1)
    # Asynchronous: replicas of tied leaves another stage owns never step.
    replica = tied.replica_positions(s) if stream else set()
    positions = [p for p in range(len(leaves)) if p not in replica]
    managed = [leaves[p] for p in positions]
    view = ParamsView(
      treedef, [names[i] for i in managed], [sources[i] for i in managed], axes
    )
    if per_delay:
      _check_same_state(reference, tx, s, view)
    optimizers.append(
      StageOptimizer(
        [names[i] for i in managed],
        tx,
        positions=positions,
        view=view,
        gap_aware=staleness.gap_aware_at(
          partition_lib.steady_state_delay(stages.num_stages, s)
        ),
        predictor=None if own else predictor,
        learning_rate_schedule=staleness.learning_rate_schedule,
        horizon=horizon,
        grad_layout=layout,
        compiler_options=stages.compiler_options,
        state_own_bytes=own_sizes[s],
        stage=s,
        skip_nonfinite=request.skip_nonfinite_steps,
        param_dtypes=[
          stages.traced.closed_jaxpr.in_avals[i].dtype for i in leaves
        ],
      )
    )
  return tuple(optimizers)


def _check_same_state(reference, tx, stage, view) -> None:
  """Raises ValueError unless ``tx``'s state (stage ``stage``'s own
  optimizer) is laid out like ``reference``'s (a delay-0 stage's): one
  checkpoint holds every stage's, merged by leaf."""
  probe = [jax.ShapeDtypeStruct((1, 2), "float32")] * len(view.names)
  want = jax.tree.structure(
    jax.eval_shape(lambda p: reference.init(view.view(p)), probe)
  )
  got = jax.tree.structure(
    jax.eval_shape(lambda p: tx.init(view.view(p)), probe)
  )
  if want != got:
    raise ValueError(
      f"stage {stage}'s optimizer keeps a state shaped unlike a delay-0 "
      f"stage's ({got} vs {want}): one checkpoint holds every stage's "
      "state, so stage_optimizer (and last_stage_optimizer) must build "
      "one optimizer family for every delay"
    )


@dataclasses.dataclass(frozen=True)
class PipelineParts:
  """Everything a built pipeline is made of, by construction phase."""

  request: Request
  cut: ModelCut
  partitioned: Partitioned
  placed: Placed
  scheduled: Scheduled
  runtime: Runtime


def build_pipeline(
  loss_fn,
  params,
  example_batch,
  request: Request,
  *,
  model_state=None,
  has_aux: bool = False,
  record_params: bool = False,
  hooks: DriverHooks | None = None,
) -> PipelineParts:
  """A pipeline's parts (see ``jpipe.Pipeline`` for the arguments), each
  construction phase in order, for a checked ``request``."""
  cut = cut_model(
    loss_fn, params, example_batch, model_state, request, has_aux=has_aux
  )
  parts = partition_model(cut, params, request)
  request = choose_schedule(parts, cut, params, request)  # (auto only)
  placed = place_stages(parts, cut, request)
  scheduled = schedule_calls(parts.stages, placed, request)
  runtime = build_runtime(
    params,
    cut,
    parts.stages,
    placed,
    scheduled.stream,
    request,
    record_params=record_params,
    hooks=hooks,
    stages_at=parts.stages_at,
  )
  return PipelineParts(request, cut, parts, placed, scheduled, runtime)


def with_schedule(parts: PipelineParts, choice) -> PipelineParts:
  """``parts`` running ``choice.chosen`` (a synchronous schedule, as
  ``schedule="auto"`` picks) instead of theirs: of a synchronous
  pipeline only the request and the calls depend on which."""
  kind = schedule_lib.REGISTRY[choice.chosen]
  request = dataclasses.replace(
    parts.request,
    schedule_kind=kind,
    schedule_name=kind.name,
    schedule_choice=choice,
  )
  scheduled = schedule_calls(parts.partitioned.stages, parts.placed, request)
  return dataclasses.replace(parts, request=request, scheduled=scheduled)
