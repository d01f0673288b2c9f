"""Processes of one run started apart (by hand, SLURM): what they must
share is checked before any work (``jpipe.train.process_agreement``).
An outside check started two processes by hand, one with another
learning rate: it trained beside the other and finished 0.14 accuracy
against 0.775, exit status 0; with host-local workdirs the resume hung
forever. Each is now one line in every process, within seconds."""

import os
import subprocess
import sys

import pytest

from jpipe.launch import _processes
from jpipe.train import process_agreement
from tests.distributed.processes import environment

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(__file__)))


def _by_hand(workdirs, overrides, devices=(2, 2)):
  """Two processes of one run, each its own command line; their (exit
  status, output)."""
  envs = _processes.process_environments(
    2, 2, "cpu", base=environment(PYTHONPATH=ROOT)
  )
  procs = []
  for env, workdir, extra, n in zip(
    envs, workdirs, overrides, devices, strict=True
  ):
    env["JPIPE_CPU_DEVICES"] = str(n)
    command = [
      sys.executable,
      "-m",
      "jpipe.train",
      "--config",
      os.path.join(ROOT, "configs", "default.py"),
      f"--workdir={workdir}",
      "--config.train.steps=2",
      "--config.pipeline.num_stages=2",
      *extra,
    ]
    procs.append(
      subprocess.Popen(
        command,
        env=env,
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
      )
    )
  out = []
  for p in procs:
    try:
      text, _ = p.communicate(timeout=180)
    finally:
      p.kill()
    out.append((p.returncode, text))
  return out


def test_processes_given_other_configs_stop_naming_the_field(tmp_path):
  workdir = str(tmp_path / "w")
  results = _by_hand(
    [workdir, workdir], [[], ["--config.optimizer.learning_rate=0.5"]]
  )
  for code, text in results:
    assert code == 2, text[-3000:]
    assert (
      "processes of this run differ: config.optimizer.learning_rate 0.05 "
      "(process 0), 0.5 (process 1)" in text
    ), text[-3000:]
  assert not os.path.exists(os.path.join(workdir, "metrics.jsonl"))


@pytest.mark.slow
def test_host_local_workdirs_and_device_counts_are_refused(tmp_path):
  """Two paths stand in for two hosts' local disks; 2 and 4 devices
  crashed in a reshape."""
  results = _by_hand([str(tmp_path / "a"), str(tmp_path / "b")], [[], []])
  for code, text in results:
    assert code == 2, text[-3000:]
    assert "is not one folder for all processes: process(es) [1]" in text
  shared = str(tmp_path / "s")
  results = _by_hand([shared, shared], [[], []], devices=(2, 4))
  for code, text in results:
    assert code == 2, text[-3000:]
    assert "devices per process 0: 2, 1: 4" in text, text[-3000:]


def _report(**changes):
  report = {
    "code": "0.1+abc",
    "libraries": process_agreement.library_versions(),
    "devices": 2,
    "config": {"optimizer.learning_rate": "0.05"},
  }
  for key, value in changes.items():
    if key in report["libraries"]:
      report["libraries"] = {**report["libraries"], key: value}
    else:
      report[key] = value
  return report


def test_another_library_version_is_named_with_each_processs():
  """Another JAX (or flax, optax, orbax) on one host: its programs may
  compile and name params differently, so the run stops naming it."""
  mine = _report()
  assert process_agreement._difference([mine, _report()]) == ""
  other = _report(jax="0.9.0")
  got = process_agreement._difference([mine, other])
  assert got == f"jax per process 0: {mine['libraries']['jax']}, 1: 0.9.0"
  assert set(mine["libraries"]) == set(process_agreement.LIBRARIES)
  assert "absent" not in mine["libraries"].values()  # All installed here.
  got = process_agreement._difference([mine, _report(devices=4)])
  assert got == "devices per process 0: 2, 1: 4"
