"""Runs that would hang stop themselves; the launcher leaves no process
behind: a device collective behind a transfer in flight, a pipeline
dropped right after its peers connected, one process
skipping a cross-process operation (the watchdog), SIGTERM to the
launcher of a hung run, SIGKILL to the launcher."""

import os
import signal
import subprocess
import sys
import time

import pytest

from tests.distributed.processes import (
  alive,
  read_until,
  ready_pids,
  started,
)

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))

pytestmark = pytest.mark.slow


def _launch(*command, nprocs=2, extra=()):
  return [
    sys.executable,
    "-m",
    "jpipe.launch",
    f"--nprocs={nprocs}",
    *extra,
    "--",
    *command,
  ]


def _both_done(worker: str, env) -> None:
  """Runs ``worker`` (this folder's) in 2 processes: both print "done P"
  and the launcher ends with status 0 within 120 s."""
  done = subprocess.run(
    _launch(sys.executable, os.path.join(HERE, worker)),
    env=env,
    capture_output=True,
    text=True,
    timeout=120,
    cwd=ROOT,
  )
  assert done.returncode == 0, done.stdout[-4000:]
  assert "[p0] done 0" in done.stdout and "[p1] done 1" in done.stdout


def test_a_collective_waits_for_transfers_in_flight(process_env):
  """Process 1 enters a device collective while process 0 has yet to
  pull a value from it: the quiet point in front of the collective lets
  the pull finish first (without it, both waited forever)."""
  _both_done("order_worker.py", process_env(ROUNDS="4"))


def test_a_pipeline_dropped_after_connect_leaves_no_peer_waiting(process_env):
  """Process 0 pulls late in ``Transport.connect``; process 1, which
  sends its last link's value, drops that pipeline at once and builds
  another: connect's closing barrier keeps process 1's transfer server
  up until process 0 has pulled (without it, both waited forever)."""
  _both_done("connect_worker.py", process_env(PULL_DELAY_S="2"))


def test_watchdog_stops_a_run_whose_processes_wait_for_each_other(
  tmp_path, process_env
):
  """Process 1 skips the second stop agreement, after step 2 (a test-only
  switch; later ones come at steps the run's speed decides):
  both processes wait for each other. The watchdog (15 s here) stops the
  run with status 124, every process's stacks and where each waits."""
  train = [sys.executable, "-m", "jpipe.train", "--config"]
  train += ["configs/default.py", f"--workdir={tmp_path}"]
  train += [
    "--config.model.kwargs.hidden=(32,32)",
    "--config.pipeline.num_stages=2",
    "--config.train.hang_timeout=15",
    "--config.train.steps=50",
  ]
  start = time.monotonic()
  done = subprocess.run(
    _launch(*train),
    env=process_env(JPIPE_TEST_SKIP="stop request:1:2"),
    capture_output=True,
    text=True,
    timeout=240,
    cwd=ROOT,
  )
  took = time.monotonic() - start
  out = done.stdout
  assert done.returncode == 124, out[-6000:]
  for p in (0, 1):
    assert f"[p{p}] Stacks of process {p}:" in out, out[-6000:]
    assert f"[p{p}] process {p}: hung after step" in out
    assert f"[p{p}] Thread 0x" in out  # faulthandler's dump
  error = next(
    line for line in out.splitlines() if "error: the run hung" in line
  )
  # Process 0 waits for process 1's stop request; process 1 went on.
  assert "process 0 waits in jpipe/train/loop.py" in error, error
  assert "stopping.py" in error and "in exchange" in error, error
  assert "process 1 waits in jpipe/" in error, error
  assert "--config.train.hang_timeout" in error
  assert "status 124 (its watchdog: the run hung)" in out
  assert took < 150  # start-up, 2 steps, 15 s of waiting, the reports


def _gone_within(pids, seconds):
  deadline = time.monotonic() + seconds
  while time.monotonic() < deadline:
    if not any(alive(p) for p in pids):
      return True
    time.sleep(0.1)
  return False


def test_sigterm_to_the_launcher_of_a_hung_run_stops_everything(process_env):
  """Process 1 stops making progress (alive: no heartbeat fires), process
  0 waits in a transfer. SIGTERM to the launcher: passed on, then SIGKILL
  after --grace 3 s; everything is gone within the grace period."""
  worker = [sys.executable, os.path.join(HERE, "fault_worker.py")]
  command = _launch(*worker, extra=["--grace=3"])
  lines = []
  with started(command, process_env(FAULT="hang:1:3")) as proc:
    deadline = time.monotonic() + 180
    pids, _ = ready_pids(proc, 2, deadline, lines)
    # The launcher pumps each process's output on its own thread, so
    # process 1's "hanging" may come before process 0's "ready".
    if not any("[p1] hanging 1" in line for line in lines):
      read_until(proc, "[p1] hanging 1", lines, deadline)
    time.sleep(1.0)  # process 0 is waiting in its transfer now
    start = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    rest, _ = proc.communicate(timeout=30)
    took = time.monotonic() - start
  out = "".join(lines) + rest
  assert "[launch] SIGTERM: passed on to every process" in out, out[-3000:]
  assert proc.returncode != 0
  assert took < 3 + 5, out[-3000:]  # the grace, and a few polls
  assert _gone_within(pids.values(), 2), out[-3000:]


def test_sigkill_to_the_launcher_leaves_no_process_behind(process_env):
  """The launcher killed outright (as ``timeout -k`` does): its workers
  get the parent-death signal and die too."""
  worker = [sys.executable, os.path.join(HERE, "fault_worker.py")]
  lines, pids = [], {}
  try:
    with started(_launch(*worker), process_env()) as proc:
      pids, _ = ready_pids(proc, 2, time.monotonic() + 180, lines)
      proc.kill()
      proc.wait()
    assert _gone_within(pids.values(), 10), "".join(lines)
  finally:
    for pid in pids.values():
      if alive(pid):
        os.kill(pid, signal.SIGKILL)
