"""The CLI's learning-rate schedules against their formulas."""

import math

import pytest

from configs import default as default_config
from jpipe.train import config_check, run, train_lib
from jpipe.train.errors import UsageError


def _config(schedule, steps=100, warmup=10, **options):
  config = default_config.get_config()
  config.optimizer.schedule = schedule
  config.optimizer.learning_rate = 0.4
  config.optimizer.warmup_steps = warmup
  config.train.steps = steps
  for key, value in options.items():
    config.optimizer[key] = value
  config_check.check(config)
  assert run.steps_per_call(config) == 1  # Optimizer steps = train steps.
  return config


def _formula(schedule, step, peak=0.4, warmup=10, total=100):
  """Each schedule restated (per optimizer step)."""
  if schedule == "warmup_linear":  # BERT
    if step < warmup:
      return peak * step / warmup
    return peak * max(total - step, 0) / (total - warmup)
  if schedule == "warmup_constant":  # FTPipe's T5-3B
    return peak * min(step / warmup, 1.0)
  if schedule == "rsqrt":  # T5
    return peak * math.sqrt(warmup / max(step, warmup))
  if schedule == "multistep":  # WRN: x0.2 at 30, 60, 80
    return peak * 0.2 ** sum(step >= b for b in (30, 60, 80))
  if schedule == "warmup_multistep":  # Goyal et al.: up, then the steps
    up = min(step / warmup, 1.0) if warmup else 1.0
    return peak * up * 0.2 ** sum(step >= b for b in (30, 60, 80))
  raise AssertionError(schedule)


@pytest.mark.parametrize(
  "schedule", ["warmup_linear", "warmup_constant", "rsqrt", "multistep"]
)
def test_each_schedule_is_its_formula(schedule):
  options = {}
  warmup = 10
  if schedule == "multistep":
    options = {"decay_steps": "30,60,80", "decay_factor": 0.2}
    warmup = 0
  lr = train_lib.learning_rate(_config(schedule, warmup=warmup, **options))
  for step in (0, 1, 5, 9, 10, 11, 29, 30, 31, 59, 60, 79, 80, 99, 100):
    assert float(lr(step)) == pytest.approx(
      _formula(schedule, step), rel=1e-5, abs=1e-7
    ), step
  # Properties: never above the peak, never below 0.
  values = [float(lr(s)) for s in range(120)]
  assert max(values) <= 0.4 + 1e-7 and min(values) >= 0


def test_multistep_with_a_warm_up_is_its_formula():
  options = {"decay_steps": "30,60,80", "decay_factor": 0.2}
  lr = train_lib.learning_rate(_config("multistep", warmup=10, **options))
  for step in (0, 1, 5, 9, 10, 11, 29, 30, 31, 59, 60, 79, 80, 99, 100):
    assert float(lr(step)) == pytest.approx(
      _formula("warmup_multistep", step), rel=1e-5, abs=1e-7
    ), step


@pytest.mark.parametrize(
  "schedule, options, match",
  [
    ("multistep", {}, "multistep needs rising optimizer steps"),
    ("multistep", {"decay_steps": "60,30"}, "rising"),
    ("constant", {"decay_steps": "30"}, "applies to optimizer.schedule"),
    ("constant", {"warmup_steps": 5}, "no effect"),
    ("multistep", {"decay_steps": "5,30", "warmup_steps": 5}, "inside the"),
  ],
)
def test_bad_schedule_options_are_one_line(schedule, options, match):
  config = default_config.get_config()
  config.optimizer.schedule = schedule
  for key, value in options.items():
    config.optimizer[key] = value
  with pytest.raises(UsageError, match=match):
    config_check.check(config)


@pytest.mark.slow
def test_a_run_trains_with_multistep(tmp_path):
  from tests.train.test_train import _config as small

  config = small(
    **{
      "optimizer.schedule": "multistep",
      "optimizer.decay_steps": "2,4",
      "optimizer.decay_factor": 0.5,
    }
  )
  train_lib.train_and_evaluate(config, str(tmp_path))
  rows = train_lib.read_metrics(str(tmp_path))
  losses = [r["train/loss"] for r in rows if "train/loss" in r]
  assert len(losses) == 6 and all(math.isfinite(x) for x in losses)
