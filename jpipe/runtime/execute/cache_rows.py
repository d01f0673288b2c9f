"""A decoding cache stacked per layer, held by the stages as its rows.

A model whose layers are scanned (``nn.scan`` with ``variable_axes=
{"params": 0, "cache": 0}``) keeps its decoding cache stacked like its
params: [layers, ...] per leaf. The pipeline splits the scan by layer
(``partition/_scan_layers.py``), each iteration slicing its row of the
cache and the iterations' new rows concatenated after the last. Held
whole, the cache would be gathered on the scan's last stage and copied
to the others every step. Held as rows instead (``on_rows``: the
decoding functions take and return the cache as the pipeline's leaves,
the rows of a ``StateRows`` layout, as model state stacked per layer
is held), each row is read straight by its layer's iteration and
written straight from it (``partition/_row_forwarding.py``), on that
layer's stage.
"""

import functools
from collections.abc import Callable

from jpipe.runtime.build.state_rows import StateRows, rows_read_by_layer


def layer_rows(program, cache_leaves) -> dict[int, tuple[int, int]]:
  """``{k: (rows, layer axis)}`` for the cache leaves (k-th of ``cache_leaves``, batch
  leaf indices) that a scan split by layer alone reads, row by row (its
  per-iteration slices): a cache stacked per layer."""
  traced = program.stages.traced
  n = traced.num_param_leaves
  return rows_read_by_layer(traced, [n + leaf for leaf in cache_leaves])


@functools.lru_cache(maxsize=32)
def on_rows(fn: Callable, rows: StateRows) -> Callable:
  """``fn(params, *state, batch) -> (logits, cache)`` taking and
  returning ``batch["cache"]`` as ``rows``'s leaves: a stacked leaf as
  its rows, stacked for ``fn`` and sliced back after. Cached, so that
  the pipeline's programs (kept per function) are made once."""

  def by_rows(params, *state_and_batch):
    *state, batch = state_and_batch
    cache = rows.to_model(batch["cache"])
    logits, new = fn(params, *state, {**batch, "cache": cache})
    return logits, rows.to_rows(new)

  return by_rows
