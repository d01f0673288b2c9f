"""Issues one call's lowered ops: each compute action to its stage's
``StageWork`` (a step to the ``UpdateRunner``), each transfer end to the
``CallContext``; then gathers what the call produced."""

import jax

from jpipe import schedule as schedule_lib
from jpipe.runtime.execute import call_results, replica_state
from jpipe.runtime.execute.call_context import CallContext
from jpipe.runtime.execute.in_flight import CallResult, InFlight
from jpipe.runtime.execute.profiler import ActionProfiler
from jpipe.runtime.execute.stage_work import call_result, stage_works
from jpipe.runtime.execute.updates import UpdateRunner

FORWARD, BACKWARD, UPDATE, INPUT, WEIGHT = schedule_lib.ActionKind
SEND, RECV, MOVE, ELSEWHERE = schedule_lib.MoveKind


def run_call(
  driver,
  work,
  *,
  stage_params,
  opt_states,
  model_state,
  replica_model_state=(),
  in_flight: InFlight,
  batches: dict,
  loss_cotangent: float,
  loss_scale: float = 1.0,
  profiler: ActionProfiler | None = None,
) -> CallResult:
  """``Driver.run``: this process's share of the actions of ``work``.

  Args:
    work: the call's work (a ``Call`` or ``ShiftedCall``): its actions
      in issue order (every process's) and the ``(stage, b)`` pairs
      whose backward may run with the forward.
    stage_params, opt_states, model_state, replica_model_state: the
      state before the call.
    in_flight: the stream's state (``InFlight.start`` for a call of a
      synchronous schedule).
    batches: ``{placement: {b: {batch leaf index: array}}}``: the
      microbatches entering in this call, placed.
    loss_cotangent: each microbatch's loss cotangent: 1 / microbatches
      its step averages over, times ``loss_scale``.
    loss_scale: the call's loss scale, which its steps divide their
      gradients by (``Pipeline``'s ``loss_scale``; 1: none).
    profiler: records when each action ran, if given.
  """
  ctx = CallContext(
    driver,
    batches,
    work.fused,
    driver.fused_steps(work),
    loss_cotangent,
    profiler,
    list(model_state),
    dict(in_flight.cots),
    dict(in_flight.tied),
    dict(in_flight.tied_grads),
    {} if driver.record_params else None,
    loss_scale=loss_scale,
  )
  ctx.replica_state = replica_state.unpack(
    replica_model_state, model_state, driver.state_replicas
  )
  stages = stage_works(driver, ctx, in_flight, stage_params, opt_states)
  updates = UpdateRunner(driver, ctx, stages)
  for w in stages:
    w.updates = updates
  # Synchronous steps wait for every backward (tied gradients are
  # summed over all stages first).
  deferred_steps = []
  methods = _handlers(driver, ctx, stages, updates, deferred_steps)
  ops, forwarded = driver.lower(work)
  driver.transport.begin_call()
  if jax.profiler.TraceAnnotation.is_enabled():
    # Each op a span in the jax.profiler trace being taken, so it shows
    # where the host's time goes per kind of action.
    for op in ops:
      with jax.profiler.TraceAnnotation(_trace_name(op)):
        methods[op.kind](op)
  else:  # (Naming and entering spans cost ~2 µs an op.)
    for op in ops:
      methods[op.kind](op)
  if driver.stream is None:
    with jax.profiler.TraceAnnotation("jpipe.S synchronous"):
      updates.synchronous(deferred_steps)
  last = len(driver.stages.specs) - 1
  loss = (
    call_results.mean_loss(driver, ctx.losses) if last in forwarded else None
  )
  aux = call_results.aux_means(driver, ctx.aux, forwarded)
  return call_result(driver, ctx, stages, in_flight.fed, loss, aux)


def _handlers(driver, ctx, stages, updates, deferred_steps) -> dict:
  """``{op kind: what runs an op of it}``: a compute action its stage's
  ``StageWork`` (a synchronous step: kept in ``deferred_steps``), a
  transfer end the ``CallContext``."""
  forwards = [w.forward for w in stages]
  backwards = [w.backward for w in stages]
  input_grads = [w.input_grad for w in stages]
  weight_grads = [w.weight_grad for w in stages]
  return {
    FORWARD: lambda op: forwards[op.stage](op),
    BACKWARD: lambda op: backwards[op.stage](op),
    INPUT: lambda op: input_grads[op.stage](op),
    WEIGHT: lambda op: weight_grads[op.stage](op),
    UPDATE: updates.stream_update
    if driver.stream is not None
    else deferred_steps.append,
    SEND: ctx.send,
    RECV: ctx.receive,
    MOVE: ctx.move,
    # Another process's replica ran it: its step applies it too.
    ELSEWHERE: lambda op: stages[op.action.stage].pending.append(
      op.action.microbatch
    ),
  }


def _trace_name(op) -> str:
  """An op's span name in a profiler's trace: ``jpipe.KIND s=S b=B``
  (KIND an action's letter, F B S I W, or a transfer end's SEND / RECV /
  MOVE with what it carries: ``jpipe.MOVE_F 0->1 b=3``). No colon: the
  profiler drops spans named ``a:b``."""
  if isinstance(op, schedule_lib.Move):
    t = op.transfer
    return f"jpipe.{op.kind}_{t.what} {t.src}->{t.dst} b={op.action.microbatch}"
  return f"jpipe.{op.kind} s={op.stage} b={op.microbatch}"
