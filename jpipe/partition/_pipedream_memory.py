"""PipeDream's memory model of a replicated pipeline, per stage.

PipeDream's optimizer (``optimizer_graph_hierarchical.py``, with
``--use_memory_constraint``) charges a stage of states k+1..j whose m'
replicas are the last of the m+1 machines used so far

  ``ceil((M - (m + 1)) / m') * (act[k+1..j] + par[k+1..j])``

bytes per replica (spec: pipedream_dynpipe_sdpipe.md, A2): one stashed
copy of the stage's activations and params per minibatch still to come
back from the M - (m + 1) machines after it, shared by its replicas.
Nothing else: no gradients, no optimizer state, no working memory, and
the last stage (no machines after it) holds nothing. Without
``--use_memory_constraint`` (its default) the model plays no part.
"""

from collections.abc import Sequence

import numpy as np


def pipedream_stage_memory(
  activation_bytes: np.ndarray,
  parameter_bytes: np.ndarray,
  stage_of_node: Sequence[int],
  replicas: Sequence[int],
) -> np.ndarray:
  """Per stage, the bytes PipeDream's optimizer charges each replica.

  Args:
    activation_bytes: each node's activation bytes (a profile's
      ``activation_size``; a traced model's outputs read by other nodes),
      float [num_nodes].
    parameter_bytes: each node's parameter bytes, float [num_nodes].
    stage_of_node: each node's stage (0..S-1).
    replicas: machines of each stage, consecutive in stage order [S];
      their sum is M.

  Returns:
    float64 [S]: ``ceil((M - C_s) / r_s) * (act_s + par_s)`` with C_s the
    machines of stages 0..s.
  """
  stage_of = np.asarray(stage_of_node)
  r = np.asarray(replicas, np.int64)
  if stage_of.size and (stage_of.min() < 0 or stage_of.max() >= r.size):
    raise ValueError(
      f"stage_of_node names stages outside 0..{r.size - 1}: give one "
      "replica count per stage"
    )
  if r.size == 0 or r.min() < 1:
    raise ValueError(f"replicas {tuple(replicas)}: at least 1 per stage")
  held = np.bincount(
    stage_of,
    np.asarray(activation_bytes, np.float64)
    + np.asarray(parameter_bytes, np.float64),
    minlength=r.size,
  )
  after = r.sum() - np.cumsum(r)  # Machines after stage s.
  return -(-after // r) * held
