"""HetPipe's parameter server, as SD-Pipe's baseline runs it.

Each pipeline steps its own replica of a stage locally and, every
``every`` batches (``batch_id % every == 0``) and at its last batch of an
epoch, pushes what it changed since its last pull, scaled by 1/P, to the
server and pulls the server's weights (HetPipe's wave synchronisation:
the server moves by the mean of the pipelines' updates). Pushes are
applied one at a time as they come: no pipeline waits for another.
"""

import threading

import jax
import numpy as np


def hetpipe_syncs(batch_id: int, every: int, last: bool) -> bool:
  """Whether the pipeline pushes and pulls after batch ``batch_id``."""
  return batch_id % every == 0 or last


def push_pull(server, params, base, num_pipelines: int):
  """The server after a push: ``server + (params - base) / P``, leaf by
  leaf (``base``: the weights of the pipeline's last pull)."""
  return jax.tree.map(
    lambda w, p, b: w + (p - b) / num_pipelines, server, params, base
  )


class ParameterServer:
  """One stage's server: its weights on ``device`` (the host's, in
  HetPipe), updated under a lock.

  Args:
    params: the initial weights (a tuple of arrays).
    num_pipelines: P (each push is scaled by 1 / P).
    device: where the server's weights live.
  """

  def __init__(self, params, num_pipelines: int, device):
    self.device = device
    self.num_pipelines = num_pipelines
    self.weights = jax.device_put(params, device)
    self.initial = self.weights
    self.lock = threading.Lock()
    self._push = jax.jit(push_pull, static_argnums=3)
    self.pushes = 0

  def initial_on(self, device):
    """The starting weights (every pipeline's first base) on ``device``."""
    return jax.device_put(self.initial, device)

  def push_pull(self, params, base, to_device):
    """Applies a pipeline's push; returns the server's weights on
    ``to_device`` (the pipeline's new weights and new base)."""
    params = jax.device_put(params, self.device)
    base = jax.device_put(base, self.device)
    with self.lock:
      self.weights = self._push(self.weights, params, base, self.num_pipelines)
      self.pushes += 1
      weights = self.weights
    return jax.device_put(weights, to_device)

  def initial_host(self) -> list:
    """The starting weights' leaves as host arrays (for another process)."""
    return [np.asarray(x) for x in jax.tree.leaves(self.initial)]

  def push_pull_host(self, params: list, base: list) -> list:
    """``push_pull`` with host arrays, leaves in order (from another
    process, through the hub); returns the server's leaves."""
    treedef = jax.tree.structure(self.weights)
    new = self.push_pull(
      jax.tree.unflatten(treedef, params),
      jax.tree.unflatten(treedef, base),
      self.device,
    )
    return [np.asarray(x) for x in jax.tree.leaves(new)]


def server_device():
  """The host's device for the servers (the CPU backend's first)."""
  try:
    return jax.devices("cpu")[0]
  except RuntimeError:  # No CPU backend registered.
    return jax.devices()[0]
