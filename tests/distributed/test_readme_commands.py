"""The README's multi-process commands, as written there (read from
README.md; the step count shortened, cadences varied), run to the end --
several times each, since the deadlock they once had was a race -- and
the default config's losses equal one process's."""

import json
import os
import re
import shlex
import subprocess
import sys

import numpy as np
import pytest

from tests.distributed.processes import environment
from tests.quick_compiles import with_quick_compiles

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))

pytestmark = pytest.mark.slow

STEPS = 50


def readme_command(*markers: str, without: str | None = None) -> list[str]:
  """The README's shell command (continuation lines joined, comment
  dropped) that contains every marker (and not ``without``)."""
  with open(os.path.join(ROOT, "README.md")) as f:
    text = f.read()
  blocks = re.findall(r"```bash\n(.*?)```", text, re.S)
  commands = []
  for block in blocks:
    joined = re.sub(r"\\\n\s*", " ", block)
    commands += [line.split("  #")[0].strip() for line in joined.splitlines()]
  found = [
    c
    for c in commands
    if all(m in c for m in markers) and not (without and without in c)
  ]
  assert len(found) == 1, (markers, found)
  # "python" is the interpreter running the tests (a venv's, say).
  return [sys.executable if w == "python" else w for w in shlex.split(found[0])]


def _with(command, workdir, *overrides):
  """The command with its --workdir replaced and overrides appended."""
  i = command.index("--workdir")
  return [*command[: i + 1], str(workdir), *command[i + 2 :], *overrides]


def _run(command, env, timeout=400):
  done = subprocess.run(
    command, env=env, capture_output=True, text=True, timeout=timeout, cwd=ROOT
  )
  out = done.stdout + done.stderr
  assert done.returncode == 0, out[-6000:]
  return out


def _rows(workdir):
  with open(os.path.join(workdir, "metrics.jsonl")) as f:
    return [json.loads(line) for line in f]


@pytest.fixture(scope="module")
def one_process_losses(tmp_path_factory):
  """The default config's per-step losses in one process (8 CPU
  devices), the reference of every multi-process run of it."""
  workdir = tmp_path_factory.mktemp("one_process")
  env = environment()
  env["XLA_FLAGS"] = with_quick_compiles(
    "--xla_force_host_platform_device_count=8"
  )
  command = [sys.executable, "-m", "jpipe.train", "--config"]
  command += ["configs/default.py", "--workdir", str(workdir)]
  command += [f"--config.train.steps={STEPS}", "--config.train.log_every=1"]
  _run(command, env)
  rows = _rows(workdir)
  return {r["step"]: r["train/loss"] for r in rows if "train/loss" in r}


# (processes, log_every, eval_every, checkpoint_every, repeat): the
# README's 2 x 2 command at the cadence that hung (log_every 10) and one
# whose logs, evaluations and checkpoints fall on different steps; a
# process per stage. (Each ran twice per suite while the hang was open,
# with a second 4-process cadence and a 25, 3, 50 one that 1, 7, 5's
# misaligned cadences cover: suite time.)
MATRIX = [
  ("run2", 1, 7, 5, 0),
  ("run2", 10, 10, 20, 0),
  ("run4", 10, 20, 10, 0),
]


@pytest.mark.parametrize("which,log_every,eval_every,ckpt_every,repeat", MATRIX)
def test_default_config_across_processes_as_in_the_readme(
  tmp_path, one_process_losses, which, log_every, eval_every, ckpt_every, repeat
):
  del repeat
  command = readme_command("jpipe.launch", "configs/default.py", which)
  out = _run(
    _with(
      command,
      tmp_path,
      f"--config.train.steps={STEPS}",
      f"--config.train.log_every={log_every}",
      f"--config.train.eval_every={eval_every}",
      f"--config.train.checkpoint_every={ckpt_every}",
    ),
    environment(),
  )
  assert f"[p0] Done: {STEPS} steps" in out, out[-3000:]
  rows = _rows(tmp_path)
  logged = {r["step"]: r["train/loss"] for r in rows if "train/loss" in r}
  ends = sorted(logged)
  assert ends == sorted(
    {s for s in range(1, STEPS + 1) if s % log_every == 0} | {STEPS}
  )
  evals = [r["step"] for r in rows if "eval/accuracy" in r]
  assert evals == sorted(
    {s for s in range(1, STEPS + 1) if s % eval_every == 0} | {STEPS}
  )
  start = 0
  for end in ends:  # Window means of the one-process losses.
    want = np.mean([one_process_losses[s] for s in range(start + 1, end + 1)])
    assert logged[end] == pytest.approx(want, rel=1e-5), end
    start = end
  saved = sorted(int(d) for d in os.listdir(tmp_path / "checkpoints"))
  assert saved[-1] == STEPS


def test_sdpipe_across_processes_as_in_the_readme(tmp_path):
  """4 processes x 2 devices, a pipeline each: two epochs, evaluated and
  checkpointed, to the end."""
  command = readme_command("jpipe.launch", "configs/sdpipe.py", "--nprocs 4")
  out = _run(_with(command, tmp_path, "--config.train.steps=24"), environment())
  assert "[p0] epoch 2/2 (step 24)" in out, out[-3000:]
  assert "[p0] Done:" in out
  rows = _rows(tmp_path)
  assert [r["step"] for r in rows if "eval/accuracy" in r] == [12, 24]
  assert all(np.isfinite(r["train/loss"]) for r in rows)


def test_sdpipe_process_per_stage_as_in_the_readme(tmp_path):
  """2 processes x 4 devices, process s running stage s of all 4
  pipelines: an epoch, evaluated through pipeline 0's two processes and
  checkpointed, to the end; every pipeline ran batches."""
  command = readme_command("jpipe.launch", "placement=stage")
  out = _run(_with(command, tmp_path, "--config.train.steps=12"), environment())
  assert "[p0] epoch 1/1 (step 12)" in out, out[-3000:]
  rows = _rows(tmp_path)
  assert [r["step"] for r in rows if "eval/accuracy" in r] == [12]
  assert all(np.isfinite(r["train/loss"]) for r in rows)
  assert min(r["sync/batches_min"] for r in rows if "sync/batches_min" in r) > 0


def test_dynpipe_across_processes_as_in_the_readme(tmp_path):
  """A process per stage with DynPipe's measuring windows (a gather of
  every stage's times and process 0's decision every 10 steps)."""
  command = readme_command("jpipe.launch", "configs/dynpipe.py")
  out = _run(_with(command, tmp_path, "--config.train.steps=40"), environment())
  assert "[p0] Done: 40 steps" in out, out[-3000:]
  rows = _rows(tmp_path)
  windows = [r["step"] for r in rows if "dynamic/step_seconds" in r]
  assert windows == [10, 20, 30, 40]
