"""``python -m jpipe.train`` across processes (``python -m jpipe.launch``):
the default config trains over 2 processes, its checkpoint resumes in 1
process and back in 2, on the trajectory of an uninterrupted run; a
SIGTERM to the launcher saves and resumes; a second run on a live run's
workdir is refused in every one of its processes; a process killed
mid-run is restarted from the last checkpoint (``--max_restarts``)."""

import json
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from jpipe.train import pretrained, process_arrays, workdir_lock
from tests.distributed.processes import read_until, started
from tests.quick_compiles import with_quick_compiles

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))

pytestmark = pytest.mark.slow


def _train(workdir, steps, nprocs, env, *overrides, launcher=(), die=None):
  """The default config (2 stages, small) to ``steps``; nprocs None: one
  process without the launcher (8 fake CPU devices); ``launcher``: its
  flags; ``die``: "PROCESS:STEP" kills that process after that step
  (tests/distributed/die_at_step.py)."""
  command = [sys.executable, "-m", "jpipe.train"]
  if die:
    command[2:2] = ["tests.distributed.die_at_step", die]
  command += ["--config", os.path.join(ROOT, "configs", "default.py")]
  command += [
    f"--workdir={workdir}",
    "--config.model.kwargs.hidden=(32,32)",
    "--config.pipeline.num_stages=2",
    "--config.train.log_every=1",
    "--config.train.eval_every=1000",
    f"--config.train.steps={steps}",
    *overrides,
  ]
  env = dict(env)
  if nprocs is None:
    env["XLA_FLAGS"] = with_quick_compiles(
      "--xla_force_host_platform_device_count=8"
    )
  else:
    command = [
      sys.executable,
      "-m",
      "jpipe.launch",
      f"--nprocs={nprocs}",
      *launcher,
      "--",
      *command,
    ]
  return _run_command(command, env)


def _run_command(command, env):
  done = subprocess.run(
    command, env=env, capture_output=True, text=True, timeout=300, cwd=ROOT
  )
  assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
  return done.stdout


def _losses(workdir, key="train/loss"):
  with open(os.path.join(workdir, "metrics.jsonl")) as f:
    rows = [json.loads(line) for line in f]
  return {r["step"]: r[key] for r in rows if key in r}


def test_default_config_across_processes_resumes_in_one_and_back(
  tmp_path, process_env
):
  env = process_env()
  straight, moved = tmp_path / "straight", tmp_path / "moved"
  _train(straight, 9, None, env)
  out = _train(moved, 3, 2, env)
  # One process prints and logs; the other's stage ran (its lines absent).
  assert "[p0] Done: 3 steps" in out and "[p1] Done" not in out
  assert "Resuming from step 3" in _train(moved, 6, None, env)
  # Back on 2 processes of 2 devices each: the 2 stages take one device
  # of each process (both went to process 0's, and process 1 failed).
  again = _train(moved, 9, 2, env, launcher=("--devices-per-process=2",))
  assert "[p0] Resuming from step 6" in again
  assert "[p0] Done: 9 steps" in again, again[-3000:]
  a, b = _losses(straight), _losses(moved)
  assert sorted(b) == list(range(1, 10))
  for step in range(1, 10):
    assert b[step] == pytest.approx(a[step], rel=1e-5), step


def test_the_users_task_across_processes_evaluates_through_the_stages(
  tmp_path, process_env
):
  """examples/my_task.py (the README's) over 2 processes: its Evaluation
  runs forward through the stages of both processes; losses and
  accuracies are the one-process run's."""
  env = process_env()
  flags = (
    "--config.task=examples.my_task:build_task",
    "--config.train.eval_every=2",
  )
  one, two = tmp_path / "one", tmp_path / "two"
  _train(one, 4, None, env, *flags)
  out = _train(two, 4, 2, env, *flags)
  assert "[p0] step 4: eval accuracy" in out, out[-3000:]
  for key in ("train/loss", "eval/accuracy"):
    a, b = _losses(one, key), _losses(two, key)
    assert sorted(a) == sorted(b) and b, key
    for step in a:
      assert b[step] == pytest.approx(a[step], rel=1e-5), (key, step)


@pytest.mark.slow
def test_processes_reading_other_batches_are_refused(tmp_path, process_env):
  """A task whose batch_at differs by process (each process reads its
  batches itself: one process's inputs would train against another's
  labels) stops at start-up, before any compile, with one line in every
  process."""
  command = [sys.executable, "-m", "jpipe.launch", "--nprocs=2", "--"]
  command += [sys.executable, "-m", "jpipe.train", "--config"]
  command += [
    os.path.join(ROOT, "configs", "default.py"),
    f"--workdir={tmp_path}",
  ]
  command += ["--config.task=tests.distributed.per_host_task:build_task"]
  command += ["--config.pipeline.num_stages=2"]  # (A device per process.)
  done = subprocess.run(
    command,
    env=process_env(),
    capture_output=True,
    text=True,
    timeout=300,
    cwd=ROOT,
  )
  assert done.returncode == 2, done.stdout[-4000:]
  for p in (0, 1):
    assert (
      f"[p{p}] error: the processes' batch_at(0) differ (process(es) [1] "
      "from process 0's)" in done.stdout
    ), done.stdout[-4000:]


def _launched_training(workdir, *overrides):
  """The launcher's command of a long 2-process run of the default config
  (small, 2 stages, no evaluation or checkpoint of its own)."""
  command = [sys.executable, "-m", "jpipe.launch", "--nprocs=2", "--"]
  command += [sys.executable, "-m", "jpipe.train", "--config"]
  command += [os.path.join(ROOT, "configs", "default.py")]
  return command + [
    f"--workdir={workdir}",
    "--config.model.kwargs.hidden=(32,32)",
    "--config.pipeline.num_stages=2",
    "--config.train.log_every=1",
    "--config.train.eval_every=100000",
    "--config.train.checkpoint_every=100000",
    *overrides,
  ]


def test_a_live_runs_workdir_is_refused_then_sigterm_saves_and_resumes(
  tmp_path, process_env
):
  """A live 2-process run holds its workdir (its processes share it):
  a second 2-process run there exits at once with status 2, each process
  with the one line naming the first run's process 0, and the first run
  trains on undisturbed. Then SIGTERM to the first run's launcher: the
  processes agree on a step, save it together and exit 143; the same
  command resumes from that step. (One long run serves both: each
  launch of 2 processes costs ~10 CPU-s.)"""
  command = _launched_training(tmp_path)
  lines = []
  with started(
    [*command, "--config.train.steps=100000"], process_env()
  ) as first:
    read_until(first, "[p0] step 1/", lines, time.monotonic() + 180)
    with open(tmp_path / workdir_lock.FILE_NAME) as f:
      holder = workdir_lock.Holder.parse(f.read())
    assert holder.processes == 2
    t0 = time.monotonic()
    second = subprocess.run(
      [*command, "--config.train.steps=100000"],
      env=process_env(),
      capture_output=True,
      text=True,
      timeout=120,
      cwd=ROOT,
    )
    took = time.monotonic() - t0
    assert second.returncode == 2, second.stdout[-4000:]
    for p in (0, 1):
      error = [
        line
        for line in second.stdout.splitlines()
        if line.startswith(f"[p{p}] error: ")
      ]
      assert len(error) == 1, second.stdout[-4000:]
      assert (
        f"is in use by another run (pid {holder.pid} on host "
        f"{holder.host}, process 0 of 2, since" in error[0]
      )
    assert took < 60, took
    read_until(first, "[p0] step 5/", lines, time.monotonic() + 60)
    first.send_signal(signal.SIGTERM)
    rest, _ = first.communicate(timeout=60)
  out = "".join(lines) + rest
  assert first.returncode == 143, out[-4000:]
  for p in (0, 1):
    assert f"[launch] process {p} exited with status 143" in out, out[-4000:]
  saved = int(out.split("SIGTERM: saved step ")[1].split()[0])
  assert saved >= 5
  again = _run_command(
    [*command, f"--config.train.steps={saved + 2}"], process_env()
  )
  assert f"[p0] Resuming from step {saved}" in again
  assert f"[p0] Done: {saved + 2} steps" in again


def _final_checksums(workdir, step):
  """The CRC-32 of every array of the checkpoint of ``step`` (params and
  optimizer state): its processes' indexes record them (written per
  process), or its metadata (written gathered, by one process)."""
  path = os.path.join(workdir, "checkpoints", str(step))
  arrays = os.path.join(path, process_arrays.ITEM)
  if os.path.isdir(arrays):
    index = process_arrays.read_index(arrays)
    return {leaf: entry["crc32"] for leaf, entry in index.items()}
  with open(os.path.join(path, "meta", "metadata")) as f:
    return json.load(f)["checksums"]


def test_a_process_killed_mid_run_restarts_from_the_last_checkpoint(
  tmp_path, process_env
):
  """Issue 68's evidence: process 1 of a 2-process 1F1B run is killed
  (SIGKILL, by a test-only switch) after step 5, checkpoints every 2
  steps. With --max_restarts 1 the launcher starts both again, the run
  resumes from step 4, trains steps 5-8 once each and ends 0 with the
  uninterrupted run's final params and optimizer state, bit for bit."""
  env = process_env()
  flags = ("--config.train.checkpoint_every=2",)
  straight, killed = tmp_path / "straight", tmp_path / "killed"
  _train(straight, 8, 2, env, *flags)
  out = _train(
    killed,
    8,
    2,
    env,
    *flags,
    launcher=("--max_restarts=1",),
    die="1:5",
  )
  assert "[launch] process 1 exited with signal SIGKILL" in out, out[-4000:]
  before, restart, after = out.partition("; restart 1 of 1, 2 processes: ")
  assert restart and "[launch] process 1 ended with signal SIGKILL" in before
  assert "[p0] Resuming from step 4 (" in after
  logged = [
    int(line.split("step ")[1].split("/")[0])
    for line in after.splitlines()
    if line.startswith("[p0] step ") and "/8: train loss" in line
  ]
  assert logged == [5, 6, 7, 8], out[-4000:]
  assert "[p0] Done: 8 steps" in after
  a, b = _losses(straight), _losses(killed)
  assert sorted(b) == list(range(1, 9)) and b == a
  assert _final_checksums(killed, 8) == _final_checksums(straight, 8)


# Process 1 of 2 fails at once once checkpoint 4 exists: its host did not
# come back for the restart.
_GONE = (
  'if [ "$JAX_PROCESS_ID" = 1 ] && [ "$JAX_NUM_PROCESSES" = 2 ] && '
  '[ -d "$WORKDIR/checkpoints/4" ]; then echo "no devices"; exit 1; fi; '
  'exec "$@"'
)


def test_a_restart_goes_on_in_fewer_processes_with_a_new_plan(
  tmp_path, process_env
):
  """--min_nprocs 1: process 1 is killed after step 5, and fails again at
  the restart's start; the restart goes on in process 0 alone (its 2
  devices), which plans 2 stages instead of 4, resumes from step 4 and
  trains steps 5 and 6 once each."""
  command = [sys.executable, "-m", "jpipe.launch", "--nprocs=2"]
  command += ["--devices-per-process=2", "--max_restarts=1", "--min_nprocs=1"]
  command += ["--", "sh", "-c", _GONE, "sh", sys.executable, "-m"]
  command += ["tests.distributed.die_at_step", "1:5"]
  command += ["jpipe.train", "--config", "configs/default.py"]
  command += [
    f"--workdir={tmp_path}",
    "--config.model.kwargs.hidden=(16,16,16)",
    "--config.pipeline.partition=mixed",  # Stages for 2 devices as for 4.
    "--config.train.log_every=1",
    "--config.train.eval_every=1000",
    "--config.train.checkpoint_every=2",
    "--config.train.steps=6",
  ]
  env = process_env(WORKDIR=str(tmp_path))
  out = _run_command(command, env)
  assert "[p0] 4 stages on devices [0, 1, 2, 3]" in out, out[-4000:]
  _, shrink, after = out.partition(
    "at start-up: restart 1 goes on with 1 process instead of 2"
  )
  assert shrink and "[p1] no devices" in out, out[-4000:]
  assert "[p0] Resuming from step 4 (" in after
  assert "[p0] 2 stages on devices [0, 1]" in after
  logged = [
    int(line.split("step ")[1].split("/")[0])
    for line in after.splitlines()
    if line.startswith("[p0] step ") and "/6: train loss" in line
  ]
  assert logged == [5, 6] and "[p0] Done: 6 steps" in after, out[-4000:]
  assert "[p1]" not in after


# (CI time) The split routing across processes, synchronous and
# asynchronous, is test_processes.py's test_replica_groups_spanning_processes
# (an MLP) and, on a BatchNorm ResNet through per-process checkpoints,
# test_model_state_in_a_group_spanning_processes: here PipeDream's own
# 1F1B-RR stream on its seed. (1f1b-split ran here too until 2026-12-01.)
@pytest.mark.parametrize("variant, routing", [("ws", "round_robin")])
def test_vgg_with_a_replica_group_across_processes_is_one_process(
  tmp_path, process_env, variant, routing
):
  """Issue 65's evidence: ``pipedream_vgg16:small`` on a 2-1-1 plan over
  4 processes of one device each, stage 0's replicas in processes 0 and
  1: synchronous 1F1B after 3 steps, asynchronous 1F1B with weight
  stashing (its stream) after 4 with round robin (PipeDream's
  1F1B-RR), log one process's losses at every step and checkpoint its
  params and optimizer state bit for bit (CRC-32 of every array). (A
  group across processes resumed from per-process checkpoints:
  test_processes.py's test_model_state_in_a_group_spanning_processes.)"""
  steps = 3 if variant == "1f1b" else 4
  command = [sys.executable, "-m", "jpipe.train", "--config"]
  command += [
    os.path.join(ROOT, "configs", "seeds", "pipedream_vgg16.py")
    + f":small:{variant}",
    "--config.pipeline.partition=contiguous",
    "--config.pipeline.num_stages=3",
    "--config.pipeline.replicas=2,1,1",
    f"--config.pipeline.replica_routing={routing}",
    f"--config.train.steps={steps}",
    f"--config.train.checkpoint_every={steps}",
    "--config.train.log_every=1",
    "--config.train.eval_every=1000",
  ]
  env = process_env()
  one, four = tmp_path / "one", tmp_path / "four"
  launch = [sys.executable, "-m", "jpipe.launch", "--nprocs=4", "--"]
  out = _run_command([*launch, *command, f"--workdir={four}"], env)
  assert "3 stages on devices [[0, 1], 2, 3]" in out, out[-3000:]
  assert ("(1F1B-RR)" in out) == (routing == "round_robin"), out[-3000:]
  flags = with_quick_compiles("--xla_force_host_platform_device_count=8")
  _run_command([*command, f"--workdir={one}"], dict(env, XLA_FLAGS=flags))
  a, b = _losses(one), _losses(four)
  assert sorted(a) == list(range(1, steps + 1)) and a == b
  sums = _final_checksums(four, steps)
  assert len(sums) > 30 and sums == _final_checksums(one, steps)


def test_frozen_leaves_across_processes_resume_in_one(tmp_path, process_env):
  """``optimizer.freeze`` over 2 processes (the frozen leaves held as
  model state, written per process in the checkpoint with the whole
  params), resumed in 1: the trajectory and the params of a run in 1
  process throughout."""
  env = process_env()
  freeze = "--config.optimizer.freeze=^layer_0/"
  straight, moved = tmp_path / "straight", tmp_path / "moved"
  _train(straight, 4, None, env, freeze)
  _train(moved, 2, 2, env, freeze)
  assert "Resuming from step 2" in _train(moved, 4, None, env, freeze)
  a, b = _losses(straight), _losses(moved)
  assert sorted(b) == [1, 2, 3, 4]
  for step in b:
    assert b[step] == pytest.approx(a[step], rel=1e-5), step
  want, got = (
    pretrained.flat_paths(pretrained._read(str(w))["params"])
    for w in (straight, moved)
  )
  assert any(p.startswith("layer_0/") for p in want)
  for path, x in want.items():
    np.testing.assert_allclose(got[path], x, rtol=1e-5, atol=1e-6)
