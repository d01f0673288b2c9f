"""Re-partitioning while training (DynPipe).

The pieces, each usable alone: ``Trigger`` (DynPipe's per-stage window
ratios against a reference), the re-partitioning rules (DynPipe's top-k
candidate cuts scored by its 1F1B simulation, ``dynpipe_split``; jpipe's
exact min-max split with slowed stage slots, ``jpipe_split``; scoring by
jpipe's event simulator, ``predicted_step_seconds``) and ``PlanSwitch``
(drain, move every bit of state by parameter path to the new plan's
pipeline, reusing pipelines of plans seen before); ``DynamicPipeline``
puts them together (watch one profiled step per window, decide, switch)
and ``Interference`` injects slowdowns (sleeps) for tests and experiments.
DynPipe's slowdown predictor (a random forest over per-stage features,
``SlowdownPredictor``) is fitted on stage times ``collect`` measures on
several splits with injected slowdowns; with it the planners take a
candidate stage's predicted slowdown (``minmax_split`` for jpipe's
exact split with range-dependent stage times).
"""

from jpipe.dynamic._controller import DynamicPipeline, Window, describe
from jpipe.dynamic._inject import Interference, Slowdown, parse_inject
from jpipe.dynamic._policies import (
  POLICIES,
  Decision,
  DynpipePolicy,
  JpipePolicy,
  Policy,
  make_policy,
)
from jpipe.dynamic._predictor import (
  NODE_FEATURES,
  STAGE_FEATURES,
  Measurements,
  SlowdownPredictor,
  collect,
  node_features,
  range_features,
)
from jpipe.dynamic._replan import (
  boundaries_of,
  candidate_cuts,
  dynpipe_score,
  dynpipe_split,
  jpipe_split,
  minmax_split,
  node_weights,
  predicted_step_seconds,
  stage_costs,
  stage_of_node,
)
from jpipe.dynamic._switch import PlanSwitch, Switch, plan_key
from jpipe.dynamic._trigger import Trigger, clamped_ratios, triggers

__all__ = [
  "NODE_FEATURES",
  "POLICIES",
  "STAGE_FEATURES",
  "Decision",
  "DynamicPipeline",
  "DynpipePolicy",
  "Interference",
  "JpipePolicy",
  "Measurements",
  "PlanSwitch",
  "Policy",
  "Slowdown",
  "SlowdownPredictor",
  "Switch",
  "Trigger",
  "Window",
  "boundaries_of",
  "candidate_cuts",
  "clamped_ratios",
  "collect",
  "describe",
  "dynpipe_score",
  "dynpipe_split",
  "jpipe_split",
  "make_policy",
  "minmax_split",
  "node_features",
  "node_weights",
  "parse_inject",
  "plan_key",
  "predicted_step_seconds",
  "range_features",
  "stage_costs",
  "stage_of_node",
  "triggers",
]
