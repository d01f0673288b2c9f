"""Bringing per-stage state to every process (gather, state dicts, plans).

In one process a stage's arrays are simply fetched to the host. Across
processes each stage's arrays live only in the process that runs it:
``trees_everywhere`` broadcasts them from there to every process
(``jpipe.distributed.broadcast``, at a quiet point: every process calls
it, in the same order, for every stage). It is for checkpoints and
evaluation, not for every step: it blocks until the arrays are ready and
copies them to every host.
"""

from collections.abc import Sequence
from typing import Any

import jax
import numpy as np

from jpipe import distributed
from jpipe.runtime.build.key_arrays import key_data, wrap_key_data
from jpipe.runtime.build.placement import local_copy


def trees_everywhere(
  trees: Sequence[Any],
  templates,
  holders: Sequence[int],
  *,
  to_every_process: bool = False,
):
  """Pytrees that each live in one process, as host arrays on every
  process. Every process calls it with the same templates and holders.

  Args:
    trees: each pytree where this process holds it (else None).
    templates: each pytree's shapes and dtypes (anything with ``.shape``
      / ``.dtype`` leaves; used where another process holds it).
    holders: per pytree, the process that holds it. Where one process
      holds them all (one process, or a pipeline of its own among several
      processes' pipelines, as in data parallel) it only fetches them and
      no other process takes part: the others get None for each.
    to_every_process: every process gets every tree even then.
  """
  me = jax.process_index()
  if jax.process_count() == 1 or (
    len(set(holders)) == 1 and not to_every_process
  ):
    if holders[0] != me:
      return [None] * len(trees)
    return [jax.device_get(_local(t)) for t in trees]
  out = []
  for tree, template, holder in zip(trees, templates, holders, strict=True):
    here = holder == me
    # Typed PRNG keys (NNX's RNG streams in model state) go as key data.
    if here:
      local = jax.device_get(jax.tree.map(key_data, _local(tree)))
    else:
      local = jax.tree.map(
        lambda a: np.zeros(np.shape(a), a.dtype),
        jax.tree.map(lambda a: key_data(_abstract(a)), template),
      )
    out.append(jax.tree.map(wrap_key_data, _broadcast(local, here), template))
  return out


def _abstract(leaf) -> jax.ShapeDtypeStruct:
  return jax.ShapeDtypeStruct(np.shape(leaf), leaf.dtype)


def _local(tree):
  """``tree`` readable in this process: a replica group's global arrays
  (across processes) as their copies here."""
  return jax.tree.map(local_copy, tree)


def _broadcast(tree, is_source):
  """``broadcast_one_to_all`` (a sum with zeros elsewhere): booleans go
  as integers."""
  bools = jax.tree.map(lambda x: np.asarray(x).dtype == bool, tree)
  tree = jax.tree.map(
    lambda x, b: np.asarray(x, np.uint8) if b else np.asarray(x), tree, bools
  )
  out = distributed.broadcast(tree, is_source)
  return jax.tree.map(lambda x, b: x.astype(bool) if b else x, out, bools)
