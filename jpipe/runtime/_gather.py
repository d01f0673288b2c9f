"""Bringing per-stage state to every process (gather, state dicts, plans).

In one process a stage's arrays are simply fetched to the host. Across
processes each stage's arrays live only in the process that runs it:
``trees_everywhere`` broadcasts them from there to every process
(``multihost_utils.broadcast_one_to_all``: every process calls it, in the
same order, for every stage). It is for checkpoints and evaluation, not
for every step: it blocks until the arrays are ready and copies them to
every host.
"""

import os
import socket
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np
from jax.experimental import multihost_utils


def trees_everywhere(trees: Sequence[Any], templates, held: Sequence[bool]):
  """Pytrees that each live in one process, as host arrays on every
  process. Every process calls it with the same templates.

  Args:
    trees: each pytree where this process holds it (else None).
    templates: each pytree's shapes and dtypes (anything with ``.shape``
      / ``.dtype`` leaves; used where another process holds it).
    held: per pytree, whether this process holds it (exactly one process
      does). A process that holds them all (one process, or a pipeline
      of its own among several processes' pipelines, as in data parallel)
      only fetches them: no other process takes part.
  """
  if jax.process_count() == 1 or all(held):
    return [jax.device_get(t) for t in trees]
  out = []
  for tree, template, here in zip(trees, templates, held, strict=True):
    if here:
      local = jax.device_get(tree)
    else:
      local = jax.tree.map(lambda a: np.zeros(a.shape, a.dtype), template)
    out.append(_broadcast(local, here))
  return out


def _broadcast(tree, is_source):
  """``broadcast_one_to_all`` (a sum with zeros elsewhere): booleans go
  as integers."""
  bools = jax.tree.map(lambda x: np.asarray(x).dtype == bool, tree)
  tree = jax.tree.map(
    lambda x, b: np.asarray(x, np.uint8) if b else np.asarray(x), tree, bools
  )
  out = multihost_utils.broadcast_one_to_all(tree, is_source=is_source)
  return jax.tree.map(lambda x, b: x.astype(bool) if b else x, out, bools)


def wait_for_all(name: str, timeout_s: float = 900.0) -> None:
  """A barrier through the coordinator's key-value store, not a device
  collective: gloo gives up on a communicator's first collective when the
  processes reach it more than ~30 s apart (one still compiling or
  loading under load), so every process arrives first."""
  from jax._src import distributed  # the client JAX's own tests use

  client = distributed.global_state.client
  if client is None or jax.process_count() == 1:
    return
  _barriers[name] = _barriers.get(name, 0) + 1
  client.wait_at_barrier(
    f"jpipe/{name}/{_barriers[name]}", int(timeout_s * 1e3)
  )


_barriers: dict[str, int] = {}  # uses per name: every process counts alike


def text_from_process_zero(text: str) -> str:
  """Process 0's ``text`` on every process (e.g. a solved Plan, which a
  measured cost model may solve differently in each process)."""
  if jax.process_count() == 1:
    return text
  wait_for_all("plan")
  data = np.frombuffer(text.encode(), np.uint8)
  size = multihost_utils.broadcast_one_to_all(np.int64(data.size))
  padded = np.zeros(int(size), np.uint8)
  if jax.process_index() == 0:
    padded[:] = data
  padded = multihost_utils.broadcast_one_to_all(padded)
  return bytes(np.asarray(padded, np.uint8)).decode()


def host_address() -> str:
  """This host's address for servers other processes reach: the
  coordinator's interface when it is this host's loopback, else the host
  name's."""
  coordinator = os.environ.get("JAX_COORDINATOR_ADDRESS", "")
  if coordinator.startswith(("127.", "localhost")):
    return "127.0.0.1"
  return socket.gethostbyname(socket.gethostname())
