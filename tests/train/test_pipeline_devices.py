"""Across processes a pipeline's stages take devices of every process
(issue 68: with 2 processes of 2 devices, 2 stages both went to process
0's devices and process 1 failed with a KeyError)."""

import types

import pytest

from jpipe.train import base_config, config_options
from jpipe.train.errors import UsageError


def _devices(processes, per_process):
  return [
    types.SimpleNamespace(id=p * per_process + i, process_index=p)
    for p in range(processes)
    for i in range(per_process)
  ]


def _config(stages, partition="contiguous", schedule="1f1b"):
  config = base_config.base_config()
  config.pipeline.num_stages = stages
  config.pipeline.partition = partition
  config.schedule.name = schedule
  return config


def _processes(devices):
  return [d.process_index for d in devices]


@pytest.mark.parametrize(
  "processes, per_process, stages, expected",
  [
    (2, 2, 2, [0, 1]),  # One stage per process (was [0, 0]).
    (2, 2, 3, [0, 0, 1]),
    (4, 2, 5, [0, 0, 1, 2, 3]),
    (2, 2, 4, [0, 0, 1, 1]),  # Every device: as they are.
    (1, 8, 3, [0] * 8),  # One process: as they are.
  ],
)
def test_every_process_runs_stages(processes, per_process, stages, expected):
  devices = _devices(processes, per_process)
  chosen = config_options.pipeline_devices(_config(stages), devices)
  assert _processes(chosen) == expected
  # Each process's first devices, in order.
  for p in set(expected):
    mine = [d.id for d in chosen if d.process_index == p]
    assert mine == [d.id for d in devices if d.process_index == p][: len(mine)]


def test_plans_that_use_every_device_keep_them_all():
  devices = _devices(2, 4)
  for partition in ("mixed", "pipedream_hybrid"):
    chosen = config_options.pipeline_devices(_config(2, partition), devices)
    assert chosen == devices


def test_a_v_schedule_needs_half_the_devices():
  chosen = config_options.pipeline_devices(
    _config(4, schedule="zbv"), _devices(2, 4)
  )
  assert _processes(chosen) == [0, 1]


def test_fewer_stages_than_processes_is_one_line():
  with pytest.raises(UsageError, match="each of the 4 processes a stage"):
    config_options.pipeline_devices(_config(2), _devices(4, 1))


def test_a_process_holding_no_stage_is_named(monkeypatch):
  """3 processes of 2 devices for 4 stages: process 2 idled, unsaid."""
  from jpipe.train import pipeline_mode

  monkeypatch.setattr(pipeline_mode.jax, "process_count", lambda: 3)
  pipe = types.SimpleNamespace(
    devices=_devices(3, 2),
    plan=types.SimpleNamespace(stage_devices=((0,), (1,), (2,), (3,))),
  )
  assert pipeline_mode._idle_processes(pipe) == [2]
  pipe.plan.stage_devices = ((0,), (2,), (4,))
  assert pipeline_mode._idle_processes(pipe) == []
