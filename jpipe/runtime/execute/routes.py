"""Where a stage's inputs come from and its outputs go (the same
devices, another process: what a profile stamps; the readers of a
model-state leaf in other processes), and what follows for a driver's
ops: which moves copy nothing, which steps run in their backward's
program, each stage's learning-rate factor."""

from jpipe.runtime.build.placement import StagePlacement


def same_place(a: StagePlacement, b: StagePlacement) -> bool:
  """Whether a value of a stage placed at ``a`` is already where a stage
  placed at ``b`` reads it (neither deals microbatches to replicas)."""
  return a == b and not a.round_robin and not b.round_robin


def remote_inputs(specs, producer, transport) -> tuple:
  """Per stage s: (per input of s, whether another process's stage makes
  it; per output of s, whether a stage of another process reads it, and
  so sends its cotangent)."""
  process = transport.stage_process
  reader_processes = {}
  for r, spec in enumerate(specs):
    for v in spec.inputs:
      reader_processes.setdefault(v, set()).add(process[r])
  return tuple(
    (
      tuple(process[producer[v]] != process[s] for v in spec.inputs),
      tuple(
        bool(reader_processes.get(v, set()) - {process[s]})
        for v in spec.outputs
      ),
    )
    for s, spec in enumerate(specs)
  )


def state_readers(stages, transport, num_batch_leaves) -> list[tuple]:
  """Per model-state leaf: per process other than its producer's, the
  first stage there that reads it (it is sent there whenever the
  producer updates it), each stage once. A replica group across
  processes is in each of its processes: a reader group gets the leaf
  in every one of them that lacks it, a producer group has it in all."""
  producer_of_result = {
    r: s for s, spec in enumerate(stages.specs) for r in spec.results
  }
  num_leaves = len(stages.traced.closed_jaxpr.in_avals) - (
    stages.traced.num_param_leaves + num_batch_leaves
  )
  out = []
  for i in range(num_leaves):
    src = producer_of_result.get(i + 1)
    readers = {}
    for s, spec in enumerate(stages.specs):
      if num_batch_leaves + i in spec.batch_leaves:
        for q in transport.stage_processes[s]:
          readers.setdefault(q, s)
    if src is not None:
      for q in transport.stage_processes[src]:
        readers.pop(q, None)
    # (A move into a group reaches each of its processes: one a stage.)
    out.append(tuple(dict.fromkeys(readers.values())))
  return out


def replica_rates(placement, streaming: bool) -> tuple[float, ...]:
  """Per stage, PipeDream's learning-rate factor with round-robin
  replicas (1F1B-RR, asynchronous): r_s / r_0 for r_s replicas, so every
  stage moves as far per microbatch; synchronous steps keep one rate."""
  counts = [len(p.devices) for p in placement]
  round_robin = any(p.round_robin for p in placement)
  return tuple(
    c / counts[0] if round_robin and streaming else 1.0 for c in counts
  )


def inputs_placed(specs, placement, producer) -> tuple:
  """Per stage: its inputs, each with whether it comes from a stage on
  the same devices. Moving those would copy nothing: F reads them where
  their producer left them and B adds their cotangents straight in, with
  no MOVE op between (~14 µs of Python each, 448 a step at p = 8, m = 32
  on one device)."""
  return tuple(
    tuple(
      (v, same_place(placement[producer[v]], placement[s])) for v in spec.inputs
    )
    for s, spec in enumerate(specs)
  )


def outputs_read(specs) -> tuple:
  """Per stage: its outputs, each with how many stages read it."""
  readers = {}
  for spec in specs:
    for v in spec.inputs:
      readers[v] = readers.get(v, 0) + 1
  return tuple(
    tuple((v, readers.get(v, 0)) for v in spec.outputs) for spec in specs
  )


def steps_with_backward(placement, streaming: bool, plain: bool) -> tuple:
  """Per stage: whether a stream's step may run in the program of the
  backward before it (``Call.fused_steps``), a third fewer programs per
  microbatch: where the step reads the accumulated gradient as it is
  (``plain``: no clipping, no hooks reducing it), on one device or an
  SPMD group. A holder of tied leaves hands their gradients on from the
  same program; an owner adds its holders' (``Driver.fused_steps``: only
  where they all arrive before its backward runs)."""
  return tuple(
    streaming and plain and not (p.round_robin or p.weighted) for p in placement
  )
