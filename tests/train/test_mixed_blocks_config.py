"""``pipeline.mixed_blocks`` (FTPipe's L) and ``pipeline.paper_plan`` in
the config, the plan CLI and training's Pipeline options."""

import json

import pytest

from jpipe.train import config_check, config_plan, train_lib
from jpipe.train import plan as plan_cli
from jpipe.train.errors import UsageError

T5_SMALL = "configs/seeds/ftpipe_t5_3b.py:small"


def _config(**fields):
  config = config_plan.load_config_file(T5_SMALL)
  config.unlock()
  for key, value in fields.items():
    section, name = key.split(".")
    config[section][name] = value
  return config


@pytest.mark.parametrize(
  "fields, match",
  [
    ({"pipeline.mixed_blocks": "4,x"}, "give block counts >= 1"),
    ({"pipeline.mixed_blocks": "0"}, "give block counts >= 1"),
    (
      {"pipeline.mixed_blocks": "4", "pipeline.partition": "contiguous"},
      "is for pipeline.partition 'mixed', not 'contiguous'",
    ),
  ],
)
def test_mixed_blocks_mistakes_are_one_line(fields, match):
  with pytest.raises(UsageError, match=match) as err:
    config_check.check(_config(**fields))
  assert "\n" not in str(err.value)


def test_training_passes_the_block_counts_to_the_pipeline():
  config = _config(**{"pipeline.mixed_blocks": "3,4"})
  task = train_lib.tasks.build_task(config, abstract=True)
  options = train_lib.pipeline_options(config, task, 1e-3)
  assert options["mixed_blocks"] == (3, 4)
  assert options["partition"] == "mixed"


def test_plan_cli_bounds_the_stages_and_prints_the_papers_figure(
  tmp_path, capsys
):
  """The plan CLI plans the mixed pipe with the config's block counts
  (at most that many stages), names its cost model and both speed-ups,
  and prints the config's paper_plan beside them."""
  path = tmp_path / "t5_blocks.py"
  path.write_text(
    "from configs.seeds import ftpipe_t5_3b\n"
    "def get_config(variant=''):\n"
    "  c = ftpipe_t5_3b.get_config('small')\n"
    "  c.pipeline.mixed_blocks = '3'\n"
    "  c.pipeline.paper_plan = 'The paper: 1.5x'\n"
    "  return c\n"
  )
  assert plan_cli.main(["--config", str(path), "--json"]) == 0
  result = json.loads(capsys.readouterr().out)
  assert 2 <= len(result["stage_devices"]) <= 3
  assert result["cost_model"] == "analytic"
  assert result["paper_plan"] == "The paper: 1.5x"
  assert result["speedup"] == pytest.approx(
    result["sequential"] / result["bottleneck"]
  )
  # The stages' work over the bottleneck: at most the 2 devices.
  assert 1.0 <= result["speedup_at_stage_costs"] <= 2 * (1 + 1e-9)
  assert plan_cli.main(["--config", str(path)]) == 0
  out = capsys.readouterr().out
  assert "cost model 'analytic': speed-up " in out
  assert "the paper: The paper: 1.5x" in out
  # Another method plans without the mixed pipe's block counts.
  argv = ["--config", str(path), "--method", "contiguous", "--json"]
  assert plan_cli.main(argv) == 0
  assert len(json.loads(capsys.readouterr().out)["stage_devices"]) == 2
