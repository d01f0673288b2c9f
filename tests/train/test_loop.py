"""The training loop apart from any pipeline: a mode of its own (NumPy
least squares, three steps a unit) run by ``jpipe.train.loop.train``."""

import dataclasses
import json
import os
import re
import shutil

import numpy as np
import pytest

from jpipe.train import base_config, loop
from jpipe.train import checkpoint as checkpoint_lib
from jpipe.train import run as run_lib
from jpipe.train.errors import TrainingDiverged
from tests.train.test_train import _sigterm_as_training_begins

TRUE_W = np.array([1.0, -2.0, 0.5])


@dataclasses.dataclass
class _Task:
  """y = x @ TRUE_W; batch i is drawn from seed i."""

  params: np.ndarray = dataclasses.field(default_factory=lambda: np.zeros(3))
  model_state: None = None

  def batch_at(self, i):
    x = np.random.default_rng(i).normal(size=(16, 3))
    return x, x @ TRUE_W

  def evaluate(self, params, model_state):
    x, y = self.batch_at(10_000)
    return {"mse": float(np.mean((x @ params - y) ** 2))}


class _LeastSquares(loop.Mode):
  """Plain SGD on ``_Task``, ``unit_steps`` batches a unit."""

  def __init__(self, task, unit_steps, lr, poison_at=None):
    self.task, self.unit_steps, self.lr = task, unit_steps, lr
    self.poison_at = poison_at  # A unit whose loss is NaN.
    self.advanced = []

  def init(self, task):
    return {"w": task.params.copy()}

  def restore(self, state, saved, meta, say):
    return {"w": np.asarray(saved["w"])}

  def advance(self, state, unit):
    self.advanced.append(unit)
    w, losses = state["w"], []
    for i in range(unit * self.unit_steps, (unit + 1) * self.unit_steps):
      x, y = self.task.batch_at(i)
      err = x @ w - y
      losses.append(np.mean(err**2))
      w = w - self.lr * 2 * x.T @ err / len(y)
    loss = np.nan if unit == self.poison_at else float(np.mean(losses))
    return {"w": w}, loop.Outcome(loss, 16 * self.unit_steps, note="ls")

  def evaluation_inputs(self, state):
    return state["w"], None

  def state_dict(self, state):
    return state


def _train(workdir, mode, steps, **train):
  config = base_config.base_config()
  config.train.steps = steps
  for k, v in train.items():
    setattr(config.train, k, v)
  run = run_lib.Run("pipeline", steps, 1, {"model": "least squares"})
  checkpoints = checkpoint_lib.Checkpoints(str(workdir), 3)
  return loop.train(
    mode,
    mode.task,
    config=config,
    run=run,
    workdir=str(workdir),
    checkpoints=checkpoints,
    lr=0.05,
    fine_tune=False,
    say=print,
  )


def _rows(workdir):
  return [json.loads(x) for x in open(workdir / "metrics.jsonl")]


def test_units_of_several_steps_log_evaluate_and_save_at_the_multiples_they_reach(
  tmp_path, capsys
):
  """7 steps in units of 3: units end at 3, 6, 9; every 4 steps is
  reached by the units ending at 6 (4) and 9 (8), and the last unit does
  everything. The loss falls; the metrics hold one row per logged unit."""
  mode = _LeastSquares(_Task(), 3, 0.1)
  every = {"log_every": 4, "eval_every": 4, "checkpoint_every": 4}
  summary = _train(tmp_path, mode, 7, **every)
  assert mode.advanced == [0, 1, 2]
  rows = _rows(tmp_path)
  assert [r["step"] for r in rows] == [6, 9]
  assert all("train/loss" in r and "eval/mse" in r for r in rows)
  assert (
    summary["eval"]["mse"] < 0.05 * _Task().evaluate(np.zeros(3), None)["mse"]
  )
  out = capsys.readouterr().out
  assert "step 6/7: train loss" in out and ", ls" in out
  ckpt = checkpoint_lib.Checkpoints(str(tmp_path), 3)
  assert ckpt.latest_step() == 9
  ckpt.close()


def test_a_resumed_run_continues_where_the_checkpoint_left_off(tmp_path):
  """Stopped after its second unit, the run resumes at its third; the
  result equals an uninterrupted run's."""
  whole = _LeastSquares(_Task(), 2, 0.1)
  straight = _train(tmp_path / "a", whole, 8, checkpoint_every=4)
  first = _LeastSquares(_Task(), 2, 0.1)
  _train(tmp_path / "b", first, 4, checkpoint_every=4)
  second = _LeastSquares(_Task(), 2, 0.1)
  resumed = _train(tmp_path / "b", second, 8, checkpoint_every=4)
  assert second.advanced == [2, 3]
  assert resumed["eval"]["mse"] == pytest.approx(straight["eval"]["mse"])


def test_a_non_finite_unit_stops_the_run_naming_where(tmp_path):
  mode = _LeastSquares(_Task(), 3, 0.1, poison_at=1)
  with pytest.raises(TrainingDiverged, match=r"non-finite at step 6: the loss"):
    _train(tmp_path, mode, 9)


def test_a_stop_request_saves_and_exits_unless_the_run_is_done(
  tmp_path, monkeypatch, capsys
):
  """SIGTERM before the last unit: checkpoint and 143. At the last unit
  the run is finished anyway: it ends normally."""
  _sigterm_as_training_begins(monkeypatch)
  with pytest.raises(SystemExit) as stop:
    _train(tmp_path / "a", _LeastSquares(_Task(), 3, 0.1), 9)
  assert stop.value.code == 143
  assert "SIGTERM: saved step 3 to" in capsys.readouterr().out
  summary = _train(tmp_path / "b", _LeastSquares(_Task(), 9, 0.1), 9)
  assert summary["eval"] is not None


def _meta_path(workdir, step):
  return workdir / "checkpoints" / str(step) / "meta" / "metadata"


def _edit_meta(workdir, step, edit):
  path = _meta_path(workdir, step)
  meta = json.loads(path.read_text())
  edit(meta)
  path.write_text(json.dumps(meta))


def test_checkpoints_of_two_runs_in_one_workdir_are_refused(tmp_path):
  """A resumed run keeps its run's id; a checkpoint copied in from
  another run (same model) beside this run's was resumed silently, the
  other run's state under this run's metrics: now one error naming both
  runs' steps."""
  for run in ("a", "b"):
    _train(
      tmp_path / run, _LeastSquares(_Task(), 2, 0.1), 4, checkpoint_every=2
    )
  _train(tmp_path / "a", _LeastSquares(_Task(), 2, 0.1), 6, checkpoint_every=2)
  ids = {
    s: json.loads(_meta_path(tmp_path / "a", s).read_text())["run"]
    for s in (2, 4, 6)
  }
  assert len(set(ids.values())) == 1
  other = json.loads(_meta_path(tmp_path / "b", 4).read_text())["run"]
  assert other != ids[2]
  shutil.copytree(
    tmp_path / "b" / "checkpoints" / "4",
    tmp_path / "mixed" / "checkpoints" / "4",
  )
  shutil.copytree(
    tmp_path / "a" / "checkpoints" / "2",
    tmp_path / "mixed" / "checkpoints" / "2",
  )
  with pytest.raises(
    checkpoint_lib.CheckpointError,
    match=rf"two runs: steps \[4\] of run {other} \(the latest, step 4\) "
    rf"and steps \[2\] of run {ids[2]} .*delete steps \[2\] to resume run "
    rf"{other} from step 4",
  ):
    _train(tmp_path / "mixed", _LeastSquares(_Task(), 2, 0.1), 8)


def test_a_checkpoint_whose_metadata_names_another_step_is_refused(tmp_path):
  """Metadata saying step 2 in directory 4 resumed at step 2 and then
  failed to save over checkpoint 4, whose advice was to run it again."""
  _train(tmp_path, _LeastSquares(_Task(), 2, 0.1), 4, checkpoint_every=2)
  _edit_meta(tmp_path, 4, lambda meta: meta.update(step=2))
  mode = _LeastSquares(_Task(), 2, 0.1)
  with pytest.raises(
    checkpoint_lib.CheckpointError,
    match=r"checkpoints/4 says step 2 in its metadata: its directory was "
    r"renamed or its metadata edited; delete \S+/4 to resume from step 2",
  ):
    _train(tmp_path, mode, 8)
  assert mode.advanced == []


def test_a_checkpoint_without_checksums_resumes_with_a_warning(
  tmp_path, capsys
):
  """Without its checksums no damage can be found: said, not silent."""
  _train(tmp_path, _LeastSquares(_Task(), 2, 0.1), 4, checkpoint_every=2)
  _edit_meta(tmp_path, 4, lambda meta: meta.pop("checksums"))
  capsys.readouterr()
  mode = _LeastSquares(_Task(), 2, 0.1)
  _train(tmp_path, mode, 6)
  assert mode.advanced == [2]
  assert "checkpoints/4 records no checksums" in capsys.readouterr().out


def test_a_checkpoint_missing_its_manifest_is_one_short_line(tmp_path):
  """tensorstore's error carried ~2 KB of JSON specs."""
  _train(tmp_path, _LeastSquares(_Task(), 2, 0.1), 4, checkpoint_every=2)
  os.remove(tmp_path / "checkpoints" / "4" / "state" / "manifest.ocdbt")
  with pytest.raises(checkpoint_lib.CheckpointError) as error:
    _train(tmp_path, _LeastSquares(_Task(), 2, 0.1), 6)
  message = str(error.value)
  assert len(message) < 500 and "tensorstore_spec" not in message
  assert re.search(
    r"checkpoints/4 is corrupt or incompatible \(array 'w': NOT_FOUND: .*\); "
    r"delete \S+/4 to resume from step 2",
    message,
  )


def test_a_resumed_runs_training_clock_goes_on(tmp_path):
  """time/train_seconds went back to 0 at a resume: the time-to-target
  curves of resumed runs started over."""
  _train(tmp_path, _LeastSquares(_Task(), 2, 0.1), 6, log_every=2)
  before = [r["time/train_seconds"] for r in _rows(tmp_path)]
  _train(tmp_path, _LeastSquares(_Task(), 2, 0.1), 10, log_every=2)
  clock = [r["time/train_seconds"] for r in _rows(tmp_path)]
  assert clock[: len(before)] == before and before[-1] > 0
  assert all(b >= a for a, b in zip(clock, clock[1:], strict=False))


def _stopped_after_first_unit(monkeypatch, workdir, mode, steps, **train):
  """``_train`` with a SIGTERM from the start: it saves after its first
  unit and exits 143."""
  with monkeypatch.context() as m:
    _sigterm_as_training_begins(m)
    with pytest.raises(SystemExit) as stop:
      _train(workdir, mode, steps, **train)
  assert stop.value.code == 143


def test_a_stop_between_log_lines_resumes_its_log_window(tmp_path, monkeypatch):
  """An outside check stopped a run at step 16 of a 5-step log window:
  the resumed run's line at 20 averaged steps 17-20 (step 16 never
  logged). The checkpoint now keeps the window: the same rows as an
  uninterrupted run, and the divergence reference of its first step."""
  every = {"log_every": 4, "checkpoint_every": 4}
  _train(tmp_path / "a", _LeastSquares(_Task(), 1, 0.1), 8, **every)
  _stopped_after_first_unit(
    monkeypatch, tmp_path / "b", _LeastSquares(_Task(), 1, 0.1), 8, **every
  )
  meta = json.loads(_meta_path(tmp_path / "b", 1).read_text())
  assert meta["log_window"]["first_step"] == 1
  assert len(meta["log_window"]["losses"]) == 1
  assert meta["divergence_start"][1] == 1
  _train(tmp_path / "b", _LeastSquares(_Task(), 1, 0.1), 8, **every)
  straight, resumed = _rows(tmp_path / "a"), _rows(tmp_path / "b")
  assert [r["step"] for r in resumed] == [r["step"] for r in straight]
  for a, b in zip(straight, resumed, strict=True):
    assert b["train/loss"] == pytest.approx(a["train/loss"], rel=1e-12)
  final = json.loads(_meta_path(tmp_path / "b", 8).read_text())
  assert final["divergence_start"] == meta["divergence_start"]


def test_the_divergence_reference_is_the_runs_first_loss_after_a_resume():
  """An outside check resumed at step 250 of a healthy run: the
  resumed run's first loss (0.0089) became the reference and a later
  window of 0.092 stopped it as diverged, on every rerun. The first
  run's reference (its checkpoint's) is kept."""

  class _Norms:
    def param_norms(self, state):
      return [1.0, 2.0] if state == "start" else [1.0, 50.0]

  config = base_config.base_config()
  check = loop._DivergenceCheck(10, start=[2.3, 1])
  check.begin(0.0089, 251, _Norms(), "start")
  assert check.start == (2.3, 1)
  check.check(0.092, 275, 251, config, _Norms(), "now")  # Healthy.
  with pytest.raises(TrainingDiverged, match=r"\(2\.3 at step 1\); stage 1"):
    check.check(24.0, 300, 276, config, _Norms(), "now")
  fresh = loop._DivergenceCheck(10)
  fresh.begin(2.0, 1, _Norms(), "start")
  assert fresh.start == (2.0, 1)
  assert loop._DivergenceCheck(0, start=[2.3, 1]).start is None  # (Off.)


def test_a_run_starting_over_drops_the_rows_of_one_without_checkpoint(
  tmp_path, capsys
):
  """No checkpoint but logs of an earlier run: dropped, said; its
  config.json is not compared as a resumed run's."""
  _train(tmp_path, _LeastSquares(_Task(), 1, 0.1), 2, log_every=1)
  shutil.rmtree(tmp_path / "checkpoints")
  (tmp_path / "config.json").write_text("{}")
  capsys.readouterr()
  _train(tmp_path, _LeastSquares(_Task(), 1, 0.1), 1, log_every=1)
  err = capsys.readouterr().err
  assert "2 rows of an earlier run that left no checkpoint dropped" in err
  assert [r["step"] for r in _rows(tmp_path)] == [1]
  # The earlier run's config.json is gone; this run's checkpoint wrote
  # its own.
  assert json.loads((tmp_path / "config.json").read_text()) != {}
  assert not (tmp_path / "metrics.jsonl.tmp").exists()


class _Skipping(_LeastSquares):
  """``_LeastSquares`` whose unit ``skip_at`` skipped its step (a NaN
  loss, the params unchanged), as ``skip_nonfinite`` reports it."""

  def __init__(self, skip_at, *args):
    super().__init__(*args)
    self.skip_at = skip_at

  def advance(self, state, unit):
    if unit == self.skip_at:
      self.advanced.append(unit)
      return state, loop.Outcome(np.nan, 16, skipped=True)
    return super().advance(state, unit)


@pytest.mark.parametrize("skip_at", [0, 2])
def test_a_skipped_step_is_counted_not_a_divergence(tmp_path, capsys, skip_at):
  """config.optimizer.skip_nonfinite: the run goes on past a step whose
  gradient was not finite, logging it; the window's loss leaves its NaN
  out, and a skipped first unit is no divergence reference."""
  mode = _Skipping(skip_at, _Task(), 1, 0.1)
  _train(tmp_path, mode, 4, log_every=4, divergence_factor=10)
  (row,) = _rows(tmp_path)
  assert row["train/skipped_steps"] == 1
  assert np.isfinite(row["train/loss"])
  assert "1 skipped (non-finite)" in capsys.readouterr().out


def test_an_evaluation_that_fails_saves_the_work_first(tmp_path, capsys):
  """An evaluation error found only at its first evaluation (a task's or
  a config's): the step's checkpoint and metrics row are written before
  the error propagates, so fixing it and resuming loses nothing."""
  task = _Task()
  real = task.evaluate

  def broken(params, model_state):
    raise ValueError("the evaluation has no batches")

  task.evaluate = broken
  mode = _LeastSquares(task, 1, 0.1)
  every = {"log_every": 1, "eval_every": 4, "checkpoint_every": 100}
  with pytest.raises(ValueError, match="the evaluation has no batches"):
    _train(tmp_path, mode, 8, **every)
  out = capsys.readouterr().out
  assert "The evaluation at step 4 failed: saved step 4 to " in out
  assert [r["step"] for r in _rows(tmp_path)] == [1, 2, 3, 4]
  task.evaluate = real  # Fixed: resumes at step 4.
  mode = _LeastSquares(task, 1, 0.1)
  _train(tmp_path, mode, 8, **every)
  assert mode.advanced == [4, 5, 6, 7]
  assert [r["step"] for r in _rows(tmp_path)] == list(range(1, 9))


def test_a_unit_that_fails_saves_the_state_before_it(tmp_path, capsys):
  """A step that raises (a bad batch found only at its step): the state
  after the steps before it is saved, then the error propagates; the run
  resumed once it is fixed ends as an uninterrupted one."""

  class BadBatchAt(_LeastSquares):
    def advance(self, state, unit):
      if unit == 5:
        raise ValueError("batch 5 has the wrong shape")
      return super().advance(state, unit)

  every = {"log_every": 1, "eval_every": 100, "checkpoint_every": 100}
  straight = _train(tmp_path / "a", _LeastSquares(_Task(), 1, 0.1), 8, **every)
  with pytest.raises(ValueError, match="batch 5 has the wrong shape"):
    _train(tmp_path / "b", BadBatchAt(_Task(), 1, 0.1), 8, **every)
  assert (
    "Training after step 5 failed: saved step 5 (the last good state); fix "
    "the error below" in capsys.readouterr().out
  )
  mode = _LeastSquares(_Task(), 1, 0.1)
  resumed = _train(tmp_path / "b", mode, 8, **every)
  assert mode.advanced == [5, 6, 7]
  assert resumed["eval"]["mse"] == pytest.approx(straight["eval"]["mse"])
