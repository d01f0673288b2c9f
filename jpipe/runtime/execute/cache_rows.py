"""A decoding cache stacked per layer, held by the stages as its rows.

A model whose layers are scanned (``nn.scan`` with ``variable_axes=
{"params": 0, "cache": 0}``) keeps its decoding cache stacked like its
params: [layers, ...] per leaf. The pipeline splits the scan by layer
(``partition/_scan_layers.py``), each iteration slicing its row of the
cache and the iterations' new rows concatenated after the last. Held
whole, the cache would be gathered on the scan's last stage and copied
to the others every step. Held as rows instead (``on_rows``: the
decoding functions take and return the leaf's rows, concatenated for
the model and sliced back after), each row is read straight by its
layer's iteration and written straight from it
(``partition/_row_forwarding.py``), on that layer's stage.
"""

import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp

from jpipe.runtime.build.state_rows import rows_read_by_layer


def layer_rows(program, cache_leaves) -> dict[int, int]:
  """``{k: rows}`` for the cache leaves (k-th of ``cache_leaves``, batch
  leaf indices) that a scan split by layer alone reads, row by row (its
  per-iteration slices): a cache stacked per layer."""
  traced = program.stages.traced
  n = traced.num_param_leaves
  return rows_read_by_layer(traced, [n + leaf for leaf in cache_leaves])


def row_avals(leaves, rows: dict) -> list:
  """The cache's leaves with each stacked one as a tuple of its rows."""
  return [
    tuple(
      jax.ShapeDtypeStruct((1, *x.shape[1:]), x.dtype) for _ in range(rows[k])
    )
    if k in rows
    else x
    for k, x in enumerate(leaves)
  ]


@functools.lru_cache(maxsize=32)
def on_rows(fn: Callable, treedef, rows: tuple) -> Callable:
  """``fn`` taking and returning the cache as ``row_avals`` lays it out:
  a stacked leaf as its rows, concatenated for ``fn`` and sliced back
  after (the partitioner reads each row from its own layer's iteration,
  ``partition/_row_forwarding.py``: no row leaves its stage)."""
  rows = dict(rows)

  def by_rows(params, *state_and_batch):
    *state, batch = state_and_batch
    leaves = [
      jnp.concatenate(x) if k in rows else x
      for k, x in enumerate(batch["cache"])
    ]
    cache = jax.tree.unflatten(treedef, leaves)
    logits, new = fn(params, *state, {**batch, "cache": cache})
    return logits, [
      tuple(jax.lax.slice_in_dim(x, r, r + 1) for r in range(rows[k]))
      if k in rows
      else x
      for k, x in enumerate(jax.tree.leaves(new))
    ]

  return by_rows
