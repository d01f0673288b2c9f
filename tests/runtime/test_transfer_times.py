"""jpipe.runtime.TransferTimes: stamps of transfer ends, taken by watcher
threads the caller never waits for."""

import time

import jax
import jax.numpy as jnp

from jpipe.runtime import TransferTimes


def test_stamps_each_value_once_ready_and_stops_when_closed():
  times = TransferTimes()
  slow = jax.jit(lambda x: jnp.tanh(x @ x) @ x)
  x = jnp.ones((256, 256)) * 1e-3
  before = time.perf_counter()
  a = slow(x)
  times.offered(1, [a])
  b = slow(a)
  times.pulled(2, [b])
  events = times.close()
  after = time.perf_counter()
  got = {(what, uuid): t for what, uuid, t in events}
  assert set(got) == {(w, 1) for w in ("offer", "ready")} | {
    (w, 2) for w in ("pull", "arrived")
  }
  assert before <= got[("offer", 1)] <= got[("ready", 1)] <= after
  assert before <= got[("pull", 2)] <= got[("arrived", 2)] <= after
  times.offered(3, [a])  # closed: not stamped
  assert len(times.events) == 4
