"""``python -m jpipe.train.plan --config``: the plan training would use."""

import json
import os

import jax
import pytest

from jpipe.train import config_check, config_plan, tasks, train_lib
from jpipe.train import plan as plan_cli
from jpipe.train.errors import UsageError
from tests.tiers import slow

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(__file__)))


def _run(capsys, *argv):
  code = plan_cli.main(list(argv))
  captured = capsys.readouterr()
  return code, captured.out, captured.err


@pytest.mark.parametrize(
  "spec, stages",
  [slow("wrn_stale.py:ws", 3), slow("t5.py", 4), ("default.py", 2)],
)
def test_cli_plan_is_the_plan_training_builds(capsys, spec, stages):
  path = os.path.join(ROOT, "configs", spec)
  code, out, _ = _run(
    capsys, "--config", path, "--stages", str(stages), "--json"
  )
  assert code == 0
  result = json.loads(out)
  config = config_plan.load_config_file(path)
  with config.unlocked():
    config.pipeline.num_stages = stages
  task = tasks.build_task(config)
  lr = train_lib.learning_rate(config)
  pipe = train_lib.build_pipeline(
    config, task, task.batch_at(0), train_lib.build_optimizer(config, lr), lr
  )
  assert result["stage_of"] == pipe.plan.stage_of
  assert result["method"] == config.pipeline.partition
  assert len(result["stage_costs"]) == stages
  assert result["bottleneck"] >= result["lower_bound"] - 1e-12
  assert sum(result["stage_costs"]) == pytest.approx(result["sequential"])
  assert result["plan"]["node_names"] == list(pipe.plan.node_names)


def test_cli_table_and_png(capsys, tmp_path):
  png = tmp_path / "plan.png"
  code, out, _ = _run(
    capsys,
    "--config",
    os.path.join(ROOT, "configs", "pipedream_vgg.py"),
    "--stages",
    "4",
    "--method",
    "contiguous",
    "--png",
    str(png),
  )
  assert code == 0
  assert "contiguous, 4 stages on 4 devices" in out and "stage 3 (" in out
  assert png.stat().st_size > 1000


def test_cli_config_errors(capsys):
  path = os.path.join(ROOT, "configs", "default.py")
  code, _, err = _run(capsys, "--config", path, "--stages", "9")
  assert code == 2 and "stages" in err
  code, _, err = _run(
    capsys, "--config", path, "--stages", "2", "--method", "metis"
  )
  assert code == 2 and "unknown method 'metis'" in err
  code, _, err = _run(capsys, "--config", "nope.py", "--stages", "2")
  assert code == 2 and "config file 'nope.py' does not exist" in err
  code, _, err = _run(capsys, "--config", path, "--devices", "0")
  assert code == 2 and "--devices must be >= 1, got 0" in err
  with pytest.raises(SystemExit):
    plan_cli.main(["--stages", "2"])  # No --config.
  # A picture into a folder that does not exist: refused before planning.
  code, _, err = _run(capsys, "--config", path, "--png", "/no/such/plan.png")
  assert code == 2 and "--png /no/such/plan.png: no folder /no/such" in err


@pytest.mark.slow
def test_pipedream_hybrid_with_fast_links_is_data_parallel_and_trains(
  capsys, tmp_path
):
  """config.pipeline.bandwidth reaches the planner: on fast links
  PipeDream's DP replicates VGG over all 4 devices (the CLI and training
  agree), and training runs on that replica group."""
  path = os.path.join(ROOT, "configs", "pipedream_vgg.py")
  code, out, _ = _run(
    capsys,
    "--config",
    path,
    "--stages",
    "4",
    "--method",
    "pipedream_hybrid",
    "--bandwidth",
    "1e13",
    "--json",
  )
  assert code == 0
  assert json.loads(out)["stage_devices"] == [[0, 1, 2, 3]]
  config = config_plan.load_config_file(path)
  with config.unlocked():
    config.pipeline.partition = "pipedream_hybrid"
    config.pipeline.bandwidth = 1e13
    config.train.steps = 2
    config.train.eval_every = 2
  train_lib.train_and_evaluate(config, str(tmp_path))
  assert "stages on devices [[0, 1, 2, 3]]" in capsys.readouterr().out


@pytest.mark.slow
def test_pipedream_hybrid_round_robin_variant_trains(capsys, tmp_path):
  """At 3e10 bytes/s PipeDream's DP gives the small VGG its 3-1 split;
  the "ws+rr" variant runs it as PipeDream does, 1F1B-RR (whole
  microbatches dealt to the 3 replicas, tests/runtime/test_round_robin.py
  for the semantics)."""
  config = config_plan.load_config_file(
    os.path.join(ROOT, "configs", "pipedream_vgg.py") + ":ws+rr"
  )
  assert config.pipeline.replica_routing == "round_robin"
  config.pipeline.partition = "pipedream_hybrid"
  config.pipeline.bandwidth = 3e10
  config.train.steps = 4
  config.train.eval_every = 4
  summary = train_lib.train_and_evaluate(config, str(tmp_path))
  out = capsys.readouterr().out
  assert "stages on devices [[0, 1, 2], 3]" in out
  assert "round-robin replicas (1F1B-RR)" in out
  assert summary["eval"]["accuracy"] is not None


@pytest.fixture
def optimized_compiles():
  """XLA's optimisations back on for one test (the module skips them)."""
  previous = jax.config.read("jax_disable_most_optimizations")
  jax.config.update("jax_disable_most_optimizations", False)
  yield
  jax.config.update("jax_disable_most_optimizations", previous)


# The replicas' measured speeds must be the simulated work's: unoptimised
# programs ran ~10x slower than the 40 ms sleeps here and hid the slowed
# replica (40, 33, 40 examples/s: no re-split worth 5 %).
@pytest.mark.usefixtures("optimized_compiles")
@pytest.mark.slow
def test_dynpipe_rebalances_a_weighted_hybrid_plan(capsys, tmp_path):
  """The "wr" variant on PipeDream's 3-1 VGG plan, re-partitioning on:
  device 1 (a replica of slot 0) 4x slower from step 4, so the next
  measured window re-splits slot 0's microbatches by its replicas'
  speeds (DynPipe's DP-stage load balancing), printed and logged."""
  config = config_plan.load_config_file(
    os.path.join(ROOT, "configs", "pipedream_vgg.py") + ":ws+wr"
  )
  assert config.pipeline.replica_routing == "weighted"
  with pytest.raises(ValueError, match="two replica routings"):
    config_plan.load_config_file(
      os.path.join(ROOT, "configs", "pipedream_vgg.py") + ":ws+rr+wr"
    )
  config.pipeline.partition = "pipedream_hybrid"
  config.pipeline.bandwidth = 3e10
  config.dynamic.enabled = True
  config.dynamic.window = 2
  config.dynamic.simulated_ms = 40.0
  config.dynamic.inject = "1:4:4"
  config.train.steps = 8
  config.train.eval_every = 8
  summary = train_lib.train_and_evaluate(config, str(tmp_path))
  out = capsys.readouterr().out
  assert "stages on devices [[0, 1, 2], 3]" in out
  assert "split each microbatch by weight" in out
  (record,) = summary["rebalances"]
  assert record["step"] == 6 and record["stage"] == 0
  new = record["new"]
  assert new[1] < min(new[0], new[2])  # The slow replica takes fewest.
  assert f"re-split at step 6: stage 0's replicas take {record['old']}" in out
  events = [
    json.loads(line)
    for line in (tmp_path / "metrics.jsonl").read_text().splitlines()
  ]
  assert any("rebalance" in e for e in events)
  assert summary["eval"]["accuracy"] is not None


def test_a_weighted_groups_re_split_is_one_printed_line():
  """The line a weighted replica group's re-split prints (the slow tier's
  run above prints it from a real re-split)."""
  from jpipe.train import dynamic_mode

  record = {
    "stage": 1,
    "old": [4, 4],
    "new": [6, 2],
    "examples_per_second": [812.4, 271.0],
    "predicted_gain": 1.4567,
  }
  assert dynamic_mode.rebalance_line(9, record) == (
    "re-split at step 9: stage 1's replicas take [4, 4] -> [6, 2] examples "
    "of each microbatch (measured 812, 271 examples/s; predicted 1.46x "
    "faster)"
  )


_LOOP_CONFIG = """
from configs import default


def get_config():
  c = default.get_config()
  c.schedule.name = "interleaved"
  c.pipeline.num_stages = 4
  c.pipeline.stages_per_device = 2
  return c
"""


def test_stages_per_device_loops_the_stages_in_plan_and_training(
  capsys, tmp_path
):
  """pipeline.stages_per_device=2 with 4 stages: 2 devices, stage s on
  device s mod 2 (Megatron's virtual stages), in the plan CLI and in the
  pipeline training builds; without a loop schedule: one line."""
  path = tmp_path / "loop.py"
  path.write_text(_LOOP_CONFIG)
  code, out, err = _run(capsys, "--config", str(path), "--json")
  assert code == 0, err
  assert json.loads(out)["plan"]["stage_devices"] == [[0], [1], [0], [1]]
  config = config_plan.load_config_file(str(path))
  task = tasks.build_task(config)
  lr = train_lib.learning_rate(config)
  pipe = train_lib.build_pipeline(
    config, task, task.batch_at(0), train_lib.build_optimizer(config, lr), lr
  )
  assert pipe.plan.stage_devices == ((0,), (1,), (0,), (1,))
  assert list(pipe.devices) == jax.devices()[:2]
  with config.unlocked():
    config.schedule.name = "1f1b"
  with pytest.raises(UsageError, match="need a loop schedule"):
    config_check.check(config)
