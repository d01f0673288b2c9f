"""A call's mini-batch cut into microbatches, placed where stages read it.

One transfer and one jitted split per device per call, not a slice and a
``device_put`` per forward: on one device that cut ~0.2 ms of host work
from every forward action (experiments/runtime/overhead.py). A replica
group receives ``[microbatch, example]`` split over its devices, each
device only its examples (``StagePlacement.split_microbatches``); a
round-robin group's replica j its microbatches b = j mod k, whole.
"""

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np


@dataclasses.dataclass(frozen=True)
class BatchSpec:
  """What every batch of a pipeline must be like: the example batch's
  structure and, per leaf, its path, its shape after the batch axis and
  its dtype (as JAX stores it: NumPy's int64 as int32 without x64). The
  stages were traced for exactly these; only the batch size may differ.
  """

  treedef: Any
  paths: tuple[str, ...]
  shapes: tuple[tuple[int, ...], ...]
  dtypes: tuple[Any, ...]

  @classmethod
  def of(cls, example_batch) -> "BatchSpec":
    """The spec of ``example_batch``; raises ValueError naming a leaf
    that is not an array with a batch axis."""
    flat, treedef = jax.tree_util.tree_flatten_with_path(example_batch)
    paths = tuple(jax.tree_util.keystr(path) or "batch" for path, _ in flat)
    for path, (_, x) in zip(paths, flat, strict=True):
      if not hasattr(x, "shape") or not hasattr(x, "dtype"):
        raise ValueError(
          f"batch leaf {path} is of type {type(x).__name__}, not an array: a "
          "batch holds arrays with a leading batch axis (pass other values "
          "to loss_fn through its closure)"
        )
      if not np.ndim(x):
        raise ValueError(
          f"batch leaf {path} is a scalar: every batch leaf needs the "
          "leading batch axis, shape (batch, ...) (pass a constant to "
          "loss_fn through its closure)"
        )
    return cls(
      treedef,
      paths,
      tuple(tuple(np.shape(x)[1:]) for _, x in flat),
      tuple(stored_dtype(x) for _, x in flat),
    )

  def check(self, batch) -> None:
    """Raises ValueError naming the first way ``batch`` differs from the
    example batch (its size aside)."""
    leaves, treedef = jax.tree.flatten(batch)
    if treedef != self.treedef:
      raise ValueError(
        f"the batch is structured unlike the example batch the pipeline "
        f"was built with ({treedef} vs {self.treedef}): pass the same "
        "fields"
      )
    for path, shape, dtype, x in zip(
      self.paths, self.shapes, self.dtypes, leaves, strict=True
    ):
      got = stored_dtype(x) if hasattr(x, "dtype") else type(x).__name__
      if not np.ndim(x) or np.shape(x)[1:] != shape or got != dtype:
        raise ValueError(
          f"batch leaf {path} is {got}{list(np.shape(x))}, the "
          f"example batch's {dtype}[batch{''.join(f', {d}' for d in shape)}]: "
          "the stages were traced for the example's (only the batch size "
          "may differ); convert it, or build the pipeline with such a batch"
        )


def stored_dtype(x):
  """The dtype ``x`` has on a device (x64 off: 64-bit NumPy leaves are
  stored in 32 bits)."""
  return jax.dtypes.canonicalize_dtype(x.dtype, allow_extended_dtype=True)


def batch_size(batch) -> int:
  """The common leading size of a batch's leaves (clear error if none)."""
  sizes = {np.shape(x)[0] for x in jax.tree.leaves(batch) if np.ndim(x)}
  if len(sizes) != 1:
    raise ValueError(
      f"batch leaves need one common leading (batch) size, got {sizes}"
    )
  return sizes.pop()


def padded_to_multiple(batch, multiple: int) -> tuple[Any, int]:
  """``(batch padded, its own size)``: every leaf's leading (batch) axis
  grown to the next multiple of ``multiple`` with copies of its last
  example (a ``jax.ShapeDtypeStruct`` leaf, a process's stand-in for data
  it does not read, grows its shape). Copies, not zeros: an inference
  function sees only examples like its own (no division by a zero
  length, no empty prompt), and per-example outputs of the copies are
  dropped by the caller (``[:size]``)."""
  size = batch_size(batch)
  extra = -size % multiple
  if not extra:
    return batch, size

  def pad(x):
    if not np.ndim(x):  # (Not a batch leaf: no batch axis to grow.)
      return x
    if isinstance(x, jax.ShapeDtypeStruct):
      return jax.ShapeDtypeStruct((size + extra, *x.shape[1:]), x.dtype)
    if isinstance(x, jax.Array):
      return jnp.concatenate([x, jnp.repeat(x[-1:], extra, axis=0)])
    x = np.asarray(x)
    return np.concatenate([x, np.repeat(x[-1:], extra, axis=0)])

  return jax.tree.map(pad, batch), size


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
