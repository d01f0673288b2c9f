"""AD-PSGD's random pairwise gossip, as SD-Pipe's baseline runs it.

Every worker of a stage shuffles the same worker list with a shared RNG
(seed 0 in SD-Pipe) once per round and pairs neighbours ``(2i, 2i+1)``:
all workers agree on the pairs with no message. A round pairs every
worker, so a slow worker stalls its partner of that round (the cost
partial reduce avoids). SD-Pipe needs an even number of workers.
"""

from collections.abc import Sequence

import numpy as np


class GossipPairs:
  """The pairs of each gossip round.

  Args:
    num_workers: the stage's replicas (even).
    seed: the shared shuffle seed.
  """

  def __init__(self, num_workers: int, seed: int | Sequence[int] = 0):
    if num_workers < 2 or num_workers % 2:
      raise ValueError(
        f"AD-PSGD pairs workers: it needs an even number of pipelines "
        f"(>= 2), got {num_workers}; use sync='preduce' for an odd count"
      )
    self.n = num_workers
    self._rng = np.random.default_rng(seed)
    self._rounds: list[tuple[tuple[int, int], ...]] = []

  def pairs(self, round_index: int) -> tuple[tuple[int, int], ...]:
    """The sorted pairs of round ``round_index`` (rounds count from 0;
    the shuffles are drawn in round order, whatever order they are asked
    in)."""
    while len(self._rounds) <= round_index:
      order = self._rng.permutation(self.n)
      self._rounds.append(
        tuple(
          tuple(sorted((int(order[i]), int(order[i + 1]))))
          for i in range(0, self.n, 2)
        )
      )
    return self._rounds[round_index]

  def partner_group(self, rank: int, round_index: int) -> tuple[int, int]:
    """``rank``'s pair in that round."""
    for pair in self.pairs(round_index):
      if rank in pair:
        return pair
    raise ValueError(f"worker {rank} is not one of {self.n}")
