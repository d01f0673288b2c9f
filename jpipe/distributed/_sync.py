"""Cross-process operations, and the rule that keeps them from deadlocking.

A multi-process run has three kinds of cross-process operation:

- **transfers** between stages (``jpipe.runtime.Transport``): a value
  moves from the process of one stage to the process of another;
- **host exchanges** through the coordinator's key-value store
  (``barrier``, ``exchange``, ``agree``, ``text_from_process_zero``):
  small values (stop requests, decisions, plans, timings) that never touch
  a device;
- **device collectives** (``allgather``, ``broadcast``, and orbax's own
  ``sync_global_devices`` inside a checkpoint save): every process's
  devices run one program together, and each device waits in it until
  every process has joined.

The rule, followed by every loop in jpipe:

1. Every process issues the same cross-process operations in the same
   order. No branch on the process index decides whether one runs: what
   process 0 alone logs, evaluates or saves is first gathered by an
   operation every process issues at the same point of the loop.
2. A device collective runs only at a quiet point (``quiet``): every
   process has waited for everything it received, then all meet at a
   key-value barrier, so no transfer is in flight anywhere. A transfer in
   flight needs its sender's device; a device blocked in a collective
   that waits for the receiver never serves it, and both wait forever
   (process 1 entering ``process_allgather`` while process 0 pulls the
   step's loss from it hung the README's 2-process run). The functions
   here that run device collectives call ``quiet`` first, so a caller
   cannot forget it; what happens every step (the stop agreement) is a
   host exchange, which needs no quiet point.

A run that breaks the rule anyway (a bug, or a peer stuck in a library)
is stopped by the training loop's watchdog (``jpipe.train.watchdog``).

In one process every function here is a plain local operation.
"""

import os
import time
import weakref
from typing import Any

import jax
import numpy as np

# A host exchange waits this long for a peer (milliseconds): longer than
# any watchdog timeout, so a hung peer is reported by the watchdog, with
# every process's stack, rather than by a key-value timeout in one.
_WAIT_MS = 24 * 3600 * 1000


def client():
  """The ``jax.distributed`` client, or None in a one-process run."""
  from jax._src import distributed  # the client JAX's own tests use

  if jax.process_count() == 1:
    return None
  return distributed.global_state.client


_counts: dict[str, int] = {}  # uses per name: every process counts alike


def _next(name: str) -> int:
  _counts[name] = _counts.get(name, 0) + 1
  return _counts[name]


def barrier(name: str, timeout_s: float = 900.0) -> None:
  """Waits until every process has arrived (through the coordinator's
  key-value store, not a device collective: gloo gives up on a
  communicator's first collective when the processes reach it more than
  ~30 s apart, one still compiling or loading under load)."""
  c = client()
  if c is None:
    return
  n = _next("barrier/" + name)
  if _skipped_for_test(name):
    return
  c.wait_at_barrier(f"jpipe/{name}/{n}", int(timeout_s * 1e3))


class PeerTimeout(RuntimeError):
  """A process did not send its part of an exchange in time."""

  def __init__(self, name: str, process: int, timeout_s: float):
    super().__init__(
      f"process {process} sent nothing to exchange {name!r} within "
      f"{timeout_s:.0f} s"
    )
    self.process = process


def exchange(
  name: str, data: bytes, timeout_s: float | None = None
) -> list[bytes]:
  """Every process's ``data``, by process index (a host all-gather
  through the key-value store; every process calls it with the same
  ``name``, in the same order). ``timeout_s``: a PeerTimeout naming the
  first process that sent nothing by then (default: wait as long as any
  watchdog does)."""
  c = client()
  if c is None:
    return [data]
  n = _next("exchange/" + name)
  me = jax.process_index()
  if _skipped_for_test(name):  # (It counts the use, as the others do.)
    return [data] * jax.process_count()
  c.key_value_set_bytes(f"jpipe/x/{name}/{n}/{me}", data)
  deadline = None if timeout_s is None else time.monotonic() + timeout_s
  out = []
  for q in range(jax.process_count()):
    if q == me:
      out.append(data)
      continue
    wait_ms = _WAIT_MS
    if deadline is not None:
      wait_ms = max(int((deadline - time.monotonic()) * 1e3), 1)
    key = f"jpipe/x/{name}/{n}/{q}"
    try:
      out.append(c.blocking_key_value_get_bytes(key, wait_ms))
    except jax.errors.JaxRuntimeError as e:
      if deadline is None or "DEADLINE_EXCEEDED" not in str(e):
        raise
      raise PeerTimeout(name, q, timeout_s) from None
  # Every process set its key of use n after reading all of use n - 1:
  # nobody reads this process's key of n - 1 any more.
  if n > 1:
    c.key_value_delete(f"jpipe/x/{name}/{n - 1}/{me}")
  return out


def agree(name: str, value: int) -> int:
  """The largest of every process's ``value`` (an int), on every process:
  e.g. a stop request any process received, known to all."""
  got = exchange(name, str(int(value)).encode())
  return max(int(g) for g in got)


def text_from_process_zero(text: str) -> str:
  """Process 0's ``text`` on every process (e.g. a solved Plan, which a
  measured cost model may solve differently in each process)."""
  return exchange("text", text.encode())[0].decode()


def arrays_everywhere(name: str, array: np.ndarray) -> np.ndarray:
  """Every process's ``array`` (same shape and dtype everywhere), stacked
  by process index on a new axis 0; a host exchange, for small arrays
  (timings, counts): no device is involved."""
  array = np.ascontiguousarray(array)
  got = exchange(name, array.tobytes())
  return np.stack(
    [np.frombuffer(g, array.dtype).reshape(array.shape) for g in got]
  )


# Values this process received by transfer and not yet seen ready
# (weakly held: a consumed value is not kept alive for the next quiet point).
_received: list = []


def note_received(value) -> None:
  """Records a value a transfer is still delivering to this process: the
  next ``quiet`` waits for it."""
  if jax.process_count() == 1:
    return
  try:
    _received.append(weakref.ref(value))
  except TypeError:  # Not weakly referable: hold it until it is ready.
    _received.append(lambda value=value: value)
  if len(_received) > 256:  # Keep the list short on long runs.
    _received[:] = [r for r in _received if _pending(r())]


def _pending(value) -> bool:
  # (A value a program consumed -- donated -- has nothing left to wait for.)
  return value is not None and not value.is_deleted() and not value.is_ready()


def quiet(name: str) -> None:
  """A quiet point: returns when no transfer is in flight in any process
  (each waits for everything it received, then all meet at a barrier).
  Device collectives are safe after it (module docstring, rule 2)."""
  if client() is None:
    return
  values = [r() for r in _received]
  _received.clear()
  jax.block_until_ready([v for v in values if _pending(v)])
  barrier("quiet/" + name)


def allgather(tree) -> Any:
  """``multihost_utils.process_allgather`` of a pytree of host arrays
  (stacked by process on axis 0), at a quiet point."""
  from jax.experimental import multihost_utils

  quiet("allgather")
  return multihost_utils.process_allgather(tree)


def whole_arrays(arrays: list) -> list[np.ndarray]:
  """The whole value of each global array (sharded over devices of
  several processes: a caller's multi-host mesh) as a NumPy array on
  every process, gathered at a quiet point. Every process passes the
  same global arrays, in the same order."""
  from jax.experimental import multihost_utils

  quiet("whole_arrays")
  return list(multihost_utils.process_allgather(list(arrays), tiled=True))


def broadcast(tree, is_source: bool) -> Any:
  """``multihost_utils.broadcast_one_to_all`` of a pytree of host arrays
  from the process where ``is_source``, at a quiet point."""
  from jax.experimental import multihost_utils

  quiet("broadcast")
  return multihost_utils.broadcast_one_to_all(tree, is_source=is_source)


def host_address() -> str:
  """This host's address for servers other processes reach: the
  coordinator's interface when it is this host's loopback, else the host
  name's."""
  import socket

  coordinator = os.environ.get("JAX_COORDINATOR_ADDRESS", "")
  if coordinator.startswith(("127.", "localhost")):
    return "127.0.0.1"
  return socket.gethostbyname(socket.gethostname())


# Tests only: ``JPIPE_TEST_SKIP=NAME:PROCESS:USE`` makes process PROCESS
# skip use USE (1-based) of the host exchange or barrier NAME (it goes on
# as if the others had taken part), breaking rule 1 on purpose to show
# that the watchdog stops such a run.
_skip_seen: dict[str, int] = {}


def _skipped_for_test(name: str) -> bool:
  spec = os.environ.get("JPIPE_TEST_SKIP")
  if not spec:
    return False
  what, process, use = spec.rsplit(":", 2)
  if what != name or int(process) != jax.process_index():
    return False
  _skip_seen[name] = _skip_seen.get(name, 0) + 1
  return _skip_seen[name] == int(use)
