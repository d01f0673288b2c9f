"""Which staleness options make sense together (clear errors otherwise)."""

PREDICTIONS = (None, "msnag", "aggmsnag")
GAP_AWARE = (None, "ga", "ga_jfl")
# FTPipe's stage policies for Gap-Aware, by stage depth (n - 1 - s).
GAP_AWARE_POLICIES = {
  "all_except_last": lambda depth: depth != 0,
  "almost_last_partition": lambda depth: depth == 1,
  "all_except_last_two": lambda depth: depth >= 2,
}


def check_staleness_options(
  schedule,
  *,
  recompute,
  step_every,
  weight_stashing,
  prediction,
  gap_aware,
  gap_aware_options,
  gap_aware_policy,
):
  """Clear errors for option combinations the semantics do not define."""
  if prediction not in PREDICTIONS:
    raise ValueError(f"unknown prediction {prediction!r}: one of {PREDICTIONS}")
  if gap_aware not in GAP_AWARE:
    raise ValueError(f"unknown gap_aware {gap_aware!r}: one of {GAP_AWARE}")
  if gap_aware_policy not in GAP_AWARE_POLICIES:
    raise ValueError(
      f"unknown gap_aware_policy {gap_aware_policy!r}: one of "
      f"{tuple(GAP_AWARE_POLICIES)}"
    )
  if step_every < 1:
    raise ValueError(f"step_every must be >= 1, got {step_every}")
  mitigations = {
    "weight_stashing": weight_stashing,
    "prediction": prediction,
    "gap_aware": gap_aware,
  }
  if schedule != "async":
    used = [k for k, v in mitigations.items() if v]
    if used:
      raise ValueError(
        f"{used} apply to the asynchronous schedule 'async'; {schedule!r} "
        f"has no stale gradients to mitigate"
      )
    if step_every != 1 and schedule != "2bw":
      raise ValueError(
        f"step_every applies to 'async' and '2bw' (got schedule "
        f"{schedule!r}); synchronous schedules step once per call"
      )
  if schedule == "2bw" and step_every == 1:
    raise ValueError(
      "2bw needs step_every = microbatches per minibatch (>= num_stages)"
    )
  if gap_aware is not None:
    if not gap_aware_options or "optimizer" not in gap_aware_options:
      raise ValueError(
        "gap_aware needs gap_aware_options with at least 'optimizer' "
        "('sgd', 'adam' or 'adamw') and the learning rate, e.g. "
        "{'optimizer': 'sgd', 'learning_rate': 0.1}"
      )
    if step_every != 1:
      raise ValueError(
        f"gap_aware needs step_every=1 (FTPipe), got {step_every}: a step "
        "then applies one microbatch whose forward params define the gap"
      )
  if gap_aware == "ga_jfl" and not recompute:
    raise ValueError(
      "gap_aware='ga_jfl' recomputes the backward at the current params; "
      "without recomputation the saved residuals pin the forward's params: "
      "use recompute=True or gap_aware='ga'"
    )
  if schedule == "async" and not weight_stashing and not recompute:
    raise ValueError(
      "an asynchronous pipeline without weight stashing needs "
      "recompute=True: without recomputation every backward "
      "differentiates at its forward's params (its saved residuals pin "
      "them), which IS weight stashing, so stale, prediction-only and "
      "Gap-Aware-only runs would silently be stashing runs; pass "
      "recompute=True, or weight_stashing=True to ask for stashing"
    )
