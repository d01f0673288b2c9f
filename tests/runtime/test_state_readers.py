"""``routes.state_readers``: where a model-state leaf goes after the
forward that updates it -- to every process that runs a stage reading it
but not the producer, a replica group across processes counted in each of
its processes. Checked on made-up layouts (no devices)."""

import itertools
from types import SimpleNamespace

import numpy as np

from jpipe.runtime.execute import routes

NUM_PARAMS, NUM_BATCH = 2, 1


def _layout(processes, reads, produced_by):
  """Stages on ``processes`` (per stage, its processes), one model-state
  leaf read by the stages in ``reads`` and made by ``produced_by`` (None:
  by none); returns (stages, transport) as ``state_readers`` reads them."""
  specs = [
    SimpleNamespace(
      batch_leaves=[0] + ([NUM_BATCH] if s in reads else []),
      results=[1] if s == produced_by else [],
    )
    for s in range(len(processes))
  ]
  traced = SimpleNamespace(
    closed_jaxpr=SimpleNamespace(
      in_avals=[None] * (NUM_PARAMS + NUM_BATCH + 1)
    ),
    num_param_leaves=NUM_PARAMS,
  )
  stages = SimpleNamespace(specs=specs, traced=traced)
  transport = SimpleNamespace(
    stage_processes=[tuple(sorted(p)) for p in processes],
    stage_process=[min(p) for p in processes],
  )
  return stages, transport


def _reference(processes, reads, produced_by):
  """The readers a plain restatement sends the leaf to: per process not
  among the producer's, the first reading stage there; each stage once,
  in stage order."""
  away = set() if produced_by is None else set(processes[produced_by])
  wanting = {q for s in reads for q in processes[s]} - away
  return sorted({min(s for s in reads if q in processes[s]) for q in wanting})


def test_a_reader_group_gets_the_leaf_in_its_other_process():
  """Stage 0 across processes 0 and 1 reads the leaf, the last stage
  makes it in process 0: process 1's share of stage 0 needs it too (its
  lead's process, 0, already has it)."""
  stages, transport = _layout([{0, 1}, {1}, {0}], reads={0, 1}, produced_by=2)
  assert routes.state_readers(stages, transport, NUM_BATCH) == [(0,)]


def test_a_producer_group_has_the_leaf_in_each_of_its_processes():
  """The last stage, across processes 0 and 1, makes the leaf: stages of
  either process read their own copy, nothing moves; one in process 2
  gets it."""
  stages, transport = _layout([{0}, {1}, {0, 1}], reads={0, 1}, produced_by=2)
  assert routes.state_readers(stages, transport, NUM_BATCH) == [()]
  stages, transport = _layout([{2}, {1}, {0, 1}], reads={0, 1}, produced_by=2)
  assert routes.state_readers(stages, transport, NUM_BATCH) == [(0,)]


def test_random_layouts_match_the_restatement():
  """Every process running a reader and not the producer gets the leaf
  from a stage listed once (the restatement's, in its order)."""
  rng = np.random.default_rng(0)
  for _ in range(300):
    n = int(rng.integers(1, 6))
    processes = [
      set(rng.choice(4, size=int(rng.integers(1, 3)), replace=False).tolist())
      for _ in range(n)
    ]
    reads = {s for s in range(n) if rng.random() < 0.6}
    produced_by = None if rng.random() < 0.2 else int(rng.integers(0, n))
    stages, transport = _layout(processes, reads, produced_by)
    (got,) = routes.state_readers(stages, transport, NUM_BATCH)
    assert list(got) == _reference(processes, reads, produced_by)
    away = set() if produced_by is None else processes[produced_by]
    covered = set(itertools.chain(*(processes[s] for s in got)))
    assert {q for s in reads for q in processes[s]} - away <= covered
    assert len(set(got)) == len(got)
