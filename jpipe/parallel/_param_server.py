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
  """One stage's server: its weights in host memory (HetPipe's server is
  on a CPU), updated with NumPy under a lock. Never on a device: on the
  CPU backend one computation waiting for another process's transfer
  holds up every device of its process (measured: 3.08 s behind a pull
  that came 3 s late), so a push computed on a device could wait for a
  pipeline that is itself waiting for this push.

  Args:
    params: the initial weights (a tuple of arrays, host or device).
    num_pipelines: P (each push is scaled by 1 / P).
  """

  def __init__(self, params, num_pipelines: int):
    self.num_pipelines = num_pipelines
    self.weights = jax.tree.map(np.asarray, params)
    self.initial = self.weights
    self.lock = threading.Lock()
    self.pushes = 0

  def initial_host(self) -> list:
    """The starting weights' leaves (every pipeline's first base)."""
    return list(jax.tree.leaves(self.initial))

  def push_pull_host(self, params: list, base: list) -> list:
    """Applies a pipeline's push -- its leaves, in order, as host arrays,
    and those of its last pull (``base``) -- and returns the server's
    new leaves (the pipeline's new weights and new base). Called in this
    process or, through the hub, from another."""
    treedef = jax.tree.structure(self.weights)
    params = jax.tree.unflatten(treedef, [np.asarray(x) for x in params])
    base = jax.tree.unflatten(treedef, [np.asarray(x) for x in base])
    with self.lock:
      self.weights = push_pull(self.weights, params, base, self.num_pipelines)
      self.pushes += 1
      return list(jax.tree.leaves(self.weights))
