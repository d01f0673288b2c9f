"""One ``step`` or ``flush`` call of a built pipeline.

The call's microbatches are cut from the batch and placed, its action
lists (``build/calls.py``) run by the driver, and the stream's position and
the step count carried into the returned ``PipelineState``.
"""

import dataclasses

import jax

from jpipe.runtime._pipeline_state import PipelineState
from jpipe.runtime.build.batches import batch_size, place_microbatches
from jpipe.runtime.execute.in_flight import InFlight
from jpipe.runtime.execute.profiler import ActionProfiler


def step(pipe, state: PipelineState, batch, profile: bool):
  """``Pipeline.step``: ``batch`` cut into microbatches of the pipeline's
  size and run; returns (state, metrics)."""
  pipe.check_own_state(state)
  pipe.batch_spec.check(batch)
  size = batch_size(batch)
  if size % pipe.microbatch_size:
    raise ValueError(
      f"a batch of {size} examples does not split into microbatches of "
      f"{pipe.microbatch_size} (the example batch's size / "
      f"num_microbatches): pass a multiple of {pipe.microbatch_size}"
    )
  m = size // pipe.microbatch_size
  fed = state.in_flight.fed if state.in_flight else 0
  batches = place_microbatches(
    jax.tree.leaves(batch), pipe.batch_leaves, m, fed
  )
  return _run(pipe, state, fed, m, batches, profile)


def flush(pipe, state: PipelineState, profile: bool):
  """``Pipeline.flush``: an asynchronous stream drained (a no-op when
  nothing is in flight or the schedule is synchronous)."""
  pipe.check_own_state(state)
  if pipe.stream is None or not state.in_flight.fed:
    return state, {}
  return _run(pipe, state, state.in_flight.fed, None, {}, profile)


def _run(pipe, state, fed, m, batches, profile):
  """One driver call: m microbatches after ``fed`` (None: a flush)."""
  call = pipe.calls(fed, m)
  profiler = ActionProfiler(call.lists) if profile else None
  flight = state.in_flight or InFlight.start(state.stage_params)
  if pipe.stream is None:
    cotangent = 1.0 / m
  else:  # A window's mean (a short one is rescaled at its step).
    cotangent = 1.0 / pipe.stream.step_every
  # Times the loss scale (a static one, or a dynamic one's now); each
  # step divides its gradient by it.
  dynamic, static = state.loss_scale, pipe.loss_scale
  if dynamic is not None:
    scale = dynamic.scale
  else:  # (A static one is a float: check_loss_scale.)
    scale = static if isinstance(static, float) else 1.0
  cotangent *= scale
  out = pipe.driver.run(
    call,
    stage_params=state.stage_params,
    opt_states=state.opt_states,
    model_state=state.model_state,
    replica_model_state=state.replica_model_state,
    in_flight=flight,
    batches=batches,
    loss_cotangent=cotangent,
    loss_scale=scale,
    profiler=profiler,
  )
  flight = out.in_flight
  if pipe.stream is None or m is None:
    if not flight.drained:
      raise RuntimeError("the pipeline did not drain")  # A schedule bug.
    flight = InFlight.start(out.stage_params) if pipe.stream else None
  else:
    flight = dataclasses.replace(flight, fed=fed + m)
  metrics = _metrics(pipe, out, profiler)
  if dynamic is not None and m is not None:
    metrics["loss_scale"] = scale
    # Reading the flag waits for the step, as Megatron's scaler does: the
    # next scale depends on it. (Every process running a stage has it,
    # from the global norm; a process running none keeps its scale.)
    if out.step_skipped is not None:
      dynamic = pipe.loss_scale.adjust(dynamic, not bool(out.step_skipped))
  new = PipelineState(
    tuple(out.stage_params),
    tuple(out.opt_states),
    state.step + (m is not None),
    tuple(out.model_state),
    flight,
    out.replica_model_state,
    dynamic,
  )
  return new, metrics


def _metrics(pipe, out, profiler) -> dict:
  """A call's metrics from the driver's ``CallResult``."""
  metrics = {
    "param_versions": tuple(out.param_versions),
    "param_bytes": tuple(out.param_bytes),
  }
  if out.loss is not None:
    metrics["loss"] = out.loss
  if out.aux is not None:
    metrics["aux"] = jax.tree.unflatten(pipe.loss_outputs.aux_treedef, out.aux)
  if profiler:
    metrics["timeline"] = profiler.timeline()
  if out.used_params is not None:
    metrics["used_params"] = out.used_params
  if out.step_skipped is not None:
    metrics["step_skipped"] = out.step_skipped
  return metrics
