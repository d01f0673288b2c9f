"""Where a stage's inputs come from and its outputs go: the same
devices, another process (what a profile stamps), the readers of a
model-state leaf in other processes."""

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
  producer updates it)."""
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
        readers.setdefault(transport.stage_process[s], s)
    if src is not None:
      readers.pop(transport.stage_process[src], None)
    out.append(tuple(readers.values()))
  return out
