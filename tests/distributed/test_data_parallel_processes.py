"""Several pipelines in data parallel across processes (SD-Pipe's shape:
one process per pipeline), started by ``python -m jpipe.launch``: the
same results as one process where the run is deterministic, free-running
epochs whose scheduler lives in process 0, and the training CLI across
processes resuming in one. Also DynPipe's re-partitioning with one
process per stage (the runtime's other multi-process users).
"""

import json
import os
import subprocess
import sys

import numpy as np
import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))

pytestmark = pytest.mark.slow

CONFIGS = [
  # Lockstep calls: deterministic, so equal to the one-process run.
  {"sync": "allreduce", "pipelines": 2, "stages": 2, "schedule": "1f1b",
   "calls": 3},
  {"sync": "adpsgd", "pipelines": 2, "stages": 2, "schedule": "async",
   "calls": 3},
  # Free-running epochs: groups depend on timing.
  {"sync": "preduce", "pipelines": 2, "stages": 2, "schedule": "async",
   "epochs": 2, "hetero": 0.01},
  {"sync": "hetpipe", "pipelines": 2, "stages": 2, "schedule": "async",
   "epochs": 1},
]  # fmt: skip


def _run(command, env, timeout=240):
  done = subprocess.run(
    command, env=env, capture_output=True, text=True, timeout=timeout, cwd=ROOT
  )
  assert done.returncode == 0, done.stdout[-6000:] + done.stderr[-3000:]
  return done


def test_pipelines_one_per_process(tmp_path, process_env):
  """2 processes x 2 devices, one 2-stage pipeline each: allreduce and
  AD-PSGD in lockstep equal the one-process run on 4 devices (params of
  every pipeline, losses, consensus; <= 1e-6); partial reduce and HetPipe
  run free epochs through process 0's scheduler and servers, and the
  consensus is the mean of the pipelines gathered from both processes."""
  worker = os.path.join(HERE, "data_parallel_worker.py")
  configs = json.dumps(CONFIGS)
  ref, got = str(tmp_path / "ref.npz"), str(tmp_path / "got.npz")
  _run(
    [sys.executable, worker, ref, configs],
    process_env(JPIPE_CPU_DEVICES="4"),
  )
  launch = [sys.executable, "-m", "jpipe.launch", "--nprocs", "2"]
  launch += ["--devices-per-process", "2", "--", sys.executable, worker]
  done = _run(launch + [got, configs], process_env())
  for p in range(2):  # Each process ran its own pipeline.
    assert f"[p{p}] config 2 epoch 1: process {p} ran pipelines [{p}]" in (
      done.stdout
    )
  want, have = np.load(ref), np.load(got)
  assert set(want) == set(have)
  for key in want:
    if key.startswith(("0/", "1/")):
      np.testing.assert_allclose(have[key], want[key], rtol=0, atol=1e-6)
  for c in range(len(CONFIGS)):  # The consensus through the stages.
    np.testing.assert_allclose(
      have[f"{c}/consensus_loss"], have[f"{c}/consensus_loss_ref"], rtol=1e-5
    )
  for c in (2, 3):
    params = sorted(k for k in have if k.startswith(f"{c}/params/0/"))
    assert params
    for key in params:
      leaf = key.rsplit("/", 1)[1]
      both = [have[f"{c}/params/{p}/{leaf}"] for p in range(2)]
      assert np.all(np.isfinite(both[0]))
      np.testing.assert_allclose(
        have[f"{c}/consensus/{leaf}"], np.mean(both, axis=0), atol=1e-6
      )
  # Each epoch ends once the last stages took 2 pipelines x 4 steps
  # (async: a call of 4 microbatches is 4 steps).
  for e in range(2):
    assert 4 * have[f"2/batches/{e}"].sum() >= 2 * 4
    assert np.all((1 <= have[f"2/group/{e}"]) & (have[f"2/group/{e}"] <= 2))
  assert np.all(have["3/group/0"] == 1)  # HetPipe: pushes, no groups.


def test_cli_across_processes_resumes_in_one(tmp_path, process_env):
  """configs/sdpipe.py small (4 pipelines x 2 stages, preduce with
  delays) across 2 processes of 4 devices (2 pipelines each): trains an
  epoch and checkpoints every replica; this process (8 devices) resumes
  it; another pipeline count is refused by name."""
  args = [
    "--config",
    "configs/sdpipe.py",
    "--workdir",
    str(tmp_path),
    "--config.model.kwargs.hidden=(32,32)",
    "--config.data_parallel.epoch_batches=2",
    "--config.data_parallel.hetero=0.01",
    "--config.data_parallel.simulated_ms=1.0",
    "--config.train.steps=2",
  ]
  launch = [sys.executable, "-m", "jpipe.launch", "--nprocs", "2"]
  launch += ["--devices-per-process", "4", "--", sys.executable]
  done = _run(launch + ["-m", "jpipe.train", *args], process_env())
  assert "[p0] epoch 1/1 (step 2)" in done.stdout
  assert "[p1] epoch" not in done.stdout  # Process 0 alone prints.

  sys.path.insert(0, ROOT)
  from configs import sdpipe
  from jpipe.train import checkpoint as checkpoint_lib
  from jpipe.train import train_lib

  config = sdpipe.get_config()
  config.model.kwargs.hidden = (32, 32)
  config.data_parallel.epoch_batches = 2
  config.data_parallel.hetero = 0.01
  config.data_parallel.simulated_ms = 1.0
  config.train.steps = 4
  summary = train_lib.train_and_evaluate(config, str(tmp_path))
  assert summary["pipelines"] == 4 and summary["sync"] == "preduce"
  rows = [json.loads(x) for x in open(tmp_path / "metrics.jsonl")]
  assert [r["step"] for r in rows if "eval/accuracy" in r] == [2, 4]
  assert all(
    1 <= r["sync/mean_group_size"] <= 4
    for r in rows
    if "sync/mean_group_size" in r
  )
  config.data_parallel.pipelines = 2  # Another count: refused, by name.
  with pytest.raises(checkpoint_lib.CheckpointError, match="'pipelines': 4"):
    train_lib.train_and_evaluate(config, str(tmp_path))


def test_dynamic_repartition_across_processes(tmp_path, process_env):
  """configs/dynpipe.py with 2 stages, one process each: device 1 slowed
  4x from step 4 to 10. Each process times its own stage (inputs from
  the other process bound an action's start), process 0 decides, both
  switch: nodes leave stage 1 at step 8 (the second window that saw the
  slowdown) and come back (the first plan's
  pipeline, kept) by step 14; the slowdown is measured near 4x."""
  hidden = "(" + ",".join(["128"] * 11) + ")"
  launch = [sys.executable, "-m", "jpipe.launch", "--nprocs", "2", "--"]
  done = _run(
    launch
    + [
      sys.executable,
      "-m",
      "jpipe.train",
      "--config",
      "configs/dynpipe.py",
      "--workdir",
      str(tmp_path),
      "--config.pipeline.num_stages=2",
      "--config.dynamic.window=2",
      "--config.dynamic.inject=1:4:4:10",
      "--config.dynamic.horizon_steps=500",
      f"--config.model.kwargs.hidden={hidden}",
      "--config.train.steps=14",
    ],
    process_env(),
  )
  assert "[p0] re-partition at step 8: [0:6 | 6:12] -> [0:" in done.stdout
  assert "[p1] re-partition" not in done.stdout  # Process 0 prints.
  rows = [json.loads(x) for x in open(tmp_path / "metrics.jsonl")]
  moved, back = [r["repartition"] for r in rows if "repartition" in r]
  assert moved["new"][1] > 6 and moved["sigma"][1] == pytest.approx(4, rel=0.25)
  assert back["new"] == [0, 6, 12] and not back["compiled"]
