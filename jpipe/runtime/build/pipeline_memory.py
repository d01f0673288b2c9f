"""The memory prediction of a built pipeline, and its limit check.

``build/memory.py`` says what one stage holds; this module asks a built
``Pipeline`` for the facts that decide it (its schedule's action lists,
version policy, tied leaves, stage programs, optimizers) and adds them up.
"""

import jax

from jpipe.partition import MemoryLimitError
from jpipe.runtime.build.memory import (
  StageMemory,
  format_bytes,
  nbytes,
  param_versions,
  predict_stage_memory,
  split_backward_states,
  tied_copies,
)


def predict_pipeline_memory(pipe) -> tuple[StageMemory, ...]:
  """Per stage of a built ``Pipeline``, its predicted peak bytes (see
  ``Pipeline.memory``): the in-flight counts from the call's real action
  lists (a stream: enough calls to reach its steady state, then a
  flush), versions and tied copies from the version policy, every array
  from abstract evaluation."""
  n = pipe.stages.num_stages
  calls = _calls_to_steady_state(pipe)
  states = split_backward_states(calls, n)
  # Stages whose backward runs split (an I leaves a microbatch awaiting W).
  splits = {s for s, seen in enumerate(states) if any(w for _, w in seen)}
  versions = param_versions(pipe.policy, pipe.stream, n)
  replicas = [sorted(pipe.tied.replica_positions(s)) for s in range(n)]
  owners = [pipe.tied.replica_owner(s) for s in range(n)]
  copies = tied_copies(pipe.policy, pipe.stream, owners)
  avals = pipe.traced.closed_jaxpr.in_avals
  first_batch = pipe.traced.num_param_leaves
  out = []
  for s, (spec, params) in enumerate(
    zip(pipe.stages.specs, pipe.stage_param_avals(), strict=True)
  ):
    batch = tuple(avals[first_batch + i] for i in spec.batch_leaves)
    acts = tuple(v.aval for v in spec.inputs)
    outputs, results, residuals = jax.eval_shape(
      lambda p, b, a, s=s: pipe.stages.forward_saving(s, p, b, a),
      params,
      batch,
      acts,
    )
    kept = (batch, acts) if pipe.programs.recompute else residuals
    weight_kept = ()
    if s in splits:  # What its W keeps from its I, per microbatch.
      weight_kept = _weight_kept(pipe, s, params, batch, acts, kept)
    k, w = nbytes(kept), nbytes(weight_kept)
    in_flight, awaiting = max(states[s], key=lambda p: p[0] * k + p[1] * w)
    out.append(
      predict_stage_memory(
        params=params,
        opt_state=jax.eval_shape(pipe.stage_optimizers[s].init, params),
        kept=kept,
        residuals=residuals,
        outputs=(outputs, results),
        intermediates=jax.eval_shape(
          lambda p, b, a, s=s: pipe.stages.intermediates(s, p, b, a),
          params,
          batch,
          acts,
        ),
        in_flight=in_flight,
        versions=versions[s],
        tied=copies[s] * nbytes([params[p] for p in replicas[s]]),
        replicas=_replicas(pipe.placement[s]),
        weight_kept=weight_kept,
        awaiting_weight=awaiting,
        round_robin=pipe.placement[s].round_robin,
        grads=pipe.gradient_avals(s, params),
      )
    )
  return tuple(out)


def _calls_to_steady_state(pipe) -> list:
  """The calls whose action lists decide the peak: one of the example's
  microbatches (synchronous), or enough to reach a stream's steady
  state, then a flush."""
  m = pipe.num_microbatches
  if pipe.stream is None:
    return [pipe.calls(0, m)]
  count = 2 + -(-pipe.stream.settled() // m)
  calls = [pipe.calls(i * m, m) for i in range(count)]
  return [*calls, pipe.calls(count * m, None)]


def _weight_kept(pipe, s, params, batch, acts, kept):
  """The avals of what stage s's I hands its W for one microbatch."""
  spec = pipe.stages.specs[s]
  out_cots = tuple(v.aval for v in spec.outputs)
  loss = pipe.traced.jaxpr.outvars[0].aval
  result_cots = tuple(loss if r == 0 else None for r in spec.results)
  if pipe.programs.recompute:
    args = (params, batch, acts, out_cots, result_cots)
    run = pipe.stages.input_gradient
  else:
    args = (params, kept, out_cots, result_cots)
    run = pipe.stages.input_gradient_from_residuals
  return jax.eval_shape(lambda *a: run(s, *a), *args)[1]


def check_memory_limit(pipe, limit: float) -> None:
  """Refuses a pipeline whose prediction exceeds ``limit`` bytes on a
  device, naming the device, the stage, its terms and the fixes."""
  totals = pipe.device_memory
  over = [d for d in sorted(totals) if totals[d] > limit]
  if not over:
    return
  d = max(over, key=totals.get)
  stages = [s for s, ds in enumerate(pipe.plan.stage_devices) if d in ds]
  worst = max(stages, key=lambda s: pipe.memory[s].total)
  fixes = ["more stages (each holds fewer params and activations)"]
  if not pipe.programs.recompute:
    fixes.append(
      "recompute=True (a microbatch in flight keeps only the stage's "
      "inputs, not its residuals)"
    )
  if pipe.memory[worst].in_flight > 1:
    fixes.append(
      "smaller microbatches (more num_microbatches for the same batch)"
    )
  if pipe.schedule_name == "gpipe":
    fixes.append("schedule='1f1b' (n - s microbatches in flight, not all)")
  if pipe.memory[worst].versions > 1:
    fixes.append("fewer stashed versions (2bw, or no weight stashing)")
  raise MemoryLimitError(
    f"the pipeline does not fit memory_limit={format_bytes(limit)}: "
    f"device {d} is predicted to hold {format_bytes(totals[d])} "
    f"(stage {', '.join(map(str, stages))}); stage {worst}: "
    f"{pipe.memory[worst].describe()}. Use " + "; or ".join(fixes)
  )


def _replicas(place) -> float:
  """How many ways a microbatch's bytes divide on a stage's busiest
  device: its devices (split evenly), or a weighted group's microbatch
  over its largest slice."""
  if place.weighted:
    return place.microbatch_size / max(place.rows)
  return len(place.devices)
