"""Weight stashing: a ring of the param versions forwards ran with.

A stage with delay d has up to d + 1 microbatches in flight (PipeDream keeps
d + 1 versions). Microbatch b's forward params go to slot b mod S; its
backward (and gap-aware) reads them back. All functions are pure and
jit-able with traced microbatch ids; donate the stash to update it in place.
"""

from typing import NamedTuple

import jax
import jax.numpy as jnp
import optax

from jpipe.staleness import _common


class WeightStash(NamedTuple):
  """Stashed forward-time params, one slot per in-flight microbatch."""

  versions: optax.Params  # each leaf shape=(num_slots, *param.shape).
  microbatch: jax.Array  # shape=(num_slots,), int32: owner id, -1 if empty.


def stash_slots_for_delay(delay: int) -> int:
  """Slots a stage with delay ``delay`` needs: d + 1 (PipeDream)."""
  _common.check_delay(delay)
  return int(delay) + 1


def stash_init(params: optax.Params, num_slots: int) -> WeightStash:
  """An empty stash of ``num_slots`` versions shaped like ``params``.

  Every slot starts as a copy of ``params`` (so a read before the first
  write returns the initial weights, as in a pipeline's warm-up).
  """
  if num_slots < 1:
    raise ValueError(f"num_slots must be >= 1, got {num_slots}")
  versions = jax.tree.map(
    lambda p: jnp.broadcast_to(p, (num_slots, *jnp.shape(p))).copy(), params
  )
  return WeightStash(versions, jnp.full((num_slots,), -1, jnp.int32))


def stash_put(
  stash: WeightStash, microbatch: jax.typing.ArrayLike, params: optax.Params
) -> WeightStash:
  """Stores ``params`` as microbatch ``microbatch``'s forward-time version."""
  slot = _slot(stash, microbatch)
  versions = jax.tree.map(
    lambda buf, p: jax.lax.dynamic_update_index_in_dim(
      buf, p.astype(buf.dtype), slot, axis=0
    ),
    stash.versions,
    params,
  )
  ids = stash.microbatch.at[slot].set(jnp.asarray(microbatch, jnp.int32))
  return WeightStash(versions, ids)


def stash_get(
  stash: WeightStash, microbatch: jax.typing.ArrayLike
) -> optax.Params:
  """The params stored for ``microbatch``: its slot's, the initial params
  while nothing was stored there. A slot another microbatch has taken
  since is a ValueError where the ids are concrete; under jit (traced
  ids) check :func:`stash_holds` (a ring of too few slots for the delay
  returns another microbatch's params)."""
  slot = _slot(stash, microbatch)
  if not isinstance(microbatch, jax.core.Tracer) and not isinstance(
    stash.microbatch, jax.core.Tracer
  ):
    held = int(stash.microbatch[int(slot)])
    if held >= 0 and held != int(microbatch):
      raise ValueError(
        f"microbatch {int(microbatch)}'s slot holds microbatch {held}'s "
        f"params now: the stash's {len(stash.microbatch)} slots are too few "
        "for its delay (stash_slots_for_delay(d) = d + 1)"
      )
  return jax.tree.map(
    lambda buf: jax.lax.dynamic_index_in_dim(buf, slot, axis=0, keepdims=False),
    stash.versions,
  )


def stash_holds(
  stash: WeightStash, microbatch: jax.typing.ArrayLike
) -> jax.Array:
  """Whether the slot of ``microbatch`` holds that microbatch (bool [])."""
  slot = _slot(stash, microbatch)
  mb = jnp.asarray(microbatch, jnp.int32)
  return (stash.microbatch[slot] == mb) & (mb >= 0)  # (-1 marks empty.)


def stash_nbytes(stash: WeightStash) -> int:
  """Bytes held by the stashed versions (all slots, excluding the index)."""
  return sum(
    int(x.size) * x.dtype.itemsize for x in jax.tree.leaves(stash.versions)
  )


def _slot(stash: WeightStash, microbatch: jax.typing.ArrayLike) -> jax.Array:
  """The ring slot of a microbatch id."""
  return jnp.asarray(microbatch, jnp.int32) % stash.microbatch.shape[0]
