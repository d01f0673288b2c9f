"""The processes' synchronisation in one process: every call is what one
process of a run would see -- its own value, returned at once, with no
coordinator (the multi-process runs of the slow tier check the rest)."""

import jax
import numpy as np
import pytest

from jpipe import distributed


def test_one_process_has_no_coordinator_and_waits_for_nobody():
  assert jax.process_count() == 1 and distributed.client() is None
  distributed.barrier("test")  # Returns: nobody else to wait for.
  distributed.quiet("test")
  distributed.note_received(jax.numpy.ones(3))  # Nothing to wait for.


def test_host_exchanges_return_this_process_alone():
  assert distributed.exchange("test", b"abc") == [b"abc"]
  assert distributed.agree("test", 3) == 3
  assert distributed.text_from_process_zero("plan") == "plan"
  x = np.arange(6, dtype=np.float32).reshape(2, 3)
  got = distributed.arrays_everywhere("test", x)
  assert got.shape == (1, 2, 3) and got.dtype == np.float32
  np.testing.assert_array_equal(got[0], x)


def test_device_collectives_of_one_process():
  tree = {"a": np.arange(4.0), "b": np.int32(7)}
  gathered = distributed.allgather(tree)  # Stacked by process: one.
  assert gathered["a"].shape == (1, 4) and gathered["b"].shape == (1,)
  np.testing.assert_array_equal(gathered["a"][0], tree["a"])
  assert int(gathered["b"][0]) == 7
  sent = distributed.broadcast(tree, is_source=True)
  np.testing.assert_array_equal(sent["a"], tree["a"])
  assert int(sent["b"]) == 7


@pytest.mark.parametrize(
  "coordinator, loopback",
  [("127.0.0.1:1234", True), ("localhost:99", True), ("", False)],
)
def test_host_address_follows_the_coordinator(
  monkeypatch, coordinator, loopback
):
  """Servers other processes reach listen on the loopback when the
  coordinator is this host's loopback, else on the host name's address."""
  monkeypatch.setenv("JAX_COORDINATOR_ADDRESS", coordinator)
  address = distributed.host_address()
  if loopback:
    assert address == "127.0.0.1"
  else:
    import socket

    assert address == socket.gethostbyname(socket.gethostname())
