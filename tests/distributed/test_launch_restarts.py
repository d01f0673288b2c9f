"""``python -m jpipe.launch --max_restarts N [--min_nprocs K]`` with tiny
Python commands (no jax): a failed run starts again and ends 0, gives up
after N restarts, stays down without restarts and on a SIGTERM to the
launcher, goes on with fewer processes where one fails again at
start-up; the policy's rules one by one; its flags' one-line errors."""

import os
import signal
import subprocess
import sys
import time

import pytest

from jpipe import launch
from tests.distributed.processes import ROOT, environment, started

# A launched process. Process FAILER fails (status 3) while MARKS holds
# fewer than FAILS files, adding one; the others wait to be stopped
# (status 5 on SIGTERM) while it has yet to fail, else exit 0. With GONE:
# a restart's (a run with MARKS holding a file) process 1 of a run of
# NPROCS fails at once (status 1): its host did not come back.
_CHILD = """
import os, signal, sys, time
e = os.environ
marks, rank, n = e["MARKS"], e["JAX_PROCESS_ID"], e["JAX_NUM_PROCESSES"]
signal.signal(signal.SIGTERM, lambda *_: sys.exit(5))
port = e["JAX_COORDINATOR_ADDRESS"].rsplit(":", 1)[1]
print(f"start {rank} of {n} port {port}", flush=True)
done = len(os.listdir(marks))
if e.get("GONE") and done and rank == "1" and n == e["NPROCS"]:
  sys.exit(1)
if done < int(e.get("FAILS", "0")):
  if rank == e.get("FAILER", "1"):
    time.sleep(0.3)
    open(os.path.join(marks, str(done)), "w").close()
    sys.exit(3)
  time.sleep(60)
if e.get("WAIT"):
  open(os.path.join(e["WAIT"], rank), "w").close()
  time.sleep(60)
"""


def _launch(tmp_path, *flags, nprocs=2, **env):
  marks = tmp_path / "marks"
  marks.mkdir(exist_ok=True)
  command = [sys.executable, "-m", "jpipe.launch", f"--nprocs={nprocs}"]
  command += [*flags, "--", sys.executable, "-c", _CHILD]
  env = environment(MARKS=str(marks), NPROCS=str(nprocs), **env)
  return command, env


def _run(tmp_path, *flags, **kwargs):
  command, env = _launch(tmp_path, *flags, **kwargs)
  done = subprocess.run(
    command, env=env, capture_output=True, text=True, timeout=60, cwd=ROOT
  )
  return done.returncode, done.stdout + done.stderr


def _starts(out, rank=0):
  """Each attempt's port, as process ``rank`` printed it."""
  return [
    line.split()[-1]
    for line in out.splitlines()
    if line.startswith(f"[p{rank}] start {rank} of")
  ]


def test_a_failed_run_restarts_on_a_fresh_port_and_ends_0(tmp_path):
  code, out = _run(tmp_path, "--max_restarts=2", FAILS="1")
  assert code == 0, out
  assert "[launch] process 1 exited with status 3" in out
  line = next(x for x in out.splitlines() if "restart 1 of 2" in x)
  assert line.startswith("[launch] process 1 ended with status 3 after 0.")
  assert line.endswith(
    "s; restart 1 of 2, 2 processes: the command resumes from its last "
    "checkpoint"
  )
  ports = _starts(out)
  assert len(ports) == 2 and ports[0] != ports[1], out


def test_gives_up_after_its_restarts(tmp_path):
  code, out = _run(tmp_path, "--max_restarts=2", FAILS="9")
  assert code == 3, out
  assert len(_starts(out)) == 3 and "restart 2 of 2" in out, out
  assert "s; no restarts left (--max_restarts 2): exiting with status 3" in out


def test_no_restart_without_max_restarts(tmp_path):
  code, out = _run(tmp_path, FAILS="1")
  assert code == 3 and len(_starts(out)) == 1, out
  assert "restart" not in out


def test_a_signal_death_restarts_and_status_2_does_not(tmp_path):
  """A process killed by a signal (SIGKILL, here its own) is restarted;
  one that exits 2 (a usage error) is not."""
  marks = tmp_path / "marks"
  kill = "import os, signal; os.kill(os.getpid(), signal.SIGKILL)"
  child = f"""
import os, sys
if os.environ["JAX_PROCESS_ID"] == "1" and not os.listdir({str(marks)!r}):
  open(os.path.join({str(marks)!r}, "x"), "w").close()
  {kill}
"""
  command, env = _launch(tmp_path, "--max_restarts=1")
  command[-1] = child
  kw = dict(env=env, capture_output=True, text=True, timeout=60, cwd=ROOT)
  done = subprocess.run(command, **kw)
  assert done.returncode == 0, done.stdout
  assert "ended with signal SIGKILL after" in done.stdout
  command[-1] = "import sys; sys.exit(2)"
  done = subprocess.run(command, **kw)
  assert done.returncode == 2, done.stdout
  assert "a usage error, which a restart would repeat" in done.stdout


def test_sigterm_to_the_launcher_does_not_restart(tmp_path):
  ready = tmp_path / "ready"
  ready.mkdir()
  command, env = _launch(tmp_path, "--max_restarts=2", WAIT=str(ready))
  with started(command, env) as proc:
    deadline = time.monotonic() + 30
    while len(os.listdir(ready)) < 2 and time.monotonic() < deadline:
      time.sleep(0.02)
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=30)
  assert proc.returncode == 5, out
  assert "[launch] SIGTERM: passed on to every process" in out
  assert len(_starts(out)) == 1 and "restart" not in out, out


@pytest.mark.parametrize(
  "flags, code",
  [
    (["--min_nprocs=1"], 0),
    (["--min_nprocs=2"], 1),
    (["--min_nprocs=1", "--startup_window=0.01"], 1),
  ],
)
def test_a_host_that_does_not_come_back(tmp_path, flags, code):
  """Process 1 fails, then fails again at the restart's start: with
  --min_nprocs 1 the restart goes on in one process and ends 0; with 2
  (never fewer), or where the start-up window is over before its
  failure, that failure uses the last restart."""
  code_, out = _run(tmp_path, "--max_restarts=1", *flags, FAILS="1", GONE="1")
  assert code_ == code, out
  if code == 0:
    assert (
      "[launch] process 1 ended with status 1 after 0." in out
      and "s, at start-up: restart 1 goes on with 1 process instead of 2 "
      "(at least 1: --min_nprocs); the command plans for them"
      in out
    ), out
    assert "[p0] start 0 of 1 port" in out
  else:
    assert "no restarts left (--max_restarts 1)" in out, out
    assert "instead of" not in out and "start 0 of 1" not in out


def _outcome(status, failed=1, seconds=100.0):
  return launch.Outcome(status, failed, False, seconds)


def test_the_policy():
  """``Restarts.after``: restart numbers, the full count again, a slot
  dropped only at a restart's start and never below the minimum, a
  dropped slot's devices gone for good within the restart."""
  policy = launch.Restarts(max_restarts=2, min_nprocs=2, startup_s=10.0)
  full = [0, 1, 2]
  step = policy.after(_outcome(-9, seconds=1.0), full, 0, 3)
  assert (step.slots, step.restart) == (full, 1)  # First attempt: no drop.
  step = policy.after(_outcome(124, seconds=1.0), full, 1, 3)  # At start-up.
  assert (step.slots, step.restart) == ([0, 2], 1)
  step = policy.after(_outcome(1, failed=1, seconds=1.0), [0, 2], 1, 3)
  assert (step.slots, step.restart) == (full, 2)  # 2 is the minimum.
  step = policy.after(_outcome(1, seconds=11.0), full, 1, 3)  # After start.
  assert (step.slots, step.restart) == (full, 2)
  step = policy.after(_outcome(1), full, 2, 3)
  assert step.slots is None and "no restarts left" in step.line
  assert policy.after(_outcome(2), full, 0, 3).slots is None
  step = launch.Restarts().after(_outcome(1), full, 0, 3)  # No restarts.
  assert step.slots is None and not step.line


@pytest.mark.parametrize(
  "flags, message",
  [
    (["--max_restarts=-1"], "--max_restarts must be >= 0 (0: no restarts)"),
    (
      ["--max_restarts=1", "--min_nprocs=3"],
      "--min_nprocs 3 is not in 1 .. --nprocs (2)",
    ),
    (
      ["--min_nprocs=1"],
      "--min_nprocs applies to restarts: give --max_restarts too",
    ),
    (
      ["--max_restarts=1", "--startup_window=5"],
      "--startup_window applies to --min_nprocs below --nprocs",
    ),
  ],
)
def test_restart_flags_errors_are_one_line(capsys, flags, message):
  with pytest.raises(SystemExit):
    launch.main(["--nprocs=2", *flags, "--", "python", "-c", "pass"])
  err = capsys.readouterr().err.strip().splitlines()[-1]
  assert message in err
