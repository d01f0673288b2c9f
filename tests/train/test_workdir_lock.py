"""The workdir lock: a second run on a live run's workdir is refused in
one line naming the holder's host and pid, before any work; a lock left
by a killed run is taken over with a note; one process trains in a
workdir again and again; the processes of one run follow process 0."""

import errno
import os
import re
import signal
import socket
import subprocess
import sys
import time

import pytest

from jpipe.train import train_lib, workdir_lock

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(__file__)))
sys.path.insert(0, os.path.join(ROOT, "configs"))
import default as default_config  # noqa: E402

# A live run's stand-in: takes the lock, says so, waits to be killed.
_HOLD = """
import sys, time
from jpipe.train import workdir_lock
workdir_lock.WorkdirLock(sys.argv[1]).acquire()
print("held", flush=True)
time.sleep(600)
"""


class _Holder:
  """A process holding ``workdir``'s lock until ``kill``."""

  def __init__(self, workdir):
    self.workdir = str(workdir)
    self.process = subprocess.Popen(
      [sys.executable, "-c", _HOLD, self.workdir],
      env=dict(os.environ, PYTHONPATH=ROOT),
      stdout=subprocess.PIPE,
      text=True,
      start_new_session=True,
    )
    assert self.process.stdout.readline() == "held\n"
    self.pid = self.process.pid

  def kill(self):
    if self.process.poll() is None:
      self.process.send_signal(signal.SIGKILL)
    self.process.wait()
    self.process.stdout.close()


@pytest.fixture(scope="module")
def live(tmp_path_factory):
  """A workdir a live process holds."""
  holder = _Holder(tmp_path_factory.mktemp("live"))
  yield holder
  holder.kill()


# A start time of today (with the date on a test run across midnight).
_TIME = r"(\d{4}-\d\d-\d\d )?\d\d:\d\d:\d\d"


def _refusal(holder) -> str:
  """The one line that names ``holder``."""
  return (
    rf"--workdir {re.escape(holder.workdir)} is in use by another run "
    rf"\(pid {holder.pid} on host {re.escape(socket.gethostname())}, "
    rf"since {_TIME}\); wait for it to finish, stop it, or use "
    r"another --workdir"
  )


def test_a_second_acquisition_is_refused_naming_the_live_holder(live):
  with pytest.raises(workdir_lock.WorkdirInUse) as refused:
    workdir_lock.WorkdirLock(live.workdir).acquire()
  assert re.fullmatch(_refusal(live), str(refused.value))
  with pytest.raises(workdir_lock.WorkdirInUse, match=_refusal(live)):
    with workdir_lock.held(live.workdir):
      raise AssertionError("entered a workdir another run holds")
  # The holder's details are left as they were.
  with open(os.path.join(live.workdir, workdir_lock.FILE_NAME)) as f:
    assert workdir_lock.Holder.parse(f.read()).pid == live.pid


def _no_work(*args, **kwargs):
  raise AssertionError("work began in a workdir another run holds")


def test_train_and_evaluate_refuses_before_any_work(live, monkeypatch):
  monkeypatch.setattr(train_lib.checkpoint_lib, "Checkpoints", _no_work)
  monkeypatch.setattr(train_lib, "build_task", _no_work)
  with pytest.raises(workdir_lock.WorkdirInUse, match=_refusal(live)):
    train_lib.train_and_evaluate(default_config.get_config(), live.workdir)
  assert os.listdir(live.workdir) == [workdir_lock.FILE_NAME]


def test_the_cli_refuses_a_second_run_in_one_line(live):
  result = subprocess.run(
    [
      sys.executable,
      "-m",
      "jpipe.train",
      "--config",
      os.path.join(ROOT, "configs", "default.py"),
      "--workdir",
      live.workdir,
      "--config.model.kwargs.hidden=(32,32)",
      "--config.pipeline.num_stages=2",
      "--config.train.steps=2",
    ],
    capture_output=True,
    text=True,
    env=dict(os.environ, PYTHONPATH=ROOT),
    timeout=120,
  )
  assert result.returncode == 2, result.stderr[-3000:]
  lines = result.stderr.strip().splitlines()
  assert len(lines) == 1, result.stderr
  assert re.fullmatch("error: " + _refusal(live), lines[0])
  assert os.listdir(live.workdir) == [workdir_lock.FILE_NAME]


def test_a_lock_left_by_a_killed_run_is_taken_over_with_a_note(tmp_path):
  killed = _Holder(tmp_path)
  killed.kill()  # SIGKILL: no release, the file still names it.
  notes = []
  with workdir_lock.held(str(tmp_path), notes.append):
    with open(tmp_path / workdir_lock.FILE_NAME) as f:
      me = workdir_lock.Holder.parse(f.read())
    assert (me.pid, me.host) == (os.getpid(), socket.gethostname())
  assert len(notes) == 1
  assert re.fullmatch(
    rf"note: --workdir {re.escape(str(tmp_path))}: taking over the lock of "
    rf"a run that ended without releasing it \(pid {killed.pid} on host "
    rf"{re.escape(socket.gethostname())}, since {_TIME}; killed or "
    r"crashed\)",
    notes[0],
  )
  # Released by this process: the next run takes it without a note.
  assert (tmp_path / workdir_lock.FILE_NAME).read_text() == ""
  with workdir_lock.held(str(tmp_path), notes.append):
    pass
  assert len(notes) == 1


def test_one_process_holds_a_workdir_again_and_again(tmp_path):
  """Sequential runs in one process (resumes in tests, a notebook) take
  the lock each time, also after a run that raised; a run nested in a
  live one (one process, two trainings into one workdir) is refused."""
  notes = []
  for _ in range(2):
    with workdir_lock.held(str(tmp_path), notes.append):
      pass
  with pytest.raises(ValueError, match="a failed run"):
    with workdir_lock.held(str(tmp_path), notes.append):
      raise ValueError("a failed run")
  with workdir_lock.held(str(tmp_path), notes.append):
    with pytest.raises(
      workdir_lock.WorkdirInUse, match=f"pid {os.getpid()} on host"
    ):
      with workdir_lock.held(str(tmp_path), notes.append):
        pass
  assert notes == []


def test_the_processes_of_a_run_follow_process_zero(live, monkeypatch):
  """Process 0 alone locks and tells the others through one host
  exchange: they go on with it, though the file is another process's
  (theirs), and are refused with its refusal."""
  sent = []

  def exchange(name, data, answer):
    sent.append((name, data))
    return [answer, data]

  monkeypatch.setattr(workdir_lock.jax, "process_index", lambda: 1)
  monkeypatch.setattr(workdir_lock.jax, "process_count", lambda: 2)
  monkeypatch.setattr(
    workdir_lock.distributed, "exchange", lambda n, d: exchange(n, d, b"")
  )
  with workdir_lock.held(live.workdir):
    pass
  assert sent == [("workdir lock", b"")]
  monkeypatch.setattr(
    workdir_lock.distributed,
    "exchange",
    lambda n, d: exchange(n, d, b"--workdir W is in use by another run"),
  )
  with pytest.raises(workdir_lock.WorkdirInUse, match="^--workdir W is in"):
    with workdir_lock.held(live.workdir):
      raise AssertionError("process 1 went on after process 0's refusal")
  # Process 0 sends its refusal, whatever the others send.
  monkeypatch.setattr(workdir_lock.jax, "process_index", lambda: 0)
  monkeypatch.setattr(
    workdir_lock.distributed, "exchange", lambda n, d: [d, b""]
  )
  with pytest.raises(workdir_lock.WorkdirInUse, match=_refusal(live)):
    with workdir_lock.held(live.workdir):
      pass


def test_a_file_system_without_locks_is_a_note(tmp_path, monkeypatch):
  def no_locks(fd, operation):
    raise OSError(errno.ENOLCK, os.strerror(errno.ENOLCK))

  monkeypatch.setattr(workdir_lock.fcntl, "flock", no_locks)
  notes, ran = [], []
  with workdir_lock.held(str(tmp_path), notes.append):
    ran.append(True)
  assert ran and len(notes) == 1
  assert "cannot lock" in notes[0] and os.strerror(errno.ENOLCK) in notes[0]
  assert "a second run on this workdir would not be refused" in notes[0]


def test_holder_details_read_back_and_name_an_old_start_by_date():
  holder = workdir_lock.Holder("h", 12, time.time() - 3 * 86400, 4, "cmd")
  assert workdir_lock.Holder.parse(holder.text()) == holder
  assert re.fullmatch(
    r"pid 12 on host h, process 0 of 4, since \d{4}-\d\d-\d\d \d\d:\d\d:\d\d",
    holder.describe(),
  )
  for text in ("", "{", '{"pid": 1}', "[]", '{"host": "h", "pid": "x"}'):
    assert workdir_lock.Holder.parse(text) is None
