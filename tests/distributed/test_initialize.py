"""``jpipe.distributed.initialize`` reads its environment, and
``jpipe.launch`` writes it (no processes started here)."""

import os
import socket
import subprocess
import sys

import pytest

from jpipe import distributed, launch
from jpipe.launch._processes import _free_port
from tests.distributed.processes import environment

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(__file__)))


def _clear(monkeypatch):
  for key in (
    "JAX_COORDINATOR_ADDRESS",
    "JAX_NUM_PROCESSES",
    "JAX_PROCESS_ID",
    "JPIPE_CPU_DEVICES",
    "SLURM_NTASKS",
  ):
    monkeypatch.delenv(key, raising=False)


def test_one_process_without_environment(monkeypatch):
  _clear(monkeypatch)
  assert distributed.initialize() is False
  monkeypatch.setenv("JAX_NUM_PROCESSES", "1")
  assert distributed.initialize() is False
  monkeypatch.setenv("SLURM_NTASKS", "1")  # a one-task SLURM job
  assert distributed.initialize() is False
  assert distributed.is_main_process()


@pytest.mark.parametrize(
  "env, message",
  [
    ({"JAX_NUM_PROCESSES": "2"}, "JAX_COORDINATOR_ADDRESS"),
    (
      {"JAX_NUM_PROCESSES": "2", "JAX_COORDINATOR_ADDRESS": "127.0.0.1:1"},
      "JAX_PROCESS_ID",
    ),
    (
      {
        "JAX_NUM_PROCESSES": "2",
        "JAX_COORDINATOR_ADDRESS": "127.0.0.1:1",
        "JAX_PROCESS_ID": "2",
      },
      "not in 0 .. 1",
    ),
    ({"JAX_NUM_PROCESSES": "two"}, "not an integer"),
  ],
)
def test_incomplete_environment_is_a_clear_error(monkeypatch, env, message):
  _clear(monkeypatch)
  for key, value in env.items():
    monkeypatch.setenv(key, value)
  with pytest.raises(ValueError, match=message):
    distributed.initialize()


def test_launcher_environments():
  base = {
    "PATH": "/bin",
    "http_proxy": "http://proxy:1",
    "HTTPS_PROXY": "http://proxy:1",
    "XLA_FLAGS": "--xla_force_host_platform_device_count=8 --xla_foo=1",
  }
  envs = launch.process_environments(3, 2, "cpu", base=base)
  assert [e["JAX_PROCESS_ID"] for e in envs] == ["0", "1", "2"]
  assert {e["JAX_NUM_PROCESSES"] for e in envs} == {"3"}
  address = {e["JAX_COORDINATOR_ADDRESS"] for e in envs}
  assert len(address) == 1 and address.pop().startswith("127.0.0.1:")
  for e in envs:
    assert e["JPIPE_CPU_DEVICES"] == "2"
    assert "http_proxy" not in e and "HTTPS_PROXY" not in e
    assert e["XLA_FLAGS"] == "--xla_foo=1"  # the device-count flag dropped
  gpus = launch.process_environments(2, 2, "gpu", base={"PATH": "/bin"})
  assert [e["CUDA_VISIBLE_DEVICES"] for e in gpus] == ["0,1", "2,3"]


def test_launcher_needs_a_command(capsys):
  with pytest.raises(SystemExit):
    launch.main(["--nprocs", "2"])
  assert "give the command after --" in capsys.readouterr().err
  # A command that does not exist: one line before any process starts.
  with pytest.raises(SystemExit):
    launch.main(["--nprocs", "2", "--", "pythonn", "-m", "jpipe.train"])
  assert "no command 'pythonn' on PATH" in capsys.readouterr().err


# A launched process: says it is ready, then exits 3 on SIGTERM -- or,
# with IGNORE set, ignores it (the launcher's SIGKILL ends it).
_CHILD = """
import os, signal, sys, time
if os.environ.get("IGNORE"):
  signal.signal(signal.SIGTERM, signal.SIG_IGN)
else:
  signal.signal(signal.SIGTERM, lambda *_: sys.exit(3))
open(os.path.join(os.environ["READY"], os.environ["JAX_PROCESS_ID"]), "w")
while True:
  time.sleep(0.05)
"""


# (The suite's process has imported jax, which warns of any fork; the
# launcher's own process never imports it.)
@pytest.mark.filterwarnings("ignore:os.fork:RuntimeWarning")
@pytest.mark.parametrize("ignore", ["", "1"])
def test_sigterm_to_the_launcher_goes_to_every_process(tmp_path, ignore):
  """SIGTERM to the launcher (here: this process, ``launch.run`` in its
  main thread) is passed on to both processes; one that exits on it
  gives the run its status, one that ignores it gets SIGKILL after
  ``grace`` seconds (status 128 + 9). The launcher's own handlers are
  restored afterwards. (No jax in the children: the launcher alone.)"""
  import io
  import os
  import signal
  import sys
  import threading
  import time

  base = dict(os.environ, READY=str(tmp_path), IGNORE=ignore)
  envs = launch.process_environments(2, 1, "cpu", base=base)

  def terminate_once_ready():
    deadline = time.monotonic() + 60
    while len(os.listdir(tmp_path)) < 2 and time.monotonic() < deadline:
      time.sleep(0.02)
    os.kill(os.getpid(), signal.SIGTERM)

  before = signal.getsignal(signal.SIGTERM)
  out = io.StringIO()
  threading.Thread(target=terminate_once_ready, daemon=True).start()
  code = launch.run([sys.executable, "-c", _CHILD], envs, grace=0.5, out=out)
  assert signal.getsignal(signal.SIGTERM) is before
  text = out.getvalue()
  assert (
    "[launch] SIGTERM: passed on to every process; SIGKILL to those still "
    "running in 0.5 s"
  ) in text
  if ignore:
    assert code == 128 + signal.SIGKILL
    for i in range(2):
      assert f"[launch] process {i} exited with signal SIGKILL" in text
  else:
    assert code == 3
    assert "[launch] process 0 exited with status 3" in text


def test_a_coordinator_port_in_use_is_named_before_jax_starts(monkeypatch):
  """Process 0 on a port another run's coordinator holds: a segmentation
  fault before; now one line (nothing of JAX's is started)."""
  _clear(monkeypatch)
  with socket.socket() as held:
    held.bind(("", 0))
    held.listen()
    port = held.getsockname()[1]
    with pytest.raises(ValueError, match=f"port {port} is in use on this"):
      distributed.initialize(f"127.0.0.1:{port}", 2, 0)


def test_a_process_that_never_joins_is_explained_before_jax_aborts():
  """JAX's abort says only "another task died": jpipe says first that
  it waited for the others to join, where, and what to check."""
  script = (
    "from jpipe import distributed\n"
    f"distributed.initialize('127.0.0.1:{_free_port()}', 2, 1, "
    "initialization_timeout_s=4)\n"
  )
  done = subprocess.run(
    [sys.executable, "-c", script],
    env=environment(PYTHONPATH=ROOT),
    capture_output=True,
    text=True,
    timeout=120,
  )
  assert done.returncode != 0
  assert (
    "jpipe: process 1 has waited 1 s for all 2 processes to join at "
    "127.0.0.1:" in done.stderr
  ), done.stderr[-2000:]
