"""Random keys in an optimizer's state, drawn apart per stage.

An optimizer that draws noise from a key in its state (``optax.
add_noise``, ``noisy_sgd``) keeps one key; each stage runs its own copy
of the optimizer over its own leaves, so with that one key every stage
would draw the same noise, and leaves at the same position on two stages
(a transformer's layers) would move together -- not the independent
noise one device draws over the whole model.

``stage_keyed(update, s)`` runs stage s's update (s > 0) on its state's
typed keys folded with s, so each stage draws its own stream, while the
keys it keeps are those the update makes from the unfolded ones: every
stage's stored keys stay the one-device state's (a checkpoint holds one,
and a resumed run draws what an uninterrupted one would). The second,
unfolded update is kept only for its keys; XLA drops the rest of it.
Keys as raw ``uint32`` arrays (``jax.random.PRNGKey``) cannot be told
from other integers and are left as they are.
"""

import jax
import jax.numpy as jnp

from jpipe.runtime.build.key_arrays import is_key


def stage_keyed(update, stage: int):
  """``update`` (an optax update function) drawing stage ``stage``'s own
  random stream (the module docstring); stage 0's is ``update``."""
  if stage == 0:
    return update

  def keyed_update(updates, state, params=None, **extra):
    if not any(is_key(x) for x in jax.tree.leaves(state)):
      return update(updates, state, params, **extra)
    folded = jax.tree.map(lambda x: _fold(x, stage) if is_key(x) else x, state)
    out, new_state = update(updates, folded, params, **extra)
    _, plain = update(updates, state, params, **extra)
    new_state = jax.tree.map(
      lambda drawn, kept: kept if is_key(kept) else drawn, new_state, plain
    )
    return out, new_state

  return keyed_update


def _fold(keys, stage: int):
  """Each key of the array ``keys`` folded with ``stage``."""
  flat = jnp.reshape(keys, (-1,))
  folded = jax.vmap(lambda k: jax.random.fold_in(k, stage))(flat)
  return jnp.reshape(folded, jnp.shape(keys))
