"""Where a sync policy's shared objects live: this process, or process 0.

The partial-reduce schedulers, the epoch's end, the roster of averaging
meetings and HetPipe's servers are shared by every pipeline. In one
process they are plain objects (``LocalHub``). Across processes (one or
more pipelines per process) process 0 holds them and serves their public
methods over an authenticated socket (``multiprocessing.connection``,
``ServingHub``); the other processes call them through proxies
(``RemoteHub``), like SD-Pipe's workers call its ps-lite scheduler. The
address and key travel through jax.distributed's key-value store. Each
calling thread has its own connection, so one thread's blocking call (a
scheduler's ``get_group``) holds nobody else's.

Only small values cross (ranks, batch ids, groups; HetPipe's host
arrays): the averaging itself is a collective over the group's devices.
"""

import itertools
import json
import os
import threading
import traceback
from multiprocessing.connection import Client, Listener
from typing import Any

import jax

from jpipe.distributed import host_address

_TIMEOUT_MS = 300_000  # Waiting for process 0 to publish its address.


def _kv_client():
  from jax._src import distributed  # the client JAX's own tests use

  return distributed.global_state.client


class LocalHub:
  """Every pipeline in this process: shared objects are plain objects."""

  owner = True  # This process holds the objects (resets them).

  def share(self, name: str, factory):
    del name
    return factory()

  def barrier(self, name: str) -> None:
    del name

  def all_gather(self, name: str, value: Any) -> list[Any]:
    """Every process's ``value`` (JSON-able), by process index."""
    del name
    return [value]

  def close(self) -> None:
    pass


class _ProcessesHub:
  """The key-value store part shared by both sides across processes."""

  _runs = itertools.count()  # Hubs made so far: every process counts alike.

  def __init__(self):
    self.client = _kv_client()
    if self.client is None:
      raise RuntimeError(
        "several processes but no jax.distributed client: call "
        "jpipe.distributed.initialize() first"
      )
    self.prefix = f"jpipe/hub/{next(self._runs)}"
    self._counts: dict[str, int] = {}

  def _key(self, name):
    self._counts[name] = self._counts.get(name, 0) + 1
    return f"{self.prefix}/{name}/{self._counts[name]}"

  def barrier(self, name: str) -> None:
    """Every process arrives before any goes on."""
    self.client.wait_at_barrier(self._key("barrier/" + name), _TIMEOUT_MS)

  def all_gather(self, name: str, value: Any) -> list[Any]:
    key = self._key("gather/" + name)
    self.client.key_value_set(f"{key}/{jax.process_index()}", json.dumps(value))
    return [
      json.loads(self.client.blocking_key_value_get(f"{key}/{q}", _TIMEOUT_MS))
      for q in range(jax.process_count())
    ]


class ServingHub(_ProcessesHub):
  """Process 0: holds the shared objects and serves their methods."""

  owner = True

  def __init__(self):
    super().__init__()
    self.objects: dict[str, Any] = {}
    self._registered = threading.Condition()
    authkey = os.urandom(32)
    self.listener = Listener((host_address(), 0), authkey=authkey)
    host, port = self.listener.address
    self.client.key_value_set(
      f"{self.prefix}/address",
      json.dumps({"host": host, "port": port, "key": authkey.hex()}),
    )
    self._closed = False
    threading.Thread(target=self._accept, daemon=True, name="hub").start()

  def share(self, name: str, factory):
    obj = factory()
    with self._registered:
      self.objects[name] = obj  # A later share of a name replaces it.
      self._registered.notify_all()
    return obj

  def _accept(self):
    while not self._closed:
      try:
        conn = self.listener.accept()
      except (OSError, EOFError):
        return  # Closed, or a caller that failed its handshake.
      threading.Thread(
        target=self._serve, args=(conn,), daemon=True, name="hub-caller"
      ).start()

  def _serve(self, conn):
    while True:
      try:
        name, method, args = conn.recv()
      except (EOFError, OSError):
        return  # The caller's thread or process ended.
      try:
        with self._registered:
          # Another process may call before this one has built its policy.
          self._registered.wait_for(lambda n=name: n in self.objects, 300)
        if method.startswith("_") or name not in self.objects:
          raise AttributeError(f"the hub serves no {name}.{method}")
        reply = ("ok", getattr(self.objects[name], method)(*args))
      except Exception as e:  # The caller re-raises it.
        reply = ("error", f"{type(e).__name__}: {e}\n{traceback.format_exc()}")
      try:
        conn.send(reply)
      except (EOFError, OSError):
        return

  def close(self):
    self._closed = True
    self.listener.close()


class RemoteHub(_ProcessesHub):
  """Processes 1 .. N-1: proxies of process 0's shared objects."""

  owner = False

  def __init__(self):
    super().__init__()
    address = json.loads(
      self.client.blocking_key_value_get(f"{self.prefix}/address", _TIMEOUT_MS)
    )
    self.address = (address["host"], address["port"])
    self.authkey = bytes.fromhex(address["key"])
    self._local = threading.local()

  def share(self, name: str, factory):
    del factory  # Process 0 builds it.
    return _Proxy(self, name)

  def call(self, name: str, method: str, args: tuple):
    conn = getattr(self._local, "conn", None)
    if conn is None:
      conn = self._local.conn = Client(self.address, authkey=self.authkey)
    conn.send((name, method, args))
    status, value = conn.recv()
    if status == "error":
      raise RuntimeError(f"process 0's {name}.{method} failed: {value}")
    return value

  def close(self):
    pass


class _Proxy:
  """Calls of ``name``'s methods, answered by process 0."""

  def __init__(self, hub: RemoteHub, name: str):
    self._hub = hub
    self._name = name

  def __getattr__(self, method):
    if method.startswith("_"):
      raise AttributeError(method)
    return lambda *args: self._hub.call(self._name, method, args)


def make_hub():
  """The hub for this run: local in one process, else served by process 0."""
  if jax.process_count() == 1:
    return LocalHub()
  return ServingHub() if jax.process_index() == 0 else RemoteHub()
