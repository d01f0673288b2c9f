"""The training CLI: runs, logs, resumes exactly, refuses bad input."""

import dataclasses
import functools
import glob
import json
import os
import re
import shutil
import signal
import struct
import subprocess
import sys
import time

import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest
import tensorflow_datasets as tfds
from tensorboardX.proto import event_pb2

import jpipe
from jpipe.train import checkpoint as checkpoint_lib
from jpipe.train import (
  config_options,
  errors,
  metric_log,
  pretrained,
  stopping,
  train_lib,
)

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(__file__)))
sys.path.insert(0, os.path.join(ROOT, "configs"))
import default as default_config  # noqa: E402


def _config(**overrides):
  config = default_config.get_config()
  config.train.steps = 6
  config.train.log_every = 1
  config.train.eval_every = 3
  config.train.checkpoint_every = 3
  config.model.kwargs.hidden = (32, 32)
  config.pipeline.num_stages = 2
  config.data.batch_size = 32
  config.update_from_flattened_dict(overrides)
  return config


def _cli_env():
  """The CLI's environment in a subprocess (quick compiles, as the
  in-process tests: tests/quick_compiles.py)."""
  return dict(os.environ, PYTHONPATH=ROOT)


def _losses(workdir):
  with open(os.path.join(workdir, "metrics.jsonl")) as f:
    rows = [json.loads(line) for line in f]
  return {r["step"]: r["train/loss"] for r in rows if "train/loss" in r}


def test_default_config_trains_logs_and_draws(tmp_path, capsys):
  summary = train_lib.train_and_evaluate(_config(), str(tmp_path))
  out = capsys.readouterr().out
  # The plan's speed-up in steady state and at this step's 4 microbatches
  # (2 stages of 1F1B: at most 2 * 4 / 5 with a bubble of at least 1/5).
  found = re.search(
    r"predicted speed-up ([\d.]+) in steady state, ([\d.]+) at 4 "
    r"microbatches a step \(simulated bubble (\d+)%\)",
    out,
  )
  assert found, out
  steady, at_four, bubble = map(float, found.groups())
  assert at_four < steady <= 2.0 and at_four <= 1.6 + 1e-9 and bubble >= 20
  # The closing lines say what the workdir holds.
  assert (
    f"In {tmp_path}: checkpoints/, config.json, metrics.jsonl, plan.json, "
    f"tensorboard/ ("
    in out
    and f"tensorboard --logdir {tmp_path}/tensorboard)." in out
  )
  assert 0.0 <= summary["eval"]["accuracy"] <= 1.0
  assert sorted(_losses(tmp_path)) == [1, 2, 3, 4, 5, 6]
  assert glob.glob(str(tmp_path / "tensorboard" / "events.out.tfevents.*"))
  assert (tmp_path / "timeline.png").stat().st_size > 1000
  assert set(summary["stage_time_split"]) == {0, 1}
  assert os.listdir(tmp_path / "checkpoints") == ["3", "6"] or sorted(
    os.listdir(tmp_path / "checkpoints")
  ) == ["3", "6"]


def test_the_readmes_plain_orbax_restore_reads_the_params(
  tmp_path, monkeypatch
):
  """The README's line reading a checkpoint without jpipe, as written
  (from a relative WORKDIR): the params as the Flax model shapes them."""
  train_lib.train_and_evaluate(_config(), str(tmp_path / "run"))
  with open(os.path.join(ROOT, "README.md")) as f:
    line = re.search(r"`(ocp\.CheckpointManager\(.*?)`", f.read()).group(1)
  monkeypatch.chdir(tmp_path)
  scope = {"ocp": ocp, "os": os, "WORKDIR": "run", "step": 6}
  state = eval(line, scope)  # noqa: S307 (The README's own code.)
  task = train_lib.build_task(_config())
  assert jax.tree.structure(state["params"]) == jax.tree.structure(task.params)
  assert jax.tree.map(np.shape, state["params"]) == jax.tree.map(
    np.shape, task.params
  )


@pytest.mark.parametrize(
  "dynamic", [{}, {"dynamic.enabled": True, "dynamic.policy": "static"}]
)
def test_resume_follows_the_same_trajectory(tmp_path, capsys, dynamic):
  """3 steps, then resumed to 6: steps 4-6 as a run of 6 straight; also a
  re-partitioning pipeline (static policy: measures, never moves), which
  resumes on the split its checkpoint recorded."""
  straight = tmp_path / "straight"
  resumed = tmp_path / "resumed"
  config = functools.partial(_config, **dynamic)
  train_lib.train_and_evaluate(config(**{"train.steps": 6}), str(straight))
  train_lib.train_and_evaluate(config(**{"train.steps": 3}), str(resumed))
  train_lib.train_and_evaluate(config(**{"train.steps": 6}), str(resumed))
  out = capsys.readouterr().out
  assert "Resuming from step 3" in out
  changed = "Resumed with changed fields (the earlier -> this run's): "
  assert out.count(changed) == 1  # (Not where nothing changed.)
  assert f"{changed}train.steps: 3 -> 6." in out
  if dynamic:
    assert "Resuming on the split in force: [0:" in out
  a, b = _losses(straight), _losses(resumed)
  for step in (4, 5, 6):
    assert a[step] == pytest.approx(b[step], rel=1e-6)


def test_a_resume_that_would_read_other_examples_is_refused(tmp_path):
  """A step stands for its examples (step x batch size into the seeded
  epoch order): resuming with another data.batch_size or seed would skip
  or repeat examples, so it stops at once naming the saved values; the
  saved ones resume."""
  train_lib.train_and_evaluate(_config(**{"train.steps": 3}), str(tmp_path))
  for change, saved in (
    ({"data.batch_size": 64}, "config.data.batch_size: saved 32, now 64"),
    ({"seed": 7}, "config.seed: saved 0, now 7"),
  ):
    with pytest.raises(errors.UsageError) as refused:
      train_lib.train_and_evaluate(
        _config(**{"train.steps": 6}, **change), str(tmp_path)
      )
    message = str(refused.value)
    assert message.startswith(saved), message
    assert "examples skipped or read twice" in message
    assert f"--config.init_from={tmp_path} --workdir NEW_DIR" in message
  train_lib.train_and_evaluate(_config(**{"train.steps": 4}), str(tmp_path))
  assert sorted(_losses(tmp_path)) == [1, 2, 3, 4]


@pytest.mark.slow
def test_a_different_partition_resumes_the_checkpoint(tmp_path):
  train_lib.train_and_evaluate(_config(**{"train.steps": 3}), str(tmp_path))
  config = _config(
    **{
      "train.steps": 5,
      "pipeline.num_stages": 3,
      "pipeline.partition": "pipedream_hybrid",
      "schedule.name": "async",
      "staleness.stashing": True,
    }
  )
  train_lib.train_and_evaluate(config, str(tmp_path))
  assert sorted(_losses(tmp_path)) == [1, 2, 3, 4, 5]


def test_async_with_every_mitigation_runs(tmp_path):
  config = _config(
    **{
      "schedule.name": "async",
      "pipeline.num_stages": 3,
      "pipeline.recompute": True,
      "staleness.stashing": True,
      "staleness.prediction": "msnag",
      "staleness.gap_aware": "ga",
    }
  )
  summary = train_lib.train_and_evaluate(config, str(tmp_path))
  assert summary["eval"]["accuracy"] is not None


def test_user_tfds_dataset_through_mock_data(tmp_path):
  config = _config(**{"data.name": "cifar10", "data.batch_size": 8})
  config.pipeline.num_microbatches = 2
  config.train.steps = 2
  with tfds.testing.mock_data(num_examples=16):
    summary = train_lib.train_and_evaluate(config, str(tmp_path))
  assert summary["eval"]["accuracy"] is not None


def test_unlabelled_images_are_refused_before_training(tmp_path):
  """TFDS marks an unlabelled example -1 (a test split hiding its labels):
  it would train as the last class and score as a miss, so a split with
  one stops the run in one line naming the split."""
  config = _config(**{"data.name": "cifar10", "data.batch_size": 8})
  config.pipeline.num_microbatches = 2

  def records(n, unlabelled):
    rng = np.random.default_rng(n)
    return [
      {
        "image": rng.integers(0, 256, (32, 32, 3), np.uint8),
        "label": -1 if i < unlabelled else i % 10,
      }
      for i in range(n)
    ]

  by_split = {"train": records(16, 0), "test": records(12, 3)}

  def as_data_source(builder, split, **kwargs):
    del builder, kwargs
    return by_split[str(split)]

  with tfds.testing.mock_data(as_data_source_fn=as_data_source):
    with pytest.raises(errors.UsageError) as refused:
      train_lib.train_and_evaluate(config, str(tmp_path))
  assert str(refused.value).startswith(
    "config.data (cifar10, test): 3 of 12 labels are -1, not a class"
  )


@pytest.mark.parametrize(
  "overrides, message",
  [
    (
      {"data.train_split": "train[:0]"},
      "split 'train[:0]' of sklearn_digits selects no examples: widen its "
      "slice",
    ),
    (
      {"data.name": "cifar10", "data.data_dir": "/no/such/folder"},
      "config.data.data_dir='/no/such/folder' does not exist. Prepare it",
    ),
  ],
)
def test_data_that_selects_nothing_or_is_nowhere_says_so(
  tmp_path, overrides, message
):
  """An empty slice of the embedded digits (it said: delete the healthy
  cache and rebuild it) and a data_dir that does not exist (it said: no
  such dataset)."""
  with pytest.raises(Exception, match=re.escape(message)):
    train_lib.train_and_evaluate(_config(**overrides), str(tmp_path))


def test_tfds_data_with_a_wrong_key_says_so(tmp_path):
  """A feature key the TFDS dataset lacks: one line naming the config
  field and the features it has (a bare KeyError before)."""
  config = _config(
    **{"data.name": "cifar10", "data.batch_size": 8, "data.label_key": "lable"}
  )
  with tfds.testing.mock_data(num_examples=16):
    with pytest.raises(
      errors.UsageError,
      match=re.escape(
        "config.data.label_key='lable': cifar10's examples have no such "
        "feature; they have ['id', 'image', 'label']"
      ),
    ):
      train_lib.train_and_evaluate(config, str(tmp_path))


def test_a_tfds_split_slice_selecting_nothing_is_refused(monkeypatch):
  """``check_splits`` asks TFDS's split sizes (slices included) and
  refuses a split that selects no example, before reading any."""
  from types import SimpleNamespace

  from jpipe.train import input_pipeline

  sizes = {"train": 16, "train[:0]": 0, "test": 8, "test[:4]": 4}

  class Splits(dict):
    def __getitem__(self, spec):
      return SimpleNamespace(num_examples=sizes[spec])

  builder = SimpleNamespace(
    info=SimpleNamespace(splits=Splits(train=1, test=1))
  )
  monkeypatch.setattr(input_pipeline, "_tfds_builder", lambda data: builder)
  data = _config(**{"data.name": "mine"}).data
  data.eval_split = "test[:4]"
  input_pipeline.check_splits(data)  # Both select examples.
  data.train_split = "train[:0]"
  with pytest.raises(
    errors.UsageError,
    match=re.escape(
      "config.data.train_split='train[:0]' selects no examples of 'mine'"
    ),
  ):
    input_pipeline.check_splits(data)


def test_missing_tfds_dataset_is_a_clear_error(tmp_path):
  config = _config(
    **{"data.name": "cifar10", "data.data_dir": str(tmp_path / "none")}
  )
  with pytest.raises(ValueError, match="tfds build cifar10"):
    train_lib.train_and_evaluate(config, str(tmp_path / "work"))


@pytest.mark.parametrize(
  "key, value, message",
  [
    ("schedule.name", "zb", "config.schedule.name: 'zb' is not one of"),
    ("pipeline.num_microbatches", 5, "5 does not divide data.batch_size"),
    ("data.batch_size", 0, "config.data.batch_size: must be >= 1"),
    # (Named by its config key, not the Pipeline's weight_stashing.)
    ("staleness.stashing", True, r"\['staleness.stashing'\] apply to the asy"),
    ("optimizer.schedule_steps", 9, "schedule_steps: applies to warmup_cos"),
    ("optimizer.name", "lionn", "config.optimizer.name"),
    ("pipeline.bandwidth", -1.0, "config.pipeline.bandwidth: must be >= 0"),
    (
      "staleness.partial_window",
      "sum",
      "unknown staleness.partial_window 'sum'",
    ),
    ("staleness.gap_aware_policy", "bogus", "gap_aware_policy 'bogus'"),
    ("optimizer.warmup_steps", 10, "warmup_steps: 10 has no effect"),
    ("schedule.step_every", 2, "step_every: 2 applies to"),
    ("model.name", "gpt3", "config.model.name: 'gpt3' is not one of"),
    ("train.divergence_factor", -1.0, "divergence_factor: must be >= 0"),
    ("data.eval_split", "validation", "no split 'validation'; it has"),
    ("data.name", "cifar1000", "did you mean 'cifar100'"),
    ("pipeline.memory_limit", "lots", "memory_limit: 'lots' is not a size"),
    # Too small for any split: the partitioner names the smallest limit.
    ("pipeline.memory_limit", "1KiB", "memory_limit: no split into 2"),
    ("data_parallel.sync", "preduce", "synchronises several pipelines"),
    ("data_parallel.sync", "ring", "data_parallel.sync: 'ring' is not one"),
    ("data_parallel.slowdown", "0=3", "slowdown: bad slowdown '0=3'"),
    ("data_parallel.slowdown", "0:3", "set data_parallel.simulated_ms"),
    ("data_parallel.pipelines", 16, "need at least 16 devices"),
    ("dynamic.policy", "magic", "dynamic.policy: 'magic' is not one"),
    ("dynamic.inject", "1:3", "DEVICE:FACTOR:FROM_STEP"),
    ("dynamic.simulated_ms", 10.0, "dynamic.enabled is False: enable it"),
    ("dynamic.predictor", "/no/rf.pkl", "dynamic.enabled is False: enable"),
  ],
)
def test_bad_config_values_fail_before_work(tmp_path, key, value, message):
  with pytest.raises(ValueError, match=message):
    train_lib.train_and_evaluate(_config(**{key: value}), str(tmp_path))
  assert not (tmp_path / "metrics.jsonl").exists()


@pytest.mark.parametrize(
  "other, message",
  [
    ({"data_parallel.pipelines": 2}, "re-partitioning runs one pipeline"),
    ({"pipeline.partition": "mixed"}, "'mixed' is not: use 'contiguous'"),
    (
      {"pipeline.replica_routing": "round_robin"},
      "split each microbatch: set it to 'split'",
    ),
    ({"dynamic.inject": "7:2:10"}, "device 7 holds no stage of 2"),
    ({"dynamic.high": 0.9}, "low < 1 < high"),
    ({"dynamic.predictor": "/no/rf.pkl"}, "python -m jpipe.train.slowdowns"),
    (
      {"dynamic.policy": "static", "dynamic.predictor": "/no/rf.pkl"},
      "static policy never re-plans",
    ),
  ],
)
def test_bad_dynamic_combinations_fail_before_work(tmp_path, other, message):
  config = _config(**{"dynamic.enabled": True, **other})
  with pytest.raises(ValueError, match=message):
    train_lib.train_and_evaluate(config, str(tmp_path))


@pytest.mark.parametrize(
  "text, expected",
  [
    ("", None),
    ("device", "device"),
    ("2e9", 2e9),
    ("16GiB", 16 * 2**30),
    ("512 MB", 512e6),
    ("1.5kib", 1536.0),
  ],
)
def test_memory_limit_sizes(text, expected):
  assert config_options.memory_limit(text) == expected


def test_corrupt_or_foreign_checkpoint_is_an_error(tmp_path):
  train_lib.train_and_evaluate(_config(**{"train.steps": 3}), str(tmp_path))
  with pytest.raises(
    checkpoint_lib.CheckpointError,
    match=r"another model or optimizer \(config\.model\.kwargs: saved .*32, 32.*"
    r", now .*16, 16",
  ):
    train_lib.train_and_evaluate(
      _config(**{"model.kwargs.hidden": (16, 16)}), str(tmp_path)
    )
  for path in glob.glob(
    str(tmp_path / "checkpoints" / "3" / "state" / "**"), recursive=True
  ):
    if os.path.isfile(path) and os.path.getsize(path) > 0:
      with open(path, "wb") as f:
        f.write(b"garbage")
  with pytest.raises(checkpoint_lib.CheckpointError, match="delete"):
    train_lib.train_and_evaluate(_config(), str(tmp_path))


def test_a_checkpoint_whose_step_was_edited_is_one_error(tmp_path):
  train_lib.train_and_evaluate(_config(**{"train.steps": 3}), str(tmp_path))
  meta = tmp_path / "checkpoints" / "3" / "meta" / "metadata"
  record = json.loads(meta.read_text())
  meta.write_text(json.dumps({**record, "step": "abc"}))
  with pytest.raises(checkpoint_lib.CheckpointError, match="no step count"):
    train_lib.train_and_evaluate(_config(), str(tmp_path))


def _cli(workdir, *overrides):
  return [
    sys.executable,
    "-m",
    "jpipe.train",
    "--config",
    os.path.join(ROOT, "configs", "default.py"),
    "--workdir",
    str(workdir),
    "--config.model.kwargs.hidden=(32,32)",
    "--config.pipeline.num_stages=2",
    "--config.train.log_every=1",
    *overrides,
  ]


@pytest.mark.slow
def test_cli_errors_are_a_few_lines_naming_the_fix(tmp_path):
  env = _cli_env()
  for flag, message in [
    ("--config.train.num_steps=20", "did you mean config.train.steps"),
    ("--config.train.steps=many", "train.steps=many: expected int"),
    ("--config.data.name=nosuchdata", "config.data.name='nosuchdata'"),
    (
      "--config.staleness.gap_aware_policy=bogus",
      "gap_aware_policy 'bogus': one of",
    ),
    (  # A boolean's value after a space is a positional argument to absl.
      "--config.pipeline.recompute True",
      "a boolean field takes its value after '='",
    ),
  ]:
    result = subprocess.run(
      _cli(tmp_path, *flag.split()), capture_output=True, text=True, env=env
    )
    assert result.returncode == 2, result.stderr
    assert message in result.stderr
    assert len(result.stderr.strip().splitlines()) <= 3, result.stderr
    assert "Traceback" not in result.stderr
    assert not (tmp_path / "metrics.jsonl").exists()


@pytest.mark.parametrize(
  "flags,message",
  [
    (
      [
        "--config.schedule.name=async",
        "--config.staleness.stashing=True",
        "--config.staleness.gap_aware=ga",
        "--config.schedule.step_every=2",
      ],
      "staleness.gap_aware needs schedule.step_every=1 (FTPipe), got 2",
    ),
    (
      ["--config.pipeline.num_stages=16"],
      "16 stages need 16 devices, this run has 8",
    ),
    (
      ["--config.data.train_split=train[:200%]"],
      "config.data.train_split='train[:200%]' is not a split",
    ),
    (
      ["--config.init_from=os.path:join"],
      "from os.path:join: calling it failed (TypeError",
    ),
  ],
)
def test_the_last_tracebacks_are_one_line_errors(tmp_path, flags, message):
  """Each once ended in a 23- to 75-line traceback (issue 37)."""
  result = subprocess.run(
    _cli(tmp_path, "--config.train.steps=2", *flags),
    capture_output=True,
    text=True,
    env=_cli_env(),
  )
  assert result.returncode == 2, result.stderr[-3000:]
  lines = result.stderr.strip().splitlines()
  assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
  assert message in lines[0]
  assert not (tmp_path / "metrics.jsonl").exists()


@pytest.mark.slow
def test_truncated_checkpoint_is_one_line(tmp_path):
  """A checkpoint file cut short: the one-line error alone (the reads
  still under way once printed "Event loop is closed" tracebacks)."""
  train_lib.train_and_evaluate(_config(), str(tmp_path))
  files = glob.glob(
    str(tmp_path / "checkpoints" / "6" / "state" / "**"), recursive=True
  )
  largest = max((f for f in files if os.path.isfile(f)), key=os.path.getsize)
  os.truncate(largest, 100)
  result = subprocess.run(
    _cli(tmp_path, "--config.train.steps=9", "--config.data.batch_size=32"),
    capture_output=True,
    text=True,
    env=_cli_env(),
  )
  assert result.returncode == 2, result.stderr[-3000:]
  lines = result.stderr.strip().splitlines()
  assert len(lines) == 1, result.stderr
  assert "checkpoints/6 is corrupt" in lines[0] and "step 3" in lines[0]


def test_cli_help_lists_the_config_fields(tmp_path):
  result = subprocess.run(
    _cli(tmp_path, "--help"),
    capture_output=True,
    text=True,
    env=_cli_env(),
  )
  assert result.returncode == 0
  assert "  train.steps = 300" in result.stdout
  assert "Pipeline steps (each covers batch_size examples); 0: evaluation" in (
    " ".join(result.stdout.split())  # (Wrapped at 78 columns.)
  )
  assert "Exit status" in result.stdout
  assert "Kept short on purpose" not in result.stdout


def test_sigterm_saves_and_exits_143(tmp_path):
  """A scheduler's SIGTERM: the step finishes, a checkpoint is written,
  and the exit status says the job did not finish."""
  env = _cli_env()
  process = subprocess.Popen(
    _cli(tmp_path, "--config.train.steps=100000"),
    env=env,
    stdout=subprocess.PIPE,
    stderr=subprocess.PIPE,
    text=True,
  )
  deadline = time.time() + 120
  while time.time() < deadline and not metric_log.read_metrics(tmp_path):
    time.sleep(0.05)
  process.send_signal(signal.SIGTERM)
  out, err = process.communicate(timeout=120)
  assert process.returncode == 143, err
  assert "SIGTERM: saved step" in out
  assert checkpoint_lib.Checkpoints(str(tmp_path), 2).latest_step() >= 1


def test_sigterm_off_cadence_says_it_drains_a_stream(
  tmp_path, monkeypatch, capsys
):
  """An outside check found a stream stopped between checkpoints resumed
  on another trajectory (the drain at the stop): the run says so."""
  _sigterm_as_training_begins(monkeypatch)
  config = _config(
    **{
      "train.steps": 4,
      "train.checkpoint_every": 4,
      "schedule.name": "async",
      "staleness.stashing": True,
    }
  )
  with pytest.raises(SystemExit) as stop:
    train_lib.train_and_evaluate(config, str(tmp_path))
  assert stop.value.code == 143
  out = capsys.readouterr().out
  assert "note: SIGTERM between checkpoints drains the asynchronous " in out
  assert "stream at step 1" in out


@pytest.mark.slow
def test_kill_9_then_resume_matches_an_uninterrupted_run(tmp_path):
  env = _cli_env()
  steps = ["--config.train.steps=40", "--config.train.checkpoint_every=5"]
  straight = tmp_path / "straight"
  subprocess.run(
    _cli(straight, *steps), check=True, env=env, capture_output=True
  )
  killed = tmp_path / "killed"
  process = subprocess.Popen(
    _cli(killed, *steps),
    env=env,
    stdout=subprocess.DEVNULL,
    stderr=subprocess.DEVNULL,
  )
  deadline = time.time() + 300
  while time.time() < deadline:
    done = glob.glob(str(killed / "checkpoints" / "1[05]"))
    if done:
      break
    time.sleep(0.05)
  process.send_signal(signal.SIGKILL)
  process.wait()
  result = subprocess.run(
    _cli(killed, *steps), env=env, capture_output=True, text=True
  )
  assert result.returncode == 0, result.stderr
  assert "Resuming from step" in result.stdout
  a, b = _losses(straight), _losses(killed)
  for step in range(36, 41):
    assert a[step] == pytest.approx(b[step], rel=1e-6)


def _tensorboard_scalars(workdir):
  """(tag, step) of every scalar in the workdir's TensorBoard files
  (TFRecord framing: length u64, its CRC u32, the Event, its CRC u32)."""
  out = []
  for path in glob.glob(str(workdir / "tensorboard" / "events.out.*")):
    with open(path, "rb") as f:
      data = f.read()
    i = 0
    while i < len(data):
      (n,) = struct.unpack("<Q", data[i : i + 8])
      event = event_pb2.Event.FromString(data[i + 12 : i + 12 + n])
      i += 12 + n + 4
      out += [(v.tag, event.step) for v in event.summary.value]
  return out


def test_logs_are_window_means_with_prefixes_and_the_run_files(
  tmp_path, capsys
):
  every = tmp_path / "every"
  train_lib.train_and_evaluate(_config(), str(every))
  per_step = _losses(every)
  windows = tmp_path / "windows"
  train_lib.train_and_evaluate(_config(**{"train.log_every": 3}), str(windows))
  rows = metric_log.read_metrics(str(windows))
  train_rows = [r for r in rows if "train/loss" in r]
  assert [r["step"] for r in train_rows] == [3, 6]
  for row in train_rows:  # The mean of the window's steps, not the last.
    steps = range(row["step"] - 2, row["step"] + 1)
    expected = np.mean([per_step[s] for s in steps])
    assert row["train/loss"] == pytest.approx(expected, rel=1e-6)
  # The first window's rate leaves out the compiling step; the second is
  # its own window's (not a running average).
  assert all(r["train/examples_per_second"] > 0 for r in train_rows)
  assert {k for r in rows for k in r if k.startswith("eval/")} == {
    "eval/accuracy"
  }
  assert not any(k in ("loss", "accuracy") for r in rows for k in r)
  written = json.loads((windows / "config.json").read_text())
  assert written["train"]["log_every"] == 3
  plan = json.loads((windows / "plan.json").read_text())
  assert len(plan["stage_devices"]) == 2
  # Without a terminal: plain lines, no progress bar frames.
  out, err = capsys.readouterr()
  assert "step 3/6: train loss" in out and "%|" not in err


def test_progress_bar_count_matches_its_loss(tmp_path, capsys, monkeypatch):
  monkeypatch.setattr(sys.stderr, "isatty", lambda: True)
  train_lib.train_and_evaluate(
    _config(**{"train.eval_every": 100}), str(tmp_path)
  )
  per_step = _losses(tmp_path)
  frames = re.findall(r"(\d+)/6 \[[^\]]*loss=([\d.]+)", capsys.readouterr().err)
  assert frames
  for count, loss in frames:  # Each frame's loss is its count's step's.
    assert float(loss) == pytest.approx(per_step[int(count)], abs=1e-4)


@pytest.mark.slow
def test_resumed_logs_read_as_one_run_and_a_finished_run_says_so(
  tmp_path, capsys, monkeypatch
):
  train_lib.train_and_evaluate(_config(), str(tmp_path))
  # Killed after logging step 6, before its checkpoint landed.
  shutil.rmtree(tmp_path / "checkpoints" / "6")
  first = train_lib.train_and_evaluate(_config(), str(tmp_path))
  rows = metric_log.read_metrics(str(tmp_path))
  steps = [r["step"] for r in rows if "train/loss" in r]
  assert steps == [1, 2, 3, 4, 5, 6]
  scalars = _tensorboard_scalars(tmp_path)
  assert sorted(s for tag, s in scalars if tag == "train/loss") == steps
  assert len(scalars) == len(set(scalars))
  # Run again: nothing to train, said before any data is read.
  capsys.readouterr()
  monkeypatch.setattr(train_lib, "build_task", _no_work)
  again = train_lib.train_and_evaluate(_config(), str(tmp_path))
  out = capsys.readouterr().out
  assert "Nothing to train" in out and "step 6" in out and "nan" not in out
  assert again["eval"] == pytest.approx(first["eval"])


def _no_work(config):
  raise AssertionError("data loaded before a check that needs none")


def test_workdir_and_checkpoint_problems_stop_before_data(
  tmp_path, monkeypatch
):
  train_lib.train_and_evaluate(_config(**{"train.steps": 3}), str(tmp_path))
  monkeypatch.setattr(train_lib, "build_task", _no_work)
  with pytest.raises(
    checkpoint_lib.CheckpointError,
    match=r"another model or optimizer \(config\.model\.kwargs: saved .*32, 32.*"
    r", now .*16, 16",
  ):
    train_lib.train_and_evaluate(
      _config(**{"model.kwargs.hidden": (16, 16)}), str(tmp_path)
    )
  blocker = tmp_path / "a_file"
  blocker.write_text("")
  with pytest.raises(ValueError, match="--workdir .*cannot write there"):
    train_lib.train_and_evaluate(_config(), str(blocker / "work"))
  # (An outside check: a file named checkpoints trained until the first
  # save, then failed; a folder named metrics.jsonl was a traceback.)
  for name, make in (("checkpoints", "file"), ("metrics.jsonl", "folder")):
    odd = tmp_path / f"odd_{name}"
    odd.mkdir()
    if make == "file":
      (odd / name).write_text("")
    else:
      (odd / name).mkdir()
    kind = "a file" if make == "file" else "a folder"
    with pytest.raises(ValueError, match=f"{name} is {kind}, where the run"):
      train_lib.train_and_evaluate(_config(), str(odd))
  if os.geteuid() != 0:  # root writes anywhere
    locked = tmp_path / "locked"
    locked.mkdir(mode=0o500)
    with pytest.raises(ValueError, match="cannot write there"):
      train_lib.train_and_evaluate(_config(), str(locked))


def test_damaged_checkpoints_are_refused(tmp_path):
  """400 bytes garbled inside the largest file, its size unchanged: an
  error naming the checkpoint and the earlier one to resume from (orbax
  notices damage inside a compressed chunk; the checksums the rest)."""
  train_lib.train_and_evaluate(_config(), str(tmp_path / "run"))
  shutil.copytree(tmp_path / "run", tmp_path / "copy")
  _check_changed_entry_fails_checksum(tmp_path / "copy")
  tmp_path = tmp_path / "run"
  files = glob.glob(str(tmp_path / "checkpoints" / "6" / "**"), recursive=True)
  largest = max((f for f in files if os.path.isfile(f)), key=os.path.getsize)
  size = os.path.getsize(largest)
  with open(largest, "r+b") as f:
    f.seek(size // 2)
    f.write(np.random.default_rng(0).bytes(400))
  assert os.path.getsize(largest) == size
  with pytest.raises(
    checkpoint_lib.CheckpointError,
    match=r"checkpoints/6 .*resume from step 3",
  ):
    train_lib.train_and_evaluate(_config(**{"train.steps": 9}), str(tmp_path))


def _check_changed_entry_fails_checksum(tmp_path):
  """Files rewritten in a valid format with one entry changed (what orbax
  cannot notice: the kernel that came back with 1.6e37 entries)."""
  _change_an_entry(tmp_path)
  with pytest.raises(
    checkpoint_lib.CheckpointError,
    match=r"checkpoints/6 \(step 6\) fails its checksum at "
    r".*'head'.*'kernel'.*resume from step 3",
  ):
    train_lib.train_and_evaluate(_config(**{"train.steps": 9}), str(tmp_path))


def _change_an_entry(tmp_path):
  """Rewrites checkpoint 6 of the workdir with one kernel entry changed
  and its recorded checksums kept."""
  manager = ocp.CheckpointManager(str(tmp_path / "checkpoints"))
  saved = manager.restore(
    6,
    args=ocp.args.Composite(
      state=ocp.args.StandardRestore(), meta=ocp.args.JsonRestore()
    ),
  )
  state = jax.tree.map(np.asarray, saved.state)
  kernel = state["params"]["head"]["kernel"]
  kernel[0, 0] = 1.6e37
  manager.close()
  shutil.rmtree(tmp_path / "checkpoints" / "6")
  manager = ocp.CheckpointManager(str(tmp_path / "checkpoints"))
  manager.save(
    6,
    args=ocp.args.Composite(
      state=ocp.args.StandardSave(state), meta=ocp.args.JsonSave(saved.meta)
    ),
  )
  manager.wait_until_finished()
  manager.close()


def test_init_from_a_damaged_checkpoint_is_refused(tmp_path):
  """Fine-tuning from a checkpoint whose arrays fail their checksums is
  refused as resuming is, naming the leaf (it once loaded, evaluated
  lower, then went non-finite)."""
  train_lib.train_and_evaluate(_config(), str(tmp_path / "pre"))
  _change_an_entry(tmp_path / "pre")
  config = _config(**{"init_from": str(tmp_path / "pre")})
  with pytest.raises(
    pretrained.PretrainedError,
    match=r"pre/checkpoints/6 fails its checksum at .*'head'.*'kernel'",
  ):
    train_lib.train_and_evaluate(config, str(tmp_path / "tuned"))
  assert not (tmp_path / "tuned" / "metrics.jsonl").exists()


@pytest.mark.slow
def test_another_models_checkpoints_get_true_advice(tmp_path):
  """A workdir whose latest checkpoint is another model's: the advice
  points at the latest one of this model, or at another workdir when
  none is (it once said "resume from step 3", the other model's too)."""
  ours, other = _config(), _config(**{"model.kwargs.hidden": (16, 16)})
  train_lib.train_and_evaluate(other, str(tmp_path / "other"))
  with pytest.raises(
    checkpoint_lib.CheckpointError,
    match="none of its checkpoints is of this model: use another --workdir",
  ):
    train_lib.train_and_evaluate(ours, str(tmp_path / "other"))
  mixed = tmp_path / "mixed"
  train_lib.train_and_evaluate(_config(**{"train.steps": 3}), str(mixed))
  shutil.copytree(
    tmp_path / "other" / "checkpoints" / "6", mixed / "checkpoints" / "6"
  )
  with pytest.raises(
    checkpoint_lib.CheckpointError,
    match=r"delete the checkpoints after step 3 .* to resume from step 3",
  ):
    train_lib.train_and_evaluate(ours, str(mixed))


def test_divergence_names_the_step(tmp_path):
  """Adam at learning rate 1e3 'finished' with loss 886 before: now it
  stops, naming the step and the fix."""
  config = _config(**{"optimizer.name": "adam", "optimizer.learning_rate": 1e3})
  with pytest.raises(
    train_lib.TrainingDiverged,
    match=r"diverged at step \d+: .* stage \d's params grew most",
  ):
    train_lib.train_and_evaluate(config, str(tmp_path))


def _batch_changed_at(monkeypatch, step, change):
  """The CLI's tasks with ``change(batch)`` applied to step ``step``'s
  batch (``batch_at(step)``, 0-based): bad data found only there."""
  from jpipe.train import tasks

  real_build = tasks.build_task

  def changed_task(config, abstract=False):
    task = real_build(config, abstract)
    real_batch_at = task.batch_at

    def batch_at(k):
      batch = real_batch_at(k)
      return change(dict(batch)) if k == step else batch

    return dataclasses.replace(task, batch_at=batch_at)

  monkeypatch.setattr(train_lib, "build_task", changed_task)
  return real_build


def test_nonfinite_inputs_are_named_as_the_data_not_a_divergence(
  tmp_path, monkeypatch
):
  """A NaN in step 3's batch: the message names the batch's leaf and the
  data as the cause (not the learning rate)."""

  def with_a_nan(batch):
    batch["x"] = np.array(batch["x"], copy=True)
    batch["x"][1] = np.nan
    return batch

  _batch_changed_at(monkeypatch, 2, with_a_nan)
  with pytest.raises(
    train_lib.TrainingDiverged,
    match=r"non-finite at step 3: step 3's batch holds non-finite values "
    r"in \['x'\]; fix the data \(or the task's batch_at\): training did "
    "not diverge",
  ):
    train_lib.train_and_evaluate(_config(), str(tmp_path))


def test_a_label_outside_the_classes_at_the_first_step_is_no_divergence(
  tmp_path, monkeypatch
):
  """Label 99 of 10 classes in step 1's batch (optax's cross entropy is
  NaN there): the message points at what the loss reads and the
  initialisation, not the learning rate (no step had run)."""

  def out_of_range(batch):
    batch["y"] = np.array(batch["y"], copy=True)
    batch["y"][0] = 99
    return batch

  _batch_changed_at(monkeypatch, 0, out_of_range)
  with pytest.raises(train_lib.TrainingDiverged) as raised:
    train_lib.train_and_evaluate(_config(), str(tmp_path))
  message = str(raised.value)
  assert "non-finite at step 1, the run's first: every stage's params" in (
    message
  )
  assert "label outside the model's classes" in message
  assert "learning_rate" not in message


def test_a_failed_resume_leaves_config_json_the_checkpoints(
  tmp_path, monkeypatch, capsys
):
  """A resume at another learning rate that fails before its first
  checkpoint: config.json still holds the config the checkpoint was
  trained with, and the next resume compares against that one."""
  train_lib.train_and_evaluate(_config(**{"train.steps": 3}), str(tmp_path))

  def with_a_nan(batch):
    batch["x"] = np.array(batch["x"], copy=True)
    batch["x"][0] = np.nan
    return batch

  _batch_changed_at(monkeypatch, 4, with_a_nan)  # (Step 5, before 6's save.)
  with pytest.raises(train_lib.TrainingDiverged):
    train_lib.train_and_evaluate(
      _config(**{"optimizer.learning_rate": 0.5}), str(tmp_path)
    )
  written = json.loads((tmp_path / "config.json").read_text())
  assert written["optimizer"]["learning_rate"] == 0.05
  assert written["train"]["steps"] == 3
  monkeypatch.undo()
  capsys.readouterr()
  train_lib.train_and_evaluate(_config(), str(tmp_path))
  out = capsys.readouterr().out
  assert "changed fields (the earlier -> this run's): train.steps: 3 -> 6." in (
    out
  )
  written = json.loads((tmp_path / "config.json").read_text())
  assert written["train"]["steps"] == 6  # (Its checkpoints' config now.)


def test_more_steps_on_resume_names_the_stretched_schedule(tmp_path, capsys):
  """warmup_cosine over 4 steps, resumed for 8: the note says the decay
  now spans 8 and how to keep 4; with schedule_steps=4 the rate stays at
  the schedule's end (0), as the 4-step run left it."""
  cosine = {
    "optimizer.schedule": "warmup_cosine",
    "optimizer.warmup_steps": 1,
    "train.checkpoint_every": 4,
  }
  train_lib.train_and_evaluate(
    _config(**cosine, **{"train.steps": 4}), str(tmp_path / "a")
  )
  shutil.copytree(tmp_path / "a", tmp_path / "b")
  capsys.readouterr()
  train_lib.train_and_evaluate(
    _config(**cosine, **{"train.steps": 8}), str(tmp_path / "a")
  )
  out = capsys.readouterr().out
  assert (
    "Note: optimizer.schedule='warmup_cosine' decays over 8 steps now, 4 "
    "before" in out
  )
  assert "--config.optimizer.schedule_steps=4" in out
  rates = _learning_rates(tmp_path / "a")
  assert rates[4] == pytest.approx(0.0, abs=1e-9) and rates[5] > 0.01
  train_lib.train_and_evaluate(
    _config(**cosine, **{"train.steps": 8, "optimizer.schedule_steps": 4}),
    str(tmp_path / "b"),
  )
  assert "Note: optimizer.schedule" not in capsys.readouterr().out
  rates = _learning_rates(tmp_path / "b")
  assert all(rates[k] == pytest.approx(0.0, abs=1e-9) for k in range(4, 9))


def _learning_rates(workdir):
  with open(os.path.join(workdir, "metrics.jsonl")) as f:
    rows = [json.loads(line) for line in f]
  return {
    r["step"]: r["train/learning_rate"]
    for r in rows
    if "train/learning_rate" in r
  }


def test_a_bad_batch_mid_run_saves_the_steps_before_it(
  tmp_path, monkeypatch, capsys
):
  """Step 5's batch of another shape (found only there): the pipeline's
  own one-line check stops the run, after saving step 4, from which the
  run resumes (with the batch fixed)."""

  def narrower(batch):
    return {**batch, "x": batch["x"][:, :-1]}

  real_build = _batch_changed_at(monkeypatch, 4, narrower)
  config = _config(**{"train.steps": 6, "train.checkpoint_every": 100})
  with pytest.raises(Exception, match="batch"):
    train_lib.train_and_evaluate(config, str(tmp_path))
  assert "Training after step 4 failed: saved step 4 (the last good state)" in (
    capsys.readouterr().out
  )
  monkeypatch.setattr(train_lib, "build_task", real_build)
  train_lib.train_and_evaluate(config, str(tmp_path))
  assert "Resuming from step 4" in capsys.readouterr().out


def test_a_steps_examples_are_its_batchs_own(monkeypatch):
  """Throughput counts the examples a step's batch held: a task's batch
  of another size than data.batch_size (or a short one) counts as it is."""
  from jpipe.train import run as run_lib

  config = _config()
  task = train_lib.build_task(config)
  real_batch_at = task.batch_at

  def batch_at(step):  # Step 2's batch: 16 of the 32 examples.
    batch = real_batch_at(step)
    return {k: v[:16] for k, v in batch.items()} if step == 1 else batch

  task = dataclasses.replace(task, batch_at=batch_at)
  lr = train_lib.learning_rate(config)
  mode = train_lib.build_mode(
    run_lib.describe(config),
    config,
    task,
    train_lib.build_optimizer(config, lr),
    lr,
    print,
  )
  state = mode.init(task)
  counts = []
  for unit in range(3):
    state, outcome = mode.advance(state, unit)
    counts.append(outcome.examples)
  assert counts == [32, 16, 32]


def test_nonfinite_loss_names_the_stage(tmp_path, monkeypatch):
  real_step = jpipe.Pipeline.step

  def poisoned_step(self, state, batch, **kwargs):
    state, metrics = real_step(self, state, batch, **kwargs)
    if state.step == 2:  # Stage 1's first leaf becomes NaN.
      leaves = list(state.stage_params[1])
      leaves[0] = leaves[0] * np.nan
      params = (state.stage_params[0], tuple(leaves))
      state = state._replace(stage_params=params)
      metrics = dict(metrics, loss=np.nan)
    return state, metrics

  monkeypatch.setattr(jpipe.Pipeline, "step", poisoned_step)
  with pytest.raises(
    train_lib.TrainingDiverged,
    match=r"non-finite at step 2: non-finite values in stage 1's params "
    r"\(first: ",
  ):
    train_lib.train_and_evaluate(_config(), str(tmp_path))


def _small_sdpipe_config(steps):
  """configs/sdpipe.py at its smallest: 2 pipelines of a 16-wide MLP,
  epochs of one batch, no simulated heterogeneity."""
  sys.path.insert(0, ROOT)
  from configs import sdpipe

  config = sdpipe.get_config()
  config.model.kwargs.hidden = (16,)
  config.data_parallel.pipelines = 2
  config.data_parallel.epoch_batches = 1
  config.data_parallel.hetero = 0.0
  config.data_parallel.simulated_ms = 0.0
  config.train.steps = steps
  return config


def _sigterm_as_training_begins(monkeypatch):
  """Runs see a SIGTERM as their first unit begins (the stop request set
  on entering it); returns the real ``StopRequest.__enter__``."""
  enter = stopping.StopRequest.__enter__

  def signalled(self):
    out = enter(self)
    self.signal = "SIGTERM"
    return out

  monkeypatch.setattr(stopping.StopRequest, "__enter__", signalled)
  return enter


def test_data_parallel_nonfinite_loss_names_each_pipelines_loss(
  tmp_path, monkeypatch
):
  """SD-Pipe's mode: a non-finite epoch loss stops the run with each
  pipeline's mean loss of the epoch in the message."""
  import dataclasses

  from jpipe import parallel

  config = _small_sdpipe_config(steps=2)
  real_epoch = parallel.DataParallelPipelines.run_epoch

  def poisoned_epoch(self, states, batch_at, **kwargs):
    states, report = real_epoch(self, states, batch_at, **kwargs)
    losses = [[float("nan")] * len(ls) for ls in report.losses]
    return states, dataclasses.replace(report, losses=losses)

  monkeypatch.setattr(
    parallel.DataParallelPipelines, "run_epoch", poisoned_epoch
  )
  with pytest.raises(
    train_lib.TrainingDiverged,
    match=r"non-finite at step 1 \(epoch 1\): per pipeline \[nan, nan\]",
  ):
    train_lib.train_and_evaluate(config, str(tmp_path))


def test_data_parallel_sigterm_ends_the_epoch_and_checkpoints(
  tmp_path, monkeypatch, capsys
):
  """A SIGTERM during a data-parallel run: the epoch under way ends, its
  checkpoint is written, the run exits with 143 and the same command
  resumes from the next epoch."""
  config = _small_sdpipe_config(steps=3)
  enter = _sigterm_as_training_begins(monkeypatch)
  with pytest.raises(SystemExit) as stop:
    train_lib.train_and_evaluate(config, str(tmp_path))
  assert stop.value.code == 143
  assert "SIGTERM: saved step 1 (epoch 1)" in capsys.readouterr().out
  # Its run files, as a pipeline run's (a data-parallel run wrote none:
  # the config to rebuild its model was nowhere but a repr in metadata).
  written = json.loads((tmp_path / "config.json").read_text())
  assert written["data_parallel"]["pipelines"] == 2
  assert json.loads((tmp_path / "plan.json").read_text())["stage_devices"]
  monkeypatch.setattr(stopping.StopRequest, "__enter__", enter)
  train_lib.train_and_evaluate(config, str(tmp_path))
  assert "Resuming from epoch 1" in capsys.readouterr().out


def test_data_parallel_sigterm_cuts_a_long_epoch_and_the_resume_ends_it(
  tmp_path, monkeypatch, capsys
):
  """A SIGTERM early in a long data-parallel epoch (a preemption notice
  shorter than the epoch): each pipeline stops after its step under way,
  the checkpoint is at the steps trained (not the epoch's end), and the
  resumed run trains the rest of that epoch first: epochs end, evaluate
  and checkpoint at the same steps as an uninterrupted run's."""
  config = _small_sdpipe_config(steps=8)
  config.data_parallel.epoch_batches = 4
  enter = _sigterm_as_training_begins(monkeypatch)
  with pytest.raises(SystemExit) as stop:
    train_lib.train_and_evaluate(config, str(tmp_path))
  assert stop.value.code == 143
  out = capsys.readouterr().out
  # One step each (the least an epoch trains), not the epoch's four.
  assert "epoch 1 cut short by a stop request after 1 of 4 steps" in out
  assert "SIGTERM: saved step 1 (epoch 0 + 1 steps)" in out
  meta = json.loads(
    (tmp_path / "checkpoints" / "1" / "meta" / "metadata").read_text()
  )
  assert meta["data_position"] == 2  # Each pipeline's one batch.
  monkeypatch.setattr(stopping.StopRequest, "__enter__", enter)
  train_lib.train_and_evaluate(config, str(tmp_path))
  out = capsys.readouterr().out
  assert "Resuming from epoch 0 + 1 steps" in out
  rows = [json.loads(x) for x in open(tmp_path / "metrics.jsonl")]
  evaluated = {r["step"] for r in rows if any(k.startswith("eval/") for k in r)}
  assert sorted(evaluated) == [4, 8]
  assert sorted(os.listdir(tmp_path / "checkpoints"))[-2:] == ["4", "8"]


@pytest.mark.slow
def test_dynamic_repartitions_logs_draws_and_resumes_on_its_split(
  tmp_path, capsys
):
  """configs/dynpipe.py small: device 1 slowed 6x from step 4 to 10, a
  window every 2 steps: a re-partition line at step 8 (the second window
  that saw it) moving nodes off slot 1 and another once the slowdown
  ended, within 16 steps (a window measured while other tests load the
  machine may miss it: 4 and 8 steps each failed once in CI, so eight
  windows are given; where to: the best split
  for the measured times, which a busy machine blurs in one process;
  tests/dynamic and the multi-process test check the way back), both in
  metrics.jsonl, dynamic.png drawn; a checkpoint records the split in
  force and a run resumed from it continues on that split."""
  sys.path.insert(0, ROOT)
  from configs import dynpipe

  config = dynpipe.get_config()
  # 12 nodes, 3 a stage: a node moved is a clear loss once the slowdown
  # ends (with the config's 8, the two splits are within 2 %).
  config.model.kwargs.hidden = (128,) * 11
  config.dynamic.window = 2
  config.dynamic.inject = "1:6.0:4:10"
  config.dynamic.horizon_steps = 500  # (The cost rule: tests/dynamic.)
  config.train.steps = 26
  config.train.checkpoint_every = 9
  config.train.keep_checkpoints = 3  # Steps 9, 18 and 26.
  config.train.eval_every = 26
  config.train.profile_last_step = False
  summary = train_lib.train_and_evaluate(config, str(tmp_path))
  out = capsys.readouterr().out
  assert "\nre-partition at step 8: [0:3 | 3:6 | 6:9 | 9:12] -> " in out
  moved, back = summary["repartitions"][:2]
  # Which times the line compares: measured and simulated on the old split.
  assert (
    f"s per step on the old split: measured {moved['measured_seconds']:.4f}, "
    f"simulated {moved['predicted_old_seconds']:.4f} -- the schedule's "
    f"compute alone --; on the new: simulated "
    f"{moved['predicted_new_seconds']:.4f}; switch" in out
  )
  assert moved["new"][2] - moved["new"][1] < 3  # Slot 1 holds less.
  assert 10 < back["step"] <= 26  # Its slowdown ended: planned again.
  assert os.path.exists(summary["dynamic_png"])
  rows = [json.loads(x) for x in open(tmp_path / "metrics.jsonl")]
  assert [r["step"] for r in rows if "repartition" in r][:2] == [
    8,
    back["step"],
  ]
  # Resume from step 9's checkpoint (split moved) instead of the later
  # ones (18's may hold either split; 26's the first).
  for later in ("18", "26"):
    shutil.rmtree(tmp_path / "checkpoints" / later)
  config.train.steps = 10
  train_lib.train_and_evaluate(config, str(tmp_path))
  out = capsys.readouterr().out
  assert f"Resuming on the split in force: {_split(moved['new'])}" in out


@pytest.mark.slow
def test_slowdown_predictor_fitted_by_its_cli_drives_a_training_run(
  tmp_path, capsys
):
  """``jpipe.train.slowdowns`` on a small config writes a predictor and
  its data; training with ``dynamic.predictor`` set re-partitions off a
  slowed device with it (the line, and the forest's expected slowdowns
  in metrics.jsonl)."""
  from jpipe.train import slowdowns

  config = _config(
    **{
      "dynamic.enabled": True,
      "dynamic.window": 2,
      "dynamic.simulated_ms": 20.0,
      "dynamic.horizon_steps": 500,
      "model.kwargs.hidden": (32,) * 4,
    }
  )
  out = str(tmp_path / "rf.pkl")
  info = slowdowns.collect_and_fit(config, out, ["2", "4"], 3, 1, 20)
  assert info["samples"] == 3 * 3 * 2 * 2  # Split pairs x factors x slots.
  assert os.path.exists(out) and os.path.exists(out + ".json")
  assert "held-out mean absolute error" in capsys.readouterr().out
  config.dynamic.predictor = out
  config.dynamic.inject = "1:6.0:4"  # After the reference window (step 4).
  config.train.steps = 8
  summary = train_lib.train_and_evaluate(config, str(tmp_path / "run"))
  assert "\nre-partition at step 8: " in capsys.readouterr().out
  record = summary["repartitions"][0]
  assert record["new"][1] > record["old"][1]  # Slot 1 holds less.
  # The forest's slowdowns for the new split, logged with the switch.
  rows = [json.loads(x) for x in open(tmp_path / "run" / "metrics.jsonl")]
  logged = [r["repartition"] for r in rows if "repartition" in r][0]
  assert logged["expected_sigma"] == record["expected_sigma"]
  assert len(record["expected_sigma"]) == 2


def _split(boundaries):
  pairs = zip(boundaries[:-1], boundaries[1:], strict=True)
  return "[" + " | ".join(f"{a}:{b}" for a, b in pairs) + "]"


def _readme_slowdowns(out):
  """The README's ``jpipe.train.slowdowns`` command as written, writing
  to ``out``, measuring 2 splits with one factor (its defaults: 8 x 4)."""
  from tests.distributed.test_readme_commands import readme_command

  command = readme_command("jpipe.train.slowdowns")
  command[command.index("--out") + 1] = out
  return command + [
    "--splits=2", "--factors=2", "--steps_per_window=1", "--trees=5"
  ]  # fmt: skip


def _run_cli(command):
  done = subprocess.run(
    command, env=_cli_env(), cwd=ROOT, capture_output=True, text=True,
    timeout=300,
  )  # fmt: skip
  assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
  return done.stdout


def test_readme_slowdowns_command_fits_and_writes_a_predictor(tmp_path):
  """The README's predictor-fitting command (configs/dynpipe.py), run as
  written with fewer splits and trees: the held-out line, the pickle and
  its data, which loads as a predictor of the config's model."""
  out = str(tmp_path / "rf.pkl")
  stdout = _run_cli(_readme_slowdowns(out))
  assert "16 samples from 2 splits x 1 factors; held-out mean absolute " in (
    stdout
  )
  assert f"Predictor: {out} (use --config.dynamic.predictor={out})" in stdout
  forest = jpipe.dynamic.SlowdownPredictor.load(out)
  assert forest.info["samples"] == 16
  with open(out + ".json") as f:
    assert len(json.load(f)["splits"]) == 2


@pytest.mark.slow
def test_readme_trains_with_the_fitted_predictor(tmp_path):
  """The README's two predictor commands in turn, as written (fewer
  splits and trees; 6 steps): training loads the fitted forest."""
  from tests.distributed.test_readme_commands import _with, readme_command

  out = str(tmp_path / "rf.pkl")
  _run_cli(_readme_slowdowns(out))
  command = readme_command("--config.dynamic.predictor=/tmp/rf.pkl")
  command = _with(command, tmp_path / "run", "--config.train.steps=6")
  command = [
    f"--config.dynamic.predictor={out}" if "predictor=" in w else w
    for w in command
  ]
  stdout = _run_cli(command)
  assert "Done: 6 steps" in stdout
  with open(tmp_path / "run" / "config.json") as f:
    assert out in f.read()


@pytest.mark.parametrize(
  "args, message",
  [
    ((["2", "x"], 3, 1, 20), "--factors: ['2', 'x'] are not numbers"),
    ((["2"], 0, 1, 20), "--splits, --steps_per_window and --trees: >= 1"),
    ((["2"], 3, 1, 0), "--splits, --steps_per_window and --trees: >= 1"),
  ],
)
def test_slowdowns_cli_refuses_bad_flags_before_any_work(
  tmp_path, args, message
):
  """``jpipe.train.slowdowns``' flags checked before a pipeline is built
  (the collection itself: the slow test above)."""
  from jpipe.train import errors, slowdowns

  with pytest.raises(errors.UsageError, match=re.escape(message)):
    slowdowns.collect_and_fit(_config(), str(tmp_path / "rf.pkl"), *args)
  unwritable = str(tmp_path / "missing" / "rf.pkl")
  with pytest.raises(errors.UsageError, match="--out: cannot write in"):
    slowdowns.collect_and_fit(_config(), unwritable, ["2"], 3, 1, 20)


def test_a_resume_whose_optimizer_state_changed_layout_names_the_change(
  tmp_path,
):
  """SGD momentum off on resume: the checkpoint is sound, its optimizer
  state laid out otherwise; the error says so and which fields changed
  (not 'corrupt': deleting it would fix nothing)."""
  train_lib.train_and_evaluate(_config(**{"train.steps": 3}), str(tmp_path))
  with pytest.raises(checkpoint_lib.CheckpointLayoutError) as error:
    train_lib.train_and_evaluate(
      _config(**{"train.steps": 6, "optimizer.momentum": 0.0}), str(tmp_path)
    )
  message = str(error.value)
  assert "holds a state laid out unlike this run's" in message
  assert "delete" not in message and "\n" not in message
  assert message.endswith(
    "Changed since (config.json -> now): optimizer.momentum: 0.9 -> 0.0; "
    "train.steps: 3 -> 6"
  )


def test_skip_nonfinite_trains_past_nonfinite_steps(tmp_path):
  """A learning rate that blows the params up: without the option the run
  stops at the first non-finite loss; with it every later step skips,
  and the log counts them. Streams are refused before any work."""
  blow_up = {"optimizer.learning_rate": 1e30, "train.steps": 4}
  with pytest.raises(jpipe.train.errors.TrainingDiverged, match="non-finite"):
    train_lib.train_and_evaluate(_config(**blow_up), str(tmp_path / "a"))
  config = _config(**blow_up, **{"optimizer.skip_nonfinite": True})
  train_lib.train_and_evaluate(config, str(tmp_path / "b"))
  rows = metric_log.read_metrics(tmp_path / "b")
  skipped = [r.get("train/skipped_steps", 0) for r in rows if "step" in r]
  assert sum(skipped) >= 1
  config = _config(
    **{"optimizer.skip_nonfinite": True, "schedule.name": "async"}
  )
  with pytest.raises(ValueError, match="skip_nonfinite: needs a synchronous"):
    train_lib.train_and_evaluate(config, str(tmp_path / "c"))


def test_a_dynamic_loss_scale_grows_logs_and_resumes_from_its_checkpoint(
  tmp_path,
):
  """config.optimizer.loss_scale=dynamic: the scale each step used is
  logged, doubles after loss_scale_window finite steps, and a resumed run
  goes on from the checkpoint's scale and count. Bad values are refused
  before any work, naming the field."""
  dynamic = {
    "optimizer.loss_scale": "dynamic",
    "optimizer.loss_scale_window": 2,
  }
  train_lib.train_and_evaluate(
    _config(**dynamic, **{"train.steps": 3}), str(tmp_path / "a")
  )
  train_lib.train_and_evaluate(
    _config(**dynamic, **{"train.steps": 5}), str(tmp_path / "a")
  )
  rows = metric_log.read_metrics(tmp_path / "a")
  used = {
    r["step"]: r["train/loss_scale"] for r in rows if "train/loss_scale" in r
  }
  start = 2.0**15  # (Step 3 leaves (2**16, 1 finite step) in its checkpoint.)
  assert used == {1: start, 2: start, 3: 2 * start, 4: 2 * start, 5: 4 * start}
  # DynPipe's mode (its split may move) logs it too.
  moving = {"dynamic.enabled": True, "dynamic.policy": "static"}
  train_lib.train_and_evaluate(
    _config(**dynamic, **moving, **{"train.steps": 2}), str(tmp_path / "d")
  )
  rows = metric_log.read_metrics(tmp_path / "d")
  assert [r["train/loss_scale"] for r in rows if "train/loss_scale" in r] == [
    start,
    start,
  ]
  static = _config(**{"optimizer.loss_scale": "4096"})
  assert config_options.loss_scale(static) == 4096.0
  assert config_options.loss_scale(_config()) is None
  for overrides, match in [
    ({"optimizer.loss_scale": "big"}, "loss_scale: 'big' is not a loss"),
    ({"optimizer.loss_scale": "0"}, "loss_scale: '0' is not a loss"),
    (
      {**dynamic, "optimizer.loss_scale_window": 0},
      "loss_scale_window: must be an int >= 1",
    ),
    (
      {**dynamic, "schedule.name": "async"},
      "loss_scale: 'dynamic' needs a synchronous schedule",
    ),
  ]:
    with pytest.raises(ValueError, match=match):
      train_lib.train_and_evaluate(_config(**overrides), str(tmp_path / "b"))
