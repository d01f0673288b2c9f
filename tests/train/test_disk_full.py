"""A disk that fills during a save (issue 68, item 2): one line naming the
step that failed and the checkpoint still intact, not orbax's hundreds of
lines; the run resumes from that checkpoint once there is space."""

import errno
import os
import subprocess
import sys

import pytest

from jpipe.train import checkpoint

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(__file__)))


def test_the_line_names_a_full_disk_however_orbax_wraps_it():
  def wrapped(inner):
    try:
      try:
        raise inner
      except Exception as e:
        raise RuntimeError("commit failed") from e
    except RuntimeError as outer:
      return outer

  from_python = wrapped(OSError(errno.ENOSPC, "No space left on device"))
  from_tensorstore = ValueError(
    'RESOURCE_EXHAUSTED: Failed writing: "f": No space left on device '
    "[os_error_code='28']"
  )
  for error in (from_python, from_tensorstore):
    line = checkpoint._save_failed("/w/checkpoints", 5, 4, error)
    assert line.startswith(
      "no space left on the disk of /w/checkpoints while saving step 5; "
      "step 4 is intact"
    )
  other = checkpoint._save_failed("/w", 5, None, PermissionError("denied"))
  assert "saving step 5 to /w failed (PermissionError: denied)" in other
  assert "there is no earlier checkpoint" in other


@pytest.fixture
def small_disk(tmp_path):
  """A 400 KiB file system (tmpfs): room for a few checkpoints of the
  small default model, not for all of them."""
  where = tmp_path / "disk"
  where.mkdir()
  mount = subprocess.run(
    ["mount", "-t", "tmpfs", "-o", "size=400k", "tmpfs", str(where)],
    capture_output=True,
  )
  if mount.returncode != 0:  # Needs root (CI's containers have it).
    pytest.skip(f"cannot mount a small tmpfs: {mount.stderr.decode()}")
  yield where
  subprocess.run(["umount", str(where)], check=True)


def _train(workdir, steps):
  return subprocess.run(
    [
      sys.executable,
      "-m",
      "jpipe.train",
      "--config",
      os.path.join(ROOT, "configs", "default.py"),
      f"--workdir={workdir}",
      "--config.model.kwargs.hidden=(32,32)",
      "--config.pipeline.num_stages=2",
      f"--config.train.steps={steps}",
      "--config.train.checkpoint_every=1",
      "--config.train.keep_checkpoints=100",
      "--config.train.eval_every=1000",
    ],
    cwd=ROOT,
    env=dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=2"),
    capture_output=True,
    text=True,
    timeout=300,
  )


@pytest.mark.slow
def test_a_full_disk_during_a_save_is_one_line_and_resumable(small_disk):
  workdir = small_disk / "run"
  done = _train(workdir, 30)
  assert done.returncode == 2, done.stdout[-3000:] + done.stderr[-3000:]
  output = (done.stdout + done.stderr).strip().splitlines()
  last = output[-1].strip()  # (After a progress bar's carriage return.)
  assert last.startswith("error: no space left on the disk of "), last
  failed = int(last.split("while saving step ")[1].split(";")[0])
  assert f"step {failed - 1} is intact" in last
  assert not any("Traceback" in line for line in output)
  # Space freed: the same command resumes from the intact checkpoint.
  for step in range(1, failed - 1):
    subprocess.run(["rm", "-rf", str(workdir / "checkpoints" / str(step))])
  again = _train(workdir, failed)
  assert again.returncode == 0, again.stdout[-3000:] + again.stderr[-3000:]
  assert f"Resuming from step {failed - 1}" in again.stdout
