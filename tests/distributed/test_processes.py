"""Pipelines across 2 and 3 processes (jax.distributed on 127.0.0.1, gloo),
started by ``python -m jpipe.launch``: the same results as one process,
and faults that stop every process instead of hanging.

Each test starts real processes with a wall-clock limit; the pipeline
workers are ``pipeline_worker.py`` and ``fault_worker.py`` beside this
file.
"""

import json
import os
import signal
import subprocess
import sys
import time

import jax
import numpy as np
import pytest

from experiments.distributed import device_waits
from jpipe.train import process_arrays
from tests.distributed.processes import alive, ready_pids, started

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))


def _launch(nprocs, script, *args, env, timeout=240, devices=1):
  command = [sys.executable, "-m", "jpipe.launch", "--nprocs", str(nprocs)]
  command += ["--devices-per-process", str(devices)]
  command += ["--", sys.executable, os.path.join(HERE, script), *args]
  try:
    return subprocess.run(
      command,
      env=env,
      capture_output=True,
      text=True,
      timeout=timeout,
      cwd=ROOT,
    )
  except subprocess.TimeoutExpired as e:  # What it printed says where.
    out = e.stdout.decode() if isinstance(e.stdout, bytes) else e.stdout
    raise AssertionError(
      f"{script} timed out after {timeout} s; its output:\n"
      + (out or "")[-20000:]
    ) from None


def _reference(devices, out, configs, env):
  """The same configurations in one process on ``devices`` CPU devices."""
  done = subprocess.run(
    [sys.executable, os.path.join(HERE, "pipeline_worker.py"), out, configs],
    env=env(JPIPE_CPU_DEVICES=str(devices)),
    capture_output=True,
    text=True,
    timeout=240,
    cwd=ROOT,
  )
  assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]


def _configs(n):
  """Schedules and mitigations over n stages (one per process)."""
  ga = {"optimizer": "sgd", "learning_rate": 0.2}
  mixed = [2, 5, 3, "flush", 4, "flush", 1, 2]
  return [
    {
      "case": "mlp",
      "stages": n,
      "calls": [2, 3],
      "schedule": "gpipe",
      "aux": True,
    },
    {
      "case": "mlp",
      "stages": n,
      "calls": [2, 3],
      "schedule": "1f1b",
      "transport": "collective",
      "forward_only": True,
    },
    {
      "case": "mlp",
      "stages": n,
      "calls": mixed,
      "schedule": "async",
      "weight_stashing": True,
      "prediction": "msnag",
      "optimizer": "adam",
      "profile_calls": [1, 4],
    },
    {
      "case": "mlp",
      "stages": n,
      "calls": [3, 5],
      "schedule": "async",
      "weight_stashing": True,
      "aux": True,
      "gap_aware": "ga",
      "gap_aware_options": ga,
    },
    {
      "case": "mlp",
      "stages": n,
      "calls": [4, 4],
      "schedule": "2bw",
      "step_every": 4,
      "recompute": False,
    },
    {"case": "gpt_tied", "stages": n, "calls": [2, 3], "schedule": "gpipe"},
    {
      "case": "gpt_tied",
      "stages": n,
      "calls": [2, 5, 3],
      "schedule": "async",
      "weight_stashing": True,
      "transport": "collective",
    },
    {
      "case": "resnet_state",
      "stages": n,
      "calls": [2, 3, 4],
      "schedule": "async",
      "weight_stashing": True,
      "forward_only": True,
    },
    # Zero-bubble: I's cotangents cross processes, W stays.
    {"case": "gpt_tied", "stages": n, "calls": [2, 3], "schedule": "zbh1"},
    {
      "case": "mlp",
      "stages": n,
      "calls": [2, 3],
      "schedule": "zbh1",
      "transport": "collective",
      "recompute": False,
    },
    # V schedules: two stages per process, the last back on process 0.
    {"case": "gpt_tied", "stages": 2 * n, "calls": [2, 3], "schedule": "zbv"},
    {
      "case": "mlp",
      "stages": 2 * n,
      "calls": [4, 5],
      "schedule": "dualpipev",
      "recompute": False,
      "profile_calls": [1],
    },
    # Gradient clipping: the global norm summed over the processes; the
    # gradients summed in bfloat16 (grad_accum_dtype narrower than the
    # float32 params: the tied sums cross processes in it); a dynamic loss
    # scale, in each process's state and the gathered state dict.
    {
      "case": "gpt_tied",
      "stages": n,
      "calls": [2, 3],
      "schedule": "1f1b",
      "clip_global_norm": 0.05,
      "forward_only": True,
      "grad_accum_dtype": "bfloat16",
      "loss_scale": "dynamic",
    },
    # Typed PRNG keys: one made on stage 0 crosses to the others (the
    # transfer server moves key data); NNX's per-Dropout RNG streams as
    # model state, gathered into the state dict.
    {"case": "dropout_key", "stages": n, "calls": [2, 3], "schedule": "1f1b"},
    {
      "case": "nnx_dropout",
      "stages": n,
      "calls": [2, 3],
      "schedule": "async",
      "weight_stashing": True,
    },
    # NNX LoRA (wrt=nnx.LoRAParam): frozen base weights as model state no
    # stage updates, each read on its layer's stage (the tied embedding
    # on the first and last), in the state dict as they started.
    {"case": "nnx_lora", "stages": n, "calls": [2, 3], "schedule": "1f1b"},
    # A holder's tied gradient crossing to its owner's step in the
    # accumulated dtype (async "tied_grad" transfers, pull transport).
    {
      "case": "gpt_tied",
      "stages": n,
      "calls": [3, 2],
      "schedule": "async",
      "weight_stashing": True,
      "step_every": 2,
      "grad_accum_dtype": "bfloat16",
    },
  ]


@pytest.mark.slow
@pytest.mark.parametrize("nprocs", [2, 3])
def test_processes_equal_one_process(tmp_path, nprocs, process_env):
  """gpipe, 1f1b, zero-bubble zbh1, zbv and dualpipev (two stages per
  process), streaming async (ws, wp, GA, adam), aux outputs of the loss
  (gpipe, async GA), 2bw without
  recomputation, tied embeddings (sync and async), BatchNorm statistics
  and global-norm clipping (the norm summed over processes), over both
  transports (pull; collective for three), and evaluation and prediction
  forward through the stages after training (the loss, a metrics
  function, logits; mlp, BatchNorm, tied GPT), typed PRNG keys (a dropout
  key crossing stages; NNX's RNG streams as model state), split between
  the 2- and 3-process runs: n processes with one
  stage each (two for the V schedules) give the one-process results
  (params, optimizer state, model state, every call's loss)."""
  # (CI time) 2 processes: the synchronous ones, 2bw and async ws+wp;
  # 3: the other streaming ones (GA, tied over collectives, BatchNorm)
  # and clipping; zbh1 on both (tied over 3, collective over 2); zbv and
  # dualpipev on 2; the dropout key crossing on 2, NNX's streams on 3,
  # NNX LoRA on 2; gradients summed in bfloat16: sync on 3, async on 2.
  keep = (
    (3, 6, 7, 8, 12, 14)
    if nprocs == 3
    else (0, 1, 2, 4, 5, 9, 10, 11, 13, 15, 16)
  )
  configs = [_configs(nprocs)[i] for i in keep]
  configs = json.dumps(configs)
  ref, got = str(tmp_path / "ref.npz"), str(tmp_path / "got.npz")
  _reference(nprocs, ref, configs, process_env)
  done = _launch(nprocs, "pipeline_worker.py", got, configs, env=process_env())
  assert done.returncode == 0, done.stdout[-6000:]
  for p in range(nprocs):  # each process ran only its own stage
    assert f"[p{p}] config 0: process {p} ran stages [{p}]" in done.stdout
  if nprocs == 2:  # zbv: the V's first and last stage on process 0
    assert "[p0] config 6: process 0 ran stages [0, 3]" in done.stdout
    assert "[p1] config 6: process 1 ran stages [1, 2]" in done.stdout
  if nprocs == 3:  # the middle stage's process passed only shapes
    assert "[p1] config 0: process 1 ran stages [1], read no data" in (
      done.stdout
    )
  want, have = np.load(ref), np.load(got)
  assert set(want) == set(have)
  # has_aux (config 0 of each run): the first and the last stage's aux
  # outputs, each shared from its process.
  assert {"0/aux/loss", "0/aux/input_mean"} <= set(want)
  assert f"[p0] config 0: aux made on stages [0, {nprocs - 1}]" in done.stdout
  np.testing.assert_array_equal(want["0/aux/loss"], want["0/losses"])
  if nprocs == 3:  # The loss-scaled run (config 12): 2 finite steps.
    np.testing.assert_array_equal(
      want[f"{keep.index(12)}/loss_scale"], [2.0**15, 2]
    )
  for key in want:
    np.testing.assert_allclose(have[key], want[key], rtol=0, atol=1e-6)
  if nprocs == 2:  # profiled calls (same results, checked above)
    _check_profiles(got, 2, [0, 1], calls=2)  # async: stage s on process s
    _check_profiles(got, 7, [0, 1, 1, 0], calls=1)  # dualpipev


def _check_profiles(got, config, process_of, calls):
  """Profiled calls across processes (``process_of``: each stage's
  process): each process's actions lie within the call on its clock,
  exactly those whose inputs another process sends are stamped with
  their arrival (before they start), and ``device_waits`` splits each
  process's window into busy, transfer wait and other idle."""
  n = len(process_of)
  profiles, transfers = [], []
  for p in range(2):
    with open(f"{got}.profile{config}.p{p}") as f:
      written = json.load(f)
    profiles.append(written["calls"])
    transfers.append(written["transfers"])
    assert len(profiles[p]) == calls
  for p, profiled in enumerate(profiles):
    for call in profiled:
      assert call["actions"]
      for r in call["actions"]:
        s = r["stage"]
        assert process_of[s] == p
        assert call["before"] <= r["start"] <= r["end"] <= call["after"]
        if r["kind"] == "F":
          remote = s > 0 and process_of[s - 1] != p
        elif r["kind"] in ("B", "I"):
          remote = s < n - 1 and process_of[s + 1] != p
        else:
          remote = False
        assert (r["arrived"] is not None) == remote, r
        if remote:
          assert call["before"] <= r["arrived"] <= r["start"]
  # Each process's first profiled call: one call of the pipeline.
  first = [profiled[0]["actions"] for profiled in profiles]
  begin = min(r["start"] for rs in first for r in rs)
  finish = max(r["end"] for rs in first for r in rs)
  for w in device_waits.device_waits(first, 1):
    total = w["busy"] + w["transfer_wait"] + w["other_idle"]
    assert total == pytest.approx((finish - begin) * 1e3)
  # Transfer stamps: what one process offered, the other pulled, and each
  # end's value was stamped ready there.
  for src, dst in ((0, 1), (1, 0)):
    offered = {u for what, u, _ in transfers[src] if what == "offer"}
    ready = {u for what, u, _ in transfers[src] if what == "ready"}
    pulled = {u for what, u, _ in transfers[dst] if what == "pull"}
    arrived = {u for what, u, _ in transfers[dst] if what == "arrived"}
    assert offered and offered == ready == pulled == arrived
    rows = device_waits.transfer_latencies(transfers[src], transfers[dst])
    assert len(rows) == len(offered)


def _two_processes_equal_four_devices(tmp_path, configs, process_env):
  """``configs`` run by pipeline_worker.py in 2 processes x 2 devices and
  in one process on 4 (the reference): every saved array equal. Returns
  the reference's arrays and the 2-process run's CompletedProcess."""
  ref, got = str(tmp_path / "ref.npz"), str(tmp_path / "got.npz")
  _reference(4, ref, configs, process_env)
  done = _launch(
    2, "pipeline_worker.py", got, configs, env=process_env(), devices=2
  )
  assert done.returncode == 0, done.stdout[-20000:]
  want, have = np.load(ref), np.load(got)
  assert set(want) == set(have)
  for key in want:
    np.testing.assert_allclose(have[key], want[key], rtol=0, atol=1e-6)
  return want, done


@pytest.mark.slow
def test_replica_groups_spanning_processes(tmp_path, process_env):
  """2 processes x 2 devices, a stage's replicas on devices of both
  (first, middle or last stage): synchronous, clipped and
  weight-stashing runs with the split routing, synchronous and
  weight-stashing 1F1B-RR (round robin: microbatch b on replica b mod 2,
  in its process), their evaluation and predictions, and streaming runs
  with params tied between the group and another stage (the group owns
  the tied leaf: the holder's gradient crosses to the group's other
  process; the group holds it: the owner's value does) equal the
  one-process results on 4 devices; what does not span processes
  (weighted groups, a round-robin last stage) is refused in one line.
  Also (the last two) each stage a replica group in its own process,
  values gathered off a group before a transfer and split after.
  (Model state: ``test_model_state_in_a_group_spanning_processes``.)"""
  split = {"case": "mlp", "calls": [2, 3]}
  spans = [[1, 2], [3]]
  configs = json.dumps(
    [
      {**split, "stages": 2, "groups": spans, "schedule": "gpipe",
       "forward_only": True},
      {**split, "stages": 2, "groups": spans, "schedule": "1f1b",
       "clip_global_norm": 0.05},
      {**split, "stages": 3, "groups": [[0], [1, 2], [3]],
       "calls": [2, 5, 3], "schedule": "async", "weight_stashing": True},
      {**split, "stages": 2, "groups": [[0], [1, 2]],
       "calls": [2, 5, "flush", 3], "schedule": "async",
       "weight_stashing": True, "forward_only": True},
      {**split, "stages": 2, "groups": spans, "schedule": "1f1b",
       "replica_routing": "round_robin"},
      {**split, "stages": 3, "groups": [[0], [1, 2], [3]],
       "calls": [2, 5, "flush", 3], "schedule": "async",
       "weight_stashing": True, "replica_routing": "round_robin",
       "forward_only": True},
      {**split, "stages": 2, "groups": spans, "replica_routing": "weighted",
       "refused": "with the 'weighted' routing"},
      {**split, "stages": 2, "groups": [[0], [1, 2]],
       "replica_routing": "round_robin",
       "refused": "the last stage's round-robin replica group spans"},
      {"case": "gpt_tied", "stages": 2, "groups": spans, "calls": [2, 3],
       "num_microbatches": 2, "schedule": "async", "weight_stashing": True},
      {"case": "gpt_tied", "stages": 2, "groups": [[0], [1, 2]],
       "calls": [2, 3], "num_microbatches": 2, "schedule": "async",
       "weight_stashing": True},
      {"case": "mlp", "stages": 2, "replicas": 2, "calls": [2, 3],
       "schedule": "1f1b"},
      {"case": "gpt_tied", "stages": 2, "replicas": 2, "calls": [2, 5, 3],
       "num_microbatches": 2,
       "schedule": "async", "weight_stashing": True},
    ]
  )  # fmt: skip
  want, done = _two_processes_equal_four_devices(tmp_path, configs, process_env)
  assert done.stdout.count("refused: ") == 2 * 2, done.stdout[-6000:]
  assert len(want) > 100


@pytest.mark.slow
def test_model_state_in_a_group_spanning_processes(tmp_path, process_env):
  """A BatchNorm ResNet (3 blocks, 6x6 images) whose first stage's
  replica group spans 2 processes (devices 1 and 2 of 2 processes x 2):
  with the split routing (1f1b) the group's statistics are the whole
  microbatch's, the same in both processes; with 1F1B-RR (ws+rr, each
  microbatch on one replica) each replica keeps its own statistics in its
  own process. Both resume from per-process checkpoints (the group's
  lead writes its statistics) after 2 calls and train on; losses, aux
  outputs of the loss (split routing; refused with round robin), params,
  optimizer state, batch statistics (and replica 1's own copy, in
  process 1), evaluation and predictions equal one process's."""
  base = {
    "case": "resnet_state",
    "stages": 2,
    "groups": [[1, 2], [3]],
    "resume_at": 2,
    "forward_only": True,
    "aux": True,
  }
  configs = json.dumps(
    [
      {**base, "calls": [2, 3, 2], "schedule": "1f1b"},
      {**base, "calls": [2, 5, 3], "schedule": "async",
       "weight_stashing": True, "replica_routing": "round_robin",
       "aux": False},
      {**base, "aux": True, "replica_routing": "round_robin", "calls": [2],
       "refused": "aux outputs made on a round-robin group spanning"},
    ]
  )  # fmt: skip
  want, done = _two_processes_equal_four_devices(tmp_path, configs, process_env)
  for c in range(2):  # stage 0's statistics, evaluation, predictions
    assert {f"{c}/state/0", f"{c}/eval_loss", f"{c}/logits"} <= set(want)
  # Aux outputs (split routing): input_mean made on the spanning group,
  # in both processes, and shared; with round robin, refused.
  assert {"0/aux/input_mean", "0/eval_aux/input_mean"} <= set(want)
  assert "[p0] config 0: aux made on stages [0, 1]" in done.stdout
  assert done.stdout.count("refused: ") == 2, done.stdout[-6000:]
  # Replica 1 (device 2) runs in process 1: its own statistics are
  # current there, and they are not replica 0's.
  replica0 = want["1/state/0"]
  want = np.load(str(tmp_path / "ref.npz.replicas1.p0.npz"))
  have = np.load(str(tmp_path / "got.npz.replicas1.p1.npz"))
  assert set(want) == set(have) and len(want) > 0
  for key in want:
    np.testing.assert_allclose(have[key], want[key], rtol=0, atol=1e-6)
  assert not np.allclose(want["0/1"], replica0)


@pytest.mark.slow
@pytest.mark.parametrize("sig", ["SIGKILL", "SIGSTOP"])
def test_killed_or_hung_process_stops_the_run(sig, process_env):
  """A process killed (SIGKILL) or hung (SIGSTOP) mid-run: the launcher
  exits non-zero within 60 s, naming the process, with no process left."""
  command = [sys.executable, "-m", "jpipe.launch", "--nprocs", "2"]
  command += ["--", sys.executable, os.path.join(HERE, "fault_worker.py")]
  with started(command, process_env()) as proc:
    pids, lines = ready_pids(proc, 2, time.monotonic() + 180)
    os.kill(pids[1], getattr(signal, sig))
    start = time.monotonic()
    rest, _ = proc.communicate(timeout=60)
    took = time.monotonic() - start
  out = "".join(lines) + rest
  assert proc.returncode != 0, out[-4000:]
  assert took < 60
  if sig == "SIGKILL":
    assert "process 1 exited with signal SIGKILL" in out, out[-4000:]
  else:  # the survivor's heartbeat gave up on it
    assert "stopped sending heartbeats" in out, out[-4000:]
    assert "process 0 exited with" in out, out[-4000:]
    assert "process 1 is stopped" in out, out[-4000:]
  for pid in pids.values():
    assert not alive(pid)


@pytest.mark.slow
def test_exception_in_one_process_stops_all_with_its_traceback(process_env):
  """An exception in process 1 at step 3: every process exits at once,
  the traceback is shown, the launcher returns its status."""
  start = time.monotonic()
  done = _launch(
    2,
    "fault_worker.py",
    env=process_env(FAULT="raise:1:3", STEPS="50"),
    timeout=180,
  )
  took = time.monotonic() - start
  assert done.returncode == 1, done.stdout[-4000:]
  assert "injected failure in process 1 at step 3" in done.stdout
  assert "[p1] Traceback" in done.stdout
  assert "process 1 exited with status 1" in done.stdout
  assert "done 0" not in done.stdout
  assert took < 120  # start-up and compiles; the failure itself is instant


def test_launcher_runs_a_finished_run_to_status_zero(process_env):
  """The default tier's one multi-process run (the smallest: 2 processes,
  3 steps of a 2-stage pipeline): the launcher, the pull transport and
  the processes' synchronisation, as every other test here exercises
  them at length in the slow tier."""
  done = _launch(2, "fault_worker.py", env=process_env(STEPS="3"), timeout=180)
  assert done.returncode == 0, done.stdout[-4000:]
  assert "[p0] done 0" in done.stdout and "[p1] done 1" in done.stdout


def test_a_profiled_call_across_processes(tmp_path, process_env):
  """The default tier's profile across processes (2 processes, one
  stage each, 1F1B, the second of two calls profiled): arrivals stamped
  on exactly the actions another process feeds, transfer ends stamped
  on both sides (``_check_profiles``; the slow tier profiles streaming
  and V schedules and compares with one process)."""
  config = {
    "case": "mlp", "stages": 2, "calls": [2, 3], "schedule": "1f1b",
    "profile_calls": [1],
  }  # fmt: skip
  got = str(tmp_path / "got.npz")
  done = _launch(
    2, "pipeline_worker.py", got, json.dumps([config]), env=process_env()
  )
  assert done.returncode == 0, done.stdout[-6000:]
  _check_profiles(got, 0, [0, 1], calls=1)


@pytest.mark.slow
def test_a_stacked_leaf_across_processes_is_saved_in_rows(
  tmp_path, process_env
):
  """Layers under a scan (one stacked leaf per param) over 2 stages in
  2 processes: each process writes its own layers' rows of the
  stacked leaves (per-process checkpoint pieces), and read back whole
  they are the one-process run's state dict; so are BatchNorm statistics
  stacked per layer (held as rows, ``build/state_rows.py``), each row
  updated in its layer's process."""
  configs = json.dumps(
    [
      {"case": "scan_plain", "stages": 2, "calls": [2, 2],
       "schedule": "1f1b", "optimizer": "adam", "per_process_save": True},
      {"case": "scan_state", "stages": 2, "calls": [2, 2],
       "schedule": "1f1b", "per_process_save": True},
    ]
  )  # fmt: skip
  ref, got = str(tmp_path / "ref.npz"), str(tmp_path / "got.npz")
  _reference(2, ref, configs, process_env)
  done = _launch(2, "pipeline_worker.py", got, configs, env=process_env())
  assert done.returncode == 0, done.stdout[-6000:]
  for config in (0, 1):
    index = process_arrays.read_index(f"{got}.arrays{config}")
    pieces = [path for path, entry in index.items() if "pieces" in entry]
    assert pieces
    if config == 1:  # (The statistics' rows too.)
      assert any(path.startswith("['model_state']") for path in pieces)
    want = process_arrays.read_tree(f"{ref}.arrays{config}")
    have = process_arrays.read_tree(f"{got}.arrays{config}")
    assert jax.tree.structure(want) == jax.tree.structure(have)
    for a, b in zip(jax.tree.leaves(want), jax.tree.leaves(have), strict=True):
      np.testing.assert_allclose(b, a, rtol=0, atol=1e-6)


@pytest.mark.slow
def test_global_arrays_on_the_callers_mesh_across_processes(process_env):
  """Multi-host SPMD code: a mesh over both processes' devices, set
  (Auto, then Explicit) or not set, the batch and a weight sharded over
  it (each process holding its rows), the other weights replicated. The
  pipeline gathers them whole, steps as the loss jitted over the mesh,
  evaluates, and gives the caller's mesh back (caller_mesh_worker.py
  checks each)."""
  done = _launch(2, "caller_mesh_worker.py", env=process_env(), devices=2)
  assert done.returncode == 0, done.stdout[-6000:]
  for kind in ("Auto", "Explicit", "unset"):
    assert done.stdout.count(f"{kind}: equal") == 2, done.stdout[-6000:]
