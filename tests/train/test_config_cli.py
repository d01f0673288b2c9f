"""The CLI's one-line explanation of a bad command line
(``config_cli.explain``): which flag is wrong and how to fix it."""

import pytest

from jpipe.train import config_cli

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
