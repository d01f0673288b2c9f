"""The CLI's one-line explanation of a bad command line
(``config_cli.explain``): which flag is wrong and how to fix it."""

import os

import pytest

from jpipe.train import base_config, config_check, config_cli, config_plan

DEFAULT = "--config=configs/default.py"


@pytest.mark.parametrize(
  "argv, error, want",
  [
    ([], "x", "--config is required: --config configs/default.py"),
    (
      ["--config=configs/none.py"],
      "x",
      "--config configs/none.py: cannot load it (",
    ),
    (
      [DEFAULT, "--config.train.stepz=3"],
      "x",
      "--config.train.stepz=3: config has no field train.stepz; did you "
      "mean config.train.steps",
    ),
    (  # A model keyword the config sets no value of: the whole dict.
      ["--config=configs/gpt_lm.py", "--config.model.kwargs.dtype=bfloat16"],
      "x",
      "--config.model.kwargs.dtype=bfloat16: config.model.kwargs sets no "
      "dtype yet, and a flag can only change a field it has; pass the whole "
      "dict with it: --config.model.kwargs=\"{'max_length': 128, "
      "'num_heads': 4, 'num_layers': 4, 'vocab_size': 256, 'width': 128, "
      "'dtype': 'bfloat16'}\"",
    ),
    (
      [DEFAULT, "--config.train.steps=three"],
      "flag --config.train.steps=three: could not convert",
      "--config.train.steps=three: expected int like its current value",
    ),
    (  # Given twice, absl reads the last: so does the explanation.
      [DEFAULT, "--config", "configs/none.py"],
      "x",
      "--config configs/none.py: cannot load it (",
    ),
    ([DEFAULT], "x", "--workdir is required: where checkpoints and logs go"),
    (
      [DEFAULT, "--workdir=/tmp/w"],
      "flag --foo: not known\nmore",
      "--foo: not known",
    ),
  ],
)
def test_a_bad_command_line_is_explained_in_one_line(argv, error, want):
  got = config_cli.explain(argv, ValueError(error))
  assert got.startswith(want), got
  assert "\n" not in got


@pytest.mark.parametrize(
  "argv, stray, want",
  [
    (
      [DEFAULT, "--workdir=/tmp/w", "steps=3"],
      ["steps=3"],
      "unexpected argument steps=3: every option is a flag (--workdir DIR, "
      "--config.KEY=VALUE)",
    ),
    (
      [DEFAULT, "--config.pipeline.recompute", "False", "x"],
      ["False", "x"],
      "--config.pipeline.recompute False: a boolean field takes its value "
      "after '=' (--config.pipeline.recompute=false)",
    ),
    (  # A key given its value after a space took it: not the boolean case.
      [DEFAULT, "--config.train.steps", "3", "more"],
      ["more"],
      "unexpected argument more: every option is a flag",
    ),
  ],
)
def test_arguments_no_flag_took_are_named(argv, stray, want):
  """(absl leaves them to ``main``, which once exited 1 with its usage.)"""
  assert config_cli.stray_arguments(["jpipe", *argv], stray).startswith(want)


@pytest.mark.parametrize(
  "data", ["image_data", "text_data", "qa_data", "translation_data"]
)
def test_every_config_field_has_its_meaning_in_the_help(data):
  """``--help`` gives each field's meaning from base_config's comments:
  a section's opening comment is its first field's, a field a variant
  sets again keeps its own."""
  config = base_config.base_config()
  config.data = getattr(base_config, data)()
  docs = config_cli.field_docs(text_data="text_key" in config.data)
  missing = [k for k in config_cli.flatten(config) if not docs.get(k)]
  assert not missing
  assert docs["schedule.name"].startswith("Schedule: a name from")
  assert docs["staleness.stashing"].endswith("Weight stashing.")


def test_another_command_lists_its_own_flags_in_its_help():
  from jpipe.train import slowdowns

  text = config_cli.help_text(["slowdowns", "--help"], slowdowns.COMMAND)
  assert text.startswith("usage: python -m jpipe.train.slowdowns --config")
  assert "  --out: Where the fitted predictor goes" in text
  assert "--workdir" not in text
  assert "  train.steps = 300" in text


def test_config_files_that_cannot_load_say_why(tmp_path):
  with pytest.raises(ValueError, match="is a folder: name a config file"):
    config_plan.load_config_file(str(tmp_path))
  with pytest.raises(ValueError, match=r"has no variants .* drop ':ws'"):
    config_plan.load_config_file("configs/default.py:ws")


def test_overrides_reach_a_config_as_the_training_cli_applies_them():
  config = config_cli.load_with_overrides(
    "configs/default.py",
    ["--config.pipeline.num_stages=3", "--config.train.steps", "7"],
  )
  assert config.pipeline.num_stages == 3 and config.train.steps == 7
  with pytest.raises(ValueError, match="did you mean config.train.steps"):
    config_cli.load_with_overrides(
      "configs/default.py", ["--config.train.stepz=3"]
    )
  with pytest.raises(ValueError, match="unrecognized arguments: --stagez 3"):
    config_cli.load_with_overrides("configs/default.py", ["--stagez", "3"])


def test_too_few_devices_names_the_replicas_when_they_add_up_past_them():
  import jax

  config = config_cli.load_with_overrides(
    "configs/default.py",
    ["--config.pipeline.num_stages=3", "--config.pipeline.replicas=5,5,5"],
  )
  with pytest.raises(
    ValueError,
    match=r"replicas: 3 stages with replicas '5,5,5' need 15 devices, this "
    r"run has 8 .* adding up to at most 8",
  ):
    config_check.check_devices(config, jax.devices())
  config = config_cli.load_with_overrides(
    "configs/default.py", ["--config.pipeline.num_stages=9"]
  )
  with pytest.raises(
    ValueError,
    match="num_stages: 9 stages need 9 devices.*; on CPU, XLA_FLAGS="
    "--xla_force_host_platform_device_count=N sets the device count "
    r"\(this run's: 8\)",
  ):
    config_check.check_devices(config, jax.devices())
  # Several pipelines: fewer of them is a fix too.
  config = config_cli.load_with_overrides(
    "configs/sdpipe.py",
    ["--config.data_parallel.pipelines=4", "--config.pipeline.num_stages=3"],
  )
  with pytest.raises(
    ValueError,
    match=r"4 pipelines x 3 stages need 12 devices.*use at most 2 stages "
    r"per pipeline, or at most 2 pipelines",
  ):
    config_check.check_devices(config, jax.devices())


@pytest.mark.parametrize(
  "overrides, want",
  [
    (["--config.schedule.step_every=0"], "step_every: 0: must be >= 1"),
    (  # Once, not twice in other words.
      ["--config.schedule.name=2bw"],
      "2bw needs schedule.step_every = microbatches per minibatch",
    ),
  ],
)
def test_a_bad_step_every_is_one_problem(overrides, want):
  config = config_cli.load_with_overrides("configs/default.py", overrides)
  with pytest.raises(ValueError) as error:
    config_check.check(config)
  assert str(error.value).startswith("invalid config: config.")
  assert want in str(error.value) and "\n" not in str(error.value)


@pytest.mark.parametrize(
  "before, after",
  [
    (None, "--xla_force_host_platform_device_count=8"),
    ("", "--xla_force_host_platform_device_count=8"),
    (  # Another flag of the user's once left one CPU device.
      "--xla_dump_to=/tmp/d",
      "--xla_dump_to=/tmp/d --xla_force_host_platform_device_count=8",
    ),
    (  # The user's own count is kept.
      "--xla_force_host_platform_device_count=2",
      "--xla_force_host_platform_device_count=2",
    ),
  ],
)
def test_the_commands_default_to_eight_cpu_devices(monkeypatch, before, after):
  from jpipe.train import host_devices

  if before is None:
    monkeypatch.delenv("XLA_FLAGS", raising=False)
  else:
    monkeypatch.setenv("XLA_FLAGS", before)
  host_devices.default_cpu_device_count()
  assert os.environ["XLA_FLAGS"] == after
