"""Staleness mitigation for asynchronous pipelines, as optax pieces.

Depends on jax and optax only, so any training loop can import it:
weight prediction (closed form and replay), Gap-Aware, and weight stashing.
"""

from jpipe.staleness._common import (
  OPTIMIZERS,
  check_state_matches,
  step_count,
)
from jpipe.staleness._gap_aware import GapAwareState, gap_aware
from jpipe.staleness._replay_prediction import replay_predictor
from jpipe.staleness._weight_prediction import (
  Predictor,
  nag_delay,
  schedule_lookahead,
  weight_predictor,
)
from jpipe.staleness._weight_stash import (
  WeightStash,
  stash_get,
  stash_holds,
  stash_init,
  stash_nbytes,
  stash_put,
  stash_slots_for_delay,
)

__all__ = [
  "OPTIMIZERS",
  "GapAwareState",
  "Predictor",
  "WeightStash",
  "check_state_matches",
  "gap_aware",
  "nag_delay",
  "replay_predictor",
  "schedule_lookahead",
  "stash_get",
  "stash_holds",
  "stash_init",
  "stash_nbytes",
  "stash_put",
  "stash_slots_for_delay",
  "step_count",
  "weight_predictor",
]
