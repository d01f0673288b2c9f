"""A call's mini-batch cut into microbatches, placed where stages read it.

One transfer and one jitted split per device per call, not a slice and a
``device_put`` per forward: on one device that cut ~0.2 ms of host work
from every forward action (experiments/runtime/overhead.py). A replica
group receives ``[microbatch, example]`` split over its devices, each
device only its examples (``StagePlacement.split_microbatches``); a
round-robin group's replica j its microbatches b = j mod k, whole.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np


def batch_size(batch) -> int:
  """The common leading size of a batch's leaves (clear error if none)."""
  sizes = {np.shape(x)[0] for x in jax.tree.leaves(batch) if np.ndim(x)}
  if len(sizes) != 1:
    raise ValueError(
      f"batch leaves need one common leading (batch) size, got {sizes}"
    )
  return sizes.pop()


def place_microbatches(leaves, wanted_by_placement, m: int, first: int):
  """``{placement: {b: {leaf index: array}}}`` for microbatches
  ``first .. first + m - 1`` of the batch ``leaves``.

  Args:
    leaves: the batch's leaves (leading axis: the batch).
    wanted_by_placement: ``{placement: [leaf indices its stages read]}``.
    m: microbatches in the batch.
    first: the stream index of the first.
  """
  out = {}
  for place, wanted in wanted_by_placement.items():
    if not wanted:
      out[place] = {first + k: {} for k in range(m)}
      continue
    chosen = [leaves[i] for i in wanted]
    if place.round_robin:  # Microbatch b whole on replica b mod k.
      out[place] = {}
      for j, replica in enumerate(place.replicas):
        if replica.device.process_index != jax.process_index():
          continue  # (Another process's replica: it places its own.)
        parts = split_microbatches(tuple(replica.put_replicated(chosen)), m)
        out[place].update(
          (first + k, dict(zip(wanted, part, strict=True)))
          for k, part in enumerate(parts)
          if place.replica_index(first + k) == j
        )
      continue
    if place.weighted:  # Whole on the first device, sliced at each run.
      parts = split_microbatches(tuple(jax.device_put(chosen, place.device)), m)
    elif len(place.devices) > 1:
      parts = place.split_microbatches(chosen, m)
    else:
      parts = split_microbatches(tuple(place.put_replicated(chosen)), m)
    out[place] = {
      first + k: dict(zip(wanted, part, strict=True))
      for k, part in enumerate(parts)
    }
  return out


@functools.partial(jax.jit, static_argnums=1)
def split_microbatches(leaves, m):
  """m tuples of leaf slices along axis 0 (one program, m x L outputs)."""
  return tuple(
    tuple(jnp.reshape(x, (m, -1, *x.shape[1:]))[k] for x in leaves)
    for k in range(m)
  )
