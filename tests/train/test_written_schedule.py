"""Schedules through the training CLI: one written in a file, the V
schedules."""

import json
import os
import subprocess

import pytest

from configs import default as default_config
from jpipe.train import base_config, config_check, config_options
from jpipe.train.errors import UsageError
from tests.distributed.test_readme_commands import ROOT, _with, readme_command
from tests.train.test_train import _cli_env

STEPS = ["--config.train.steps=3", "--config.train.log_every=1"]


def _losses(workdir):
  with open(os.path.join(workdir, "metrics.jsonl")) as f:
    rows = [json.loads(line) for line in f]
  return [r["train/loss"] for r in rows if "train/loss" in r]


def _run(command):
  done = subprocess.run(
    command, capture_output=True, text=True, env=_cli_env(), cwd=ROOT
  )
  assert done.returncode == 0, done.stderr[-3000:]
  return done.stdout


@pytest.mark.slow
def test_the_readmes_written_schedule_trains_as_zbh1(tmp_path):
  """The README's command runs the shipped file: the same lists as the
  built-in zbh1, so the same losses step by step."""
  command = readme_command("--config.schedule.file=")
  written = _run(_with(command, tmp_path / "file", *STEPS))
  assert "schedule file:zbh1_4x4" in written
  base = [c for c in command if not c.startswith("--config.schedule.file")]
  _run(_with(base, tmp_path / "named", "--config.schedule.name=zbh1", *STEPS))
  assert _losses(tmp_path / "file") == _losses(tmp_path / "named")


def test_a_file_for_other_microbatches_or_a_bad_one_is_refused(tmp_path):
  config = base_config.base_config()
  config.data = base_config.image_data()
  config.schedule.file = os.path.join(ROOT, "configs/schedules/zbh1_4x4.txt")
  config.pipeline.num_microbatches = 8
  with pytest.raises(UsageError, match="written for 4 stages and 4 micro"):
    config_check.check(config)
  bad = tmp_path / "bad.txt"
  bad.write_text("0F0 0I0\n1F0 1I0 1W0\n")
  config.schedule.file = str(bad)
  with pytest.raises(UsageError, match=r"never runs 0W0"):
    config_check.check(config)
  config.schedule.file = str(tmp_path / "missing.txt")
  with pytest.raises(UsageError, match="No such file"):
    config_check.check(config)


@pytest.mark.slow
def test_the_readmes_zbv_command_trains_as_1f1b_on_the_same_stages(tmp_path):
  """The README's ZB-V command: 4 stages in a V on 2 devices, the same
  contiguous split as 1F1B's 4 stages on 4, so the same losses (to float
  rounding: the gradient sums' order differs)."""
  command = readme_command("--config.schedule.name=zbv")
  out = _run(_with(command, tmp_path / "zbv", *STEPS))
  assert "schedule zbv" in out
  assert "4 stages on devices [0, 1, 1, 0]" in out
  base = [c for c in command if not c.startswith("--config.schedule.name")]
  _run(_with(base, tmp_path / "1f1b", *STEPS))
  assert _losses(tmp_path / "zbv") == pytest.approx(
    _losses(tmp_path / "1f1b"), rel=1e-5
  )


def test_v_schedules_refuse_an_odd_stage_count_before_any_work():
  config = default_config.get_config()
  config.schedule.name = "zbv"
  config.pipeline.num_stages = 3
  with pytest.raises(UsageError, match="2 stages per device in a V"):
    config_check.check(config)
  config.schedule.name = "dualpipev"
  config.pipeline.num_stages = 8
  config.pipeline.num_microbatches = 4
  with pytest.raises(UsageError, match=r"dualpipev needs >= num_stages \(8\)"):
    config_check.check(config)


def test_split_flush_reaches_the_pipeline_and_only_for_streams():
  config = default_config.get_config()
  config.schedule.split_flush = True
  with pytest.raises(UsageError, match="split_flush splits the flush"):
    config_check.check(config)
  config.schedule.name = "async"
  config.pipeline.recompute = True
  config_check.check(config)
  assert config_options.staleness(config).split_flush


@pytest.mark.parametrize("name", ["interleaved", "zbh2", "interleaved_zb"])
def test_issue_63s_schedule_names_pass_the_config_checks(name):
  """A loop schedule with one stage a device is refused (it would run
  1f1b's or zbh1's order); with two it passes."""
  config = default_config.get_config()
  config.schedule.name = name
  if config_options.schedule_kind(config).loops:
    with pytest.raises(ValueError, match="loops stages over devices"):
      config_check.check(config)
    config.pipeline.num_stages = 4
    config.pipeline.stages_per_device = 2
  config_check.check(config)
  assert config_options.schedule_kind(config).name == name
