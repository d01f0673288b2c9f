"""Staleness mitigation for asynchronous pipelines, as optax pieces.

Depends on jax and optax only, so any training loop can import it:
weight prediction (closed form and replay), Gap-Aware, weight stashing,
PipeMare's learning-rate rescheduling and the delay-aware Nesterov method.
"""

from jpipe.staleness._common import (
  OPTIMIZERS,
  check_state_matches,
  step_count,
)
from jpipe.staleness._gap_aware import GapAwareState, gap_aware
from jpipe.staleness._nesterov import (
  NESTEROV_MOMENTUM,
  ScaleByNadamState,
  adaptive_momentum,
  delay_aware_nesterov,
  nadamw,
  scale_by_nadam,
)
from jpipe.staleness._pipemare import (
  PipeMareState,
  pipemare_factor,
  pipemare_learning_rate,
)
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
  "NESTEROV_MOMENTUM",
  "OPTIMIZERS",
  "GapAwareState",
  "PipeMareState",
  "Predictor",
  "ScaleByNadamState",
  "WeightStash",
  "adaptive_momentum",
  "check_state_matches",
  "delay_aware_nesterov",
  "gap_aware",
  "nadamw",
  "nag_delay",
  "pipemare_factor",
  "pipemare_learning_rate",
  "replay_predictor",
  "scale_by_nadam",
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
