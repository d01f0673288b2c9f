"""The README's one-process commands that no other test runs as written:
the quick start's training, the planning CLIs, training from a config,
the GPT pre-training and fine-tuning pair, SD-Pipe in one process and
DynPipe (read from README.md; workdirs moved under the test's folder, step
counts shortened). The multi-process ones: tests/distributed/
test_readme_commands.py; the others name their own tests there."""

import json

import pytest

from tests.distributed.test_readme_commands import (
  _rows,
  _run,
  _with,
  readme_command,
)
from tests.train.test_train import _cli_env

SHORT = (
  "--config.train.steps=4",
  "--config.train.eval_every=4",
  "--config.train.profile_last_step=False",
)

pytestmark = pytest.mark.slow


def _evaluated(workdir) -> dict:
  """Step 4's evaluation, as metrics.jsonl holds it."""
  (last,) = [
    r
    for r in _rows(workdir)
    if r["step"] == 4 and any(k.startswith("eval/") for k in r)
  ]
  return last


def test_the_quick_start_trains_the_main_job(tmp_path):
  install_and_train = readme_command("pip install", "configs/default.py")
  train = install_and_train[install_and_train.index("&&") + 1 :]
  out = _run(_with(train, tmp_path, *SHORT), _cli_env())
  assert "Done: 4 steps; eval accuracy" in out
  assert 0.0 <= _evaluated(tmp_path)["eval/accuracy"] <= 1.0
  assert (tmp_path / "plan.json").exists()


def test_the_planning_commands_print_their_plans(tmp_path):
  profile = readme_command("--pipedream-profile vgg16")
  plan = json.loads(_run(profile, _cli_env()).strip().splitlines()[-1])
  assert plan["stage_of"]
  command = readme_command("jpipe.train.plan", "configs/t5.py")
  png = tmp_path / "t5_plan.png"
  command[command.index("--png") + 1] = str(png)
  out = _run(command, _cli_env())
  assert "4 stages on 4 devices" in out and png.stat().st_size > 0


def test_training_from_a_config_runs_the_async_stream(tmp_path):
  command = readme_command("--config.staleness.prediction=msnag")
  out = _run(_with(command, tmp_path, *SHORT), _cli_env())
  assert "schedule async" in out and "Done: 4 steps" in out
  assert _evaluated(tmp_path)["eval/accuracy"] > 0.1


def test_gpt_pretraining_then_fine_tuning_from_its_workdir(tmp_path):
  pre, tuned = tmp_path / "pre", tmp_path / "tuned"
  _run(_with(readme_command("configs/gpt_lm.py"), pre, *SHORT), _cli_env())
  command = _with(readme_command("configs/gpt_finetune.py"), tuned, *SHORT)
  out = _run([*command, f"--config.init_from={pre}"], _cli_env())
  assert "Done: 4 steps" in out
  assert _evaluated(tuned)["eval/perplexity"] > 1


@pytest.mark.parametrize(
  "markers",
  [("configs/sdpipe.py", "hetero=0.1"), ("--workdir /tmp/jpipe_dynpipe",)],
)
def test_the_seed_systems_commands_train(tmp_path, markers):
  command = readme_command(*markers, without="jpipe.launch")
  out = _run(_with(command, tmp_path, *SHORT), _cli_env())
  assert "Done:" in out, out[-3000:]
