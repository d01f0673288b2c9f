"""The seeds' workloads planned at full size on this machine: the
config's model traced on shapes (nothing of its size allocated) and a
stand-in batch of its shapes (its dataset is not here)."""

import dataclasses
import json
import os
import resource
import subprocess
import sys

import jax
import numpy as np
import pytest
import tensorflow_datasets as tfds

from configs import default as default_config
from jpipe.data import text_examples
from jpipe.train import (
  config_plan,
  input_pipeline,
  metric_log,
  pretrained,
  tasks,
  text_generation,
  text_metrics,
  train_lib,
)
from jpipe.train import plan as plan_cli
from tests.tiers import slow
from tests.train.test_text_tasks import _by_name, _squad_records

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(__file__)))
GIB = 2**30


def _plan(*argv):
  done = subprocess.run(
    [sys.executable, "-m", "jpipe.train.plan", *argv],
    cwd=ROOT,
    capture_output=True,
    text=True,
    timeout=300,
    env=dict(os.environ, PYTHONPATH=ROOT),
  )
  assert done.returncode == 0, done.stderr[-3000:]
  return done


@pytest.mark.slow
def test_t5_3b_mixed_pipe_plans_on_8_devices_of_11_gib():
  """FTPipe's T5-3B: the README-documented command plans it in under
  2 minutes and 8 GB here; the mixed pipe makes about FTPipe's 29 stages
  on its 8 devices (32 blocks), every device's predicted bytes (the sum
  of its stages') fit 11 GiB, and the params add up to T5-3B's
  (2,851,598,336 x 4 bytes)."""
  before = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
  done = _plan("--config", "configs/seeds/ftpipe_t5_3b.py", "--json")
  peak = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
  assert max(peak, before) * 1024 < 8e9
  result = json.loads(done.stdout)
  assert result["method"] == "mixed"
  devices = {d for ds in result["stage_devices"] for d in ds}
  assert devices == set(range(8)) and 24 <= len(result["stage_devices"]) <= 32
  assert "7.33x" in result["paper_plan"]
  held = result["device_memory_bytes"]
  assert max(held.values()) <= 11 * GIB == result["memory_limit"]
  # A device holds its stages' persistent bytes and the largest working
  # bytes among them (one program runs at a time).
  per_device, peak = np.zeros(8), np.zeros(8)
  for ds, total, work in zip(
    result["stage_devices"],
    result["stage_memory_bytes"],
    result["stage_working_bytes"],
    strict=True,
  ):
    per_device[ds[0]] += total - work
    peak[ds[0]] = max(peak[ds[0]], work)
  per_device += peak
  np.testing.assert_allclose(
    per_device, [held[str(d)] for d in range(8)], rtol=1e-12
  )
  # T5-3B's params, its tied embedding held by the three stages that
  # use it (encoder and decoder embeddings, the head).
  params = sum(result["plan"]["stage_param_bytes"])
  assert params == 4 * (2_851_598_336 + 2 * 32128 * 1024)
  # 8 devices, recomputing (a node costs 4 forwards, 3 on the last stage
  # and on one device): at most 6x over one device without recomputation
  # (FTPipe's own partitioner: 5.52x); its stages' work over the
  # bottleneck at most 8 (FTPipe: 7.33x).
  assert result["speedup"] > 5.5
  assert 7.0 < result["speedup_at_stage_costs"] <= 8.0


@pytest.mark.slow
def test_a_plan_that_cannot_fit_names_the_device_and_the_fixes(capsys):
  code = plan_cli.main(
    ["--config", "configs/seeds/ftpipe_t5_3b.py", "--memory", "4GiB"]
  )
  err = capsys.readouterr().err
  assert code == 2
  assert "no mixed-pipe placement on 8 devices fits" in err
  assert "on device" in err and "use more devices" in err


def test_a_contiguous_plan_that_cannot_fit_names_its_stage(capsys):
  code = plan_cli.main(
    [
      "--config",
      "configs/seeds/ftpipe_bert_large.py",
      "--method",
      "contiguous",
      "--memory",
      "3GiB",
    ]
  )
  err = capsys.readouterr().err
  assert code == 2
  assert "no split into 8 stages fits memory_limit" in err
  assert "set by stage 0 (nodes Model._embeddings .. layer_" in err
  assert "use more stages, recomputation" in err


def test_abstract_task_is_shapes_of_the_real_one():
  """build_task(abstract=True): the params are ShapeDtypeStructs of the
  real params' shapes, the batch has the real batch's shapes and the
  loss traces on them."""
  config = default_config.get_config()
  real = tasks.build_task(config)
  abstract = tasks.build_task(config, abstract=True)
  assert all(
    isinstance(x, jax.ShapeDtypeStruct)
    for x in jax.tree.leaves(abstract.params)
  )
  shapes = lambda t: jax.tree.map(lambda x: (x.shape, x.dtype), t)  # noqa: E731
  assert shapes(abstract.params) == shapes(real.params)
  assert shapes(abstract.batch_at(0)) == shapes(real.batch_at(0))
  loss = jax.eval_shape(abstract.loss_fn, abstract.params, abstract.batch_at(0))
  assert loss.shape == ()


# Full-size seed configs: (file, devices, memory limit in GiB or None).
FULL_SIZE = [
  slow("ftpipe_gpt2_xl.py", 8, 11),
  ("ftpipe_bert_large.py", 8, 11),
  ("ftpipe_wrn28x10.py", 4, None),
  slow("pipedream_vgg16.py", 16, None),
  ("pipedream_resnet50.py", 16, None),
  ("sdpipe_resnet50.py", 4, None),
  ("dynpipe_vgg16.py", 8, None),
  slow("pipedream_gnmt16.py", 16, 16),
  ("sdpipe_bert.py", 4, None),
  ("dynpipe_bert.py", 8, None),
]


@pytest.mark.parametrize("name, devices, limit", FULL_SIZE)
def test_every_full_size_seed_config_plans(capsys, name, devices, limit):
  """Each seed config at its real size plans on shapes here: every
  device used, within its memory limit where the config sets one."""
  code = plan_cli.main(["--config", f"configs/seeds/{name}", "--json"])
  out = capsys.readouterr()
  assert code == 0, out.err
  result = json.loads(out.out)
  used = {d for ds in result["stage_devices"] for d in ds}
  assert used == set(range(devices))
  held = result["device_memory_bytes"]
  assert held and min(held.values()) > 0
  if limit is not None and result["method"] in ("mixed", "contiguous"):
    # (PipeDream's methods keep to PipeDream's own memory model.)
    assert max(held.values()) <= limit * GIB == result["memory_limit"]
  assert result["bottleneck"] >= result["lower_bound"] * (1 - 1e-9)


@pytest.mark.parametrize(
  "seed, small",
  [
    ("ftpipe_wrn28x10.py:small:ws", "wrn_stale.py:ws"),
    ("pipedream_vgg16.py:small", "pipedream_vgg.py:ws"),
    ("pipedream_resnet50.py:small:stale", "pipedream_resnet.py:stale"),
    ("sdpipe_resnet50.py:small", "sdpipe.py"),
    ("dynpipe_vgg16.py:small", "dynpipe.py"),
  ],
)
def test_image_seed_small_variants_are_the_configs_ci_trains(seed, small):
  """These :small variants are the scaled configs test_configs trains
  (and checks the accuracy of) in every CI run."""
  got = config_plan.load_config_file(f"configs/seeds/{seed}")
  want = config_plan.load_config_file(f"configs/{small}")
  assert got.to_dict() == want.to_dict()


@pytest.mark.slow
@pytest.mark.parametrize(
  "name, metric",
  [
    # T5 v1.0 on the mixed pipe, async stale, Adafactor.
    ("ftpipe_t5_3b.py", "perplexity"),
    # GPT-2 on the mixed pipe, async stale, AdamW.
    ("ftpipe_gpt2_xl.py", "perplexity"),
    # GNMT, PipeDream's straight split, async with stashing.
    ("pipedream_gnmt16.py", "perplexity"),
    # BERT pre-training: SD-Pipe's 4 pipelines with partial reduce, and
    # DynPipe's policy under a slowed device.
    ("sdpipe_bert.py", "mlm_loss"),
    ("dynpipe_bert.py", "mlm_loss"),
  ],
)
def test_text_seed_small_variants_train(tmp_path, name, metric):
  """A text seed's :small on the embedded text (steps shortened to 20):
  its held-out loss falls from step 10 to step 20; the papers' generated
  metrics it logs (FTPipe's T5 SQuAD exact match and F1, PipeDream's GNMT
  BLEU) are those of the text its params generate."""
  config = config_plan.load_config_file(f"configs/seeds/{name}:small")
  config.unlock()
  config.train.steps = 20
  config.train.eval_every = 10
  config.train.checkpoint_every = 20
  config.train.profile_last_step = False
  if "eval_examples" in config.data:  # (Generation: 16 answers, not 64.)
    config.data.eval_examples = 16
  if config.data_parallel.pipelines > 1:
    config.data_parallel.epoch_batches = 5  # (Evaluates once per epoch.)
  if config.dynamic.enabled:  # Its slowdown inside the 20 steps.
    config.dynamic.window = 5
    config.dynamic.inject = "1:3.0:5:15"
  train_lib.train_and_evaluate(config, str(tmp_path))
  evals = [
    row
    for row in metric_log.read_metrics(str(tmp_path))
    if f"eval/{metric}" in row
  ]
  values = [row[f"eval/{metric}"] for row in evals]
  assert len(values) >= 2 and values[-1] < values[0], values
  if name in GENERATED_METRICS:  # At step 20: the last checkpoint's params.
    (logged,) = [r for r in evals if r["step"] == config.train.steps]
    GENERATED_METRICS[name](config, tmp_path, logged)
  if config.pipeline.partition == "mixed":
    plan = json.loads(open(tmp_path / "plan.json").read())
    used = {d for ds in plan["stage_devices"] for d in ds}
    assert used == set(range(config.pipeline.num_stages))
    if name == "ftpipe_t5_3b.py":  # More stages than devices. (GPT-2's
      # small plan, its last stage priced without recomputation, is as
      # fast straight: the mixed solver keeps the straight split then.)
      assert len(plan["stage_devices"]) > config.pipeline.num_stages


def _generated_texts(config, workdir):
  """(the texts the workdir's last params generate on one device -- a
  greedy loop, not the pipeline --, the held-out records they answer)."""
  task = tasks.build_task(config)
  params = pretrained.load_params(str(workdir), task.params)
  rows = []
  capture = dataclasses.replace(
    task.evaluation.generation, score=lambda r: rows.append(r) or {}
  )
  capture.on_one_device(params)
  encoder = text_examples.Encoder(input_pipeline.tokenizer(config))
  texts = [text_generation.text_of(encoder, row) for row in rows[0]]
  held_out = input_pipeline.records(config, config.data.eval_split)
  return texts, [held_out[i] for i in range(len(texts))]


def _squad_scores_are_its_answers(config, workdir, logged):
  texts, records = _generated_texts(config, workdir)
  assert len(texts) == config.data.eval_examples
  golds = [
    [input_pipeline.as_text(a) for a in r["answers"]["text"]] for r in records
  ]
  want = text_metrics.squad(texts, golds)
  assert logged["eval/generated_exact_match"] == pytest.approx(
    want["exact_match"], abs=1e-9
  )
  assert logged["eval/generated_f1"] == pytest.approx(want["f1"], abs=1e-9)


def _bleu_is_its_translations(config, workdir, logged):
  texts, records = _generated_texts(config, workdir)
  assert len(texts) == config.data.eval_examples
  references = [input_pipeline.as_text(r["target"]) for r in records]
  want = text_metrics.bleu(texts, references)
  assert logged["eval/bleu"] == pytest.approx(want["bleu"], abs=1e-9)
  assert np.isfinite(logged["eval/bleu"])


GENERATED_METRICS = {
  "ftpipe_t5_3b.py": _squad_scores_are_its_answers,
  "pipedream_gnmt16.py": _bleu_is_its_translations,
}


@pytest.mark.slow
def test_bert_large_small_variant_trains_on_squad_records(tmp_path):
  """ftpipe_bert_large.py:small on TFDS mock records of SQuAD's features
  (the tests' learnable synthetic spans, served through the real data
  source path): BERT's span head through the mixed pipe, async; the
  held-out span exact match rises."""
  config = config_plan.load_config_file(
    "configs/seeds/ftpipe_bert_large.py:small"
  )
  config.unlock()
  config.train.checkpoint_every = 60
  config.train.profile_last_step = False
  with tfds.testing.mock_data(as_data_source_fn=_by_name(_squad_records)):
    config.train.steps = 1
    config.train.eval_every = 1
    start = train_lib.train_and_evaluate(config, str(tmp_path / "a"))
    config.train.steps = 60
    config.train.eval_every = 60
    end = train_lib.train_and_evaluate(config, str(tmp_path / "b"))
  assert end["eval"]["span_exact_match"] > start["eval"]["span_exact_match"]


@pytest.mark.slow
def test_pipedream_resnet50_trains_on_streamed_imagenet_records(tmp_path):
  """pipedream_resnet50.py's own path -- ImageNet's features (TFDS mock
  records of varying size) streamed, resized and augmented per batch,
  a bottleneck ResNet split by PipeDream's hybrid DP, async with
  stashing, evaluated through the stages -- at a size for 2 CPU cores."""
  config = config_plan.load_config_file("configs/seeds/pipedream_resnet50.py")
  config.unlock()
  config.data.image_shape = (32, 32, 3)
  config.data.batch_size = 8
  config.data.eval_examples = 8
  config.model.kwargs.blocks = (1, 1)
  config.model.kwargs.stem = "cifar"
  config.pipeline.num_stages = 2
  config.pipeline.num_microbatches = 2
  config.pipeline.memory_limit = ""
  config.optimizer.decay_steps = "100"
  config.train.steps = 3
  config.train.eval_every = 3
  config.train.checkpoint_every = 3
  config.train.profile_last_step = False
  with tfds.testing.mock_data(num_examples=16):
    summary = train_lib.train_and_evaluate(config, str(tmp_path))
  assert 0.0 <= summary["eval"]["accuracy"] <= 1.0


@pytest.mark.slow
@pytest.mark.parametrize(
  "seed",
  [
    # (Convolutions over 30 steps: 57 CPU-seconds quick, 40 optimised.)
    pytest.param("ftpipe_wrn28x10.py:small", marks=pytest.mark.compute_bound),
    # (pipedream_vgg16's and pipedream_resnet50's :small -- ws+rr, on
    # their straight small plan -- train 30 steps with a replicated stage
    # in test_pipedream_small_trains_with_round_robin_replicas.)
    "sdpipe_resnet50.py:small",
    "dynpipe_vgg16.py:small",
  ],
)
def test_image_seed_small_variants_move_their_loss(tmp_path, seed):
  """Each image seed's :small run (steps shortened to 30): its training
  loss over the last 5 steps is below the first 5 steps' (the seeds'
  asynchronous runs swing in held-out accuracy over so few steps; VGG
  leaves its initial plateau late)."""
  config = config_plan.load_config_file(f"configs/seeds/{seed}")
  config.unlock()
  config.train.steps = 30
  config.train.log_every = 1
  config.train.eval_every = 30
  config.train.checkpoint_every = 30
  config.train.profile_last_step = False
  if config.data_parallel.pipelines > 1:  # Epochs of 10 batches.
    config.data_parallel.epoch_batches = 10
  if config.dynamic.enabled:  # Its slowdown inside the 30 steps.
    config.dynamic.inject = "1:3.0:10:20"
  train_lib.train_and_evaluate(config, str(tmp_path))
  loss = [
    row["train/loss"]
    for row in metric_log.read_metrics(str(tmp_path))
    if "train/loss" in row
  ]
  # (SD-Pipe logs once per epoch of 10 batches: 3 rows.)
  n = max(1, min(5, len(loss) // 2))
  assert len(loss) >= 2, loss
  assert np.mean(loss[-n:]) < 0.98 * np.mean(loss[:n]), loss


def test_ftpipe_t5_3b_is_the_capped_mixed_pipe():
  """FTPipe's T5-3B run: the mixed pipe of 32 blocks (about its 29
  stages), stale, delays capped by the devices (virtual_stages_1f1b)."""
  config = config_plan.load_config_file("configs/seeds/ftpipe_t5_3b.py")
  assert config.pipeline.partition == "mixed"
  assert config.pipeline.mixed_blocks == "32"
  assert config.schedule.supremum_staleness == "auto"
  assert config.schedule.name == "async" and not config.staleness.stashing


def test_pipedream_seeds_default_to_their_runtime():
  """pipedream_vgg16 and pipedream_resnet50 (replicated plans) default to
  PipeDream's 1F1B-RR: the stale stream, weight stashing, round-robin
  replicas (ResNet's with a BatchNorm statistics copy per replica);
  gnmt16's straight plan has none to route."""
  for name in ("pipedream_vgg16.py", "pipedream_resnet50.py"):
    rr = config_plan.load_config_file(f"configs/seeds/{name}")
    assert rr.pipeline.replica_routing == "round_robin", name
    assert rr.staleness.stashing and rr.schedule.step_every == 1
    assert rr.pipeline.partition == "pipedream_hybrid"
    split = config_plan.load_config_file(f"configs/seeds/{name}:ws")
    assert (
      split.pipeline.replica_routing == "split" and split.staleness.stashing
    )
  gnmt = config_plan.load_config_file("configs/seeds/pipedream_gnmt16.py")
  assert gnmt.pipeline.replica_routing == "split"


@pytest.mark.slow
@pytest.mark.parametrize(
  "seed",
  [
    # (VGG's convolutions: 48.7 CPU-seconds quick, 35.2 optimised; the
    # ResNet's smaller ones are compile-bound, 37.6 and 41.3.)
    pytest.param("pipedream_vgg16.py", marks=pytest.mark.compute_bound),
    "pipedream_resnet50.py",
  ],
)
def test_pipedream_small_trains_with_round_robin_replicas(tmp_path, seed):
  """The seed's :small:ws+rr on a 2-1-1 plan (stage 0 on two devices,
  microbatches dealt round robin; ResNet's with each replica's own
  BatchNorm statistics): its training loss falls over 30 steps, and
  plan.json records the replicated stage."""
  config = config_plan.load_config_file(f"configs/seeds/{seed}:small:ws+rr")
  config.unlock()
  config.pipeline.partition = "contiguous"
  config.pipeline.num_stages = 3
  config.pipeline.replicas = "2,1,1"
  config.train.steps = 30
  config.train.log_every = 1
  config.train.eval_every = 30
  config.train.checkpoint_every = 30
  config.train.profile_last_step = False
  train_lib.train_and_evaluate(config, str(tmp_path))
  plan = json.loads(open(tmp_path / "plan.json").read())
  assert plan["stage_devices"] == [[0, 1], [2], [3]]
  loss = [
    row["train/loss"]
    for row in metric_log.read_metrics(str(tmp_path))
    if "train/loss" in row
  ]
  assert np.mean(loss[-5:]) < 0.98 * np.mean(loss[:5]), loss


@pytest.mark.slow
def test_gpt2_xl_small_trains_with_scanned_layers(tmp_path):
  """ftpipe_gpt2_xl's :small with model.kwargs.scan_layers=True (its 2
  blocks under one nn.scan, as production JAX code stacks them): the plan
  splits the scan per layer (a stage per block), it trains, and the
  checkpoint keeps the stacked layout."""
  config = config_plan.load_config_file("configs/seeds/ftpipe_gpt2_xl.py:small")
  config.unlock()
  config.model.kwargs.scan_layers = True
  config.pipeline.partition = "contiguous"
  config.schedule.name = "1f1b"
  config.train.steps = 2
  config.train.eval_every = 2
  config.train.checkpoint_every = 2
  config.train.profile_last_step = False
  train_lib.train_and_evaluate(config, str(tmp_path))
  plan = json.loads(open(tmp_path / "plan.json").read())
  names = plan["node_names"]
  assert [n for n in names if n.startswith("blocks[")] == [
    "blocks[0]",
    "blocks[1]",
  ]
  stage = dict(zip(names, plan["stage_of_node"], strict=True))
  assert stage["blocks[0]"] != stage["blocks[1]"]
  assert np.isfinite(metric_log.read_metrics(str(tmp_path))[-1]["eval/loss"])
  # The checkpoint holds the stacked leaves as the model declares them.
  template = tasks.build_task(config).params
  saved = pretrained.load_params(str(tmp_path), template)
  stacked = [x.shape[0] for x in jax.tree.leaves(saved["blocks"])]
  assert stacked and set(stacked) == {2}
