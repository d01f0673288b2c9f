"""Weight stash ring against a plain dict of versions."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jpipe import staleness


def _params(value):
  return {
    "w": jnp.full((2, 3), value, jnp.float32),
    "b": jnp.full((3,), value, jnp.bfloat16),
  }


@pytest.mark.parametrize("delay", [0, 1, 3])
def test_ring_matches_in_flight_dict(delay):
  """1F1B at a stage of delay d: F(b) stashes, B(b - d) reads back."""
  slots = staleness.stash_slots_for_delay(delay)
  stash = staleness.stash_init(_params(-1.0), slots)
  put = jax.jit(staleness.stash_put, donate_argnums=0)
  in_flight = {}
  for b in range(12):
    version = _params(float(b))
    stash = put(stash, b, version)
    in_flight[b] = version
    done = b - delay
    if done >= 0:
      assert bool(staleness.stash_holds(stash, done))
      got = staleness.stash_get(stash, done)
      jax.tree.map(np.testing.assert_array_equal, got, in_flight.pop(done))
  assert len(in_flight) == delay


def test_byte_count_is_d_plus_one_versions():
  params = _params(0.0)
  one = 6 * 4 + 3 * 2
  for delay in (0, 2, 5):
    stash = staleness.stash_init(params, staleness.stash_slots_for_delay(delay))
    assert staleness.stash_nbytes(stash) == (delay + 1) * one


def test_traced_ids_and_empty_slots():
  stash = staleness.stash_init(_params(0.0), 3)
  assert not bool(staleness.stash_holds(stash, 0))
  stash = jax.jit(staleness.stash_put)(stash, jnp.int32(4), _params(4.0))
  assert bool(jax.jit(staleness.stash_holds)(stash, jnp.int32(4)))
  assert not bool(staleness.stash_holds(stash, 1))  # same slot, other owner
  got = jax.jit(staleness.stash_get)(stash, jnp.int32(4))
  assert got["b"].dtype == jnp.bfloat16
  np.testing.assert_array_equal(got["w"], 4.0)


def test_bad_sizes_raise():
  with pytest.raises(ValueError, match="num_slots must be >= 1"):
    staleness.stash_init(_params(0.0), 0)
  for delay in (-1, 2.5, "3"):  # (2.5 gave 3.5 slots.)
    with pytest.raises(ValueError, match="delay must be an integer >= 0"):
      staleness.stash_slots_for_delay(delay)


def test_a_slot_another_microbatch_took_is_an_error_where_ids_are_concrete():
  """Too few slots for the delay: reading microbatch 1 after microbatch 4
  took its slot (of 3) raises instead of returning 4's params; before
  any put, a slot reads as the initial params."""
  stash = staleness.stash_init(_params(0.0), 3)
  np.testing.assert_array_equal(staleness.stash_get(stash, 1)["w"], 0.0)
  stash = staleness.stash_put(stash, 1, _params(1.0))
  stash = staleness.stash_put(stash, 4, _params(4.0))
  with pytest.raises(
    ValueError, match="microbatch 1's slot holds microbatch 4"
  ):
    staleness.stash_get(stash, 1)
