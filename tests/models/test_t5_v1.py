"""T5 v1.0 / v1.1 against HuggingFace's PyTorch implementation: its
checkpoints of tiny random models (``save_pretrained``; v1.1 sharded),
read through ``hf:PATH`` by the name map, give its logits; its relative
position buckets. The reference files are written by
``tests/models/make_hf_reference.py`` (torch + transformers, not needed
here)."""

import os

import jax
import numpy as np
import pytest

from jpipe.models import t5_v1
from jpipe.train import base_config, train_lib
from jpipe.train.errors import UsageError
from tests.models import hf_loading

REFERENCE = os.path.join(os.path.dirname(__file__), "hf_reference")
# Logits against the recorded torch ones: XLA's CPU kernels round
# differently across machines (1.5e-5 on T5 v1.1's small logits on an
# AMD EPYC, AVX2, where the recording machine met 1e-5).
T5_ATOL = 5e-5
# The reference models' fields in jpipe's names (make_hf_reference.py
# builds HuggingFace's from these).
TINY = dict(
  vocab_size=300,  # Bytes + span sentinels: also a CLI fine-tuning run.
  d_model=16,
  d_kv=8,
  d_ff=40,
  num_layers=2,
  num_decoder_layers=3,
  num_heads=3,
  relative_attention_num_buckets=8,
  relative_attention_max_distance=20,
)


def _ours(version):
  return t5_v1.Model(**TINY, dropout=0.0, version=version)


@pytest.mark.parametrize("version", ["1.0", "1.1"])
def test_logits_equal_huggingface(version):
  directory = os.path.join(REFERENCE, f"t5-v{version}")
  ref = np.load(os.path.join(directory, "reference.npz"))
  model = _ours(version)
  params = hf_loading.load(
    model, t5_v1.hf_names(model), directory, ref["inputs"], ref["targets"]
  )
  logits = model.apply(
    {"params": params}, ref["inputs"], ref["targets"], train=False
  )
  np.testing.assert_allclose(logits, ref["logits"], rtol=1e-5, atol=T5_ATOL)


def test_relative_position_buckets_equal_huggingface():
  ref = np.load(os.path.join(REFERENCE, "t5_buckets.npz"))
  for bidirectional in (True, False):
    ours = t5_v1.relative_position_bucket(
      ref["offsets"], bidirectional, 32, 128
    )
    np.testing.assert_array_equal(ours, ref[f"bidirectional_{bidirectional}"])


@pytest.mark.slow
def test_sizes_have_the_published_parameter_counts():
  """Abstract (nothing allocated): HuggingFace's counts of t5-small,
  t5-3b and google/t5-v1_1-xl."""
  inputs = jax.ShapeDtypeStruct((1, 8), np.int32)
  expected = {
    "small": 60_506_624,
    "3b": 2_851_598_336,
    "v1_1-xl": 2_849_757_184,
  }
  for size, count in expected.items():
    model = t5_v1.Model(**t5_v1.SIZES[size])
    total = hf_loading.param_count(model, inputs, inputs)
    assert total == count, (size, total)


@pytest.mark.slow
def test_the_cli_fine_tunes_from_a_huggingface_checkpoint(tmp_path):
  """``--config.model.name=t5_v1 --config.init_from=hf:DIR``: T5 v1.0 on
  span corruption from HuggingFace's weights; a checkpoint of the other
  version is one error naming the tensor it lacks."""
  config = base_config.base_config()
  config.data = base_config.text_data("stdlib_text", span_corruption=True)
  config.data.sequence_length = 32
  config.data.batch_size = 8
  config.data.eval_sequences = 8
  config.model.name = "t5_v1"
  config.model.kwargs = {**TINY, "dropout": 0.0}
  config.init_from = f"hf:{os.path.join(REFERENCE, 't5-v1.0')}"
  config.pipeline.num_stages = 2
  config.pipeline.num_microbatches = 2
  config.train.steps = 1
  config.train.profile_last_step = False
  summary = train_lib.train_and_evaluate(config, str(tmp_path / "run"))
  assert np.isfinite(summary["eval"]["loss"])
  steps = [r["step"] for r in train_lib.read_metrics(str(tmp_path / "run"))]
  assert 0 in steps  # The fine-tuning run's step-0 evaluation.
  config.model.kwargs.version = "1.1"  # Gated: wi_0 / wi_1.
  with pytest.raises(UsageError, match="has no tensor .*wi_0.weight"):
    train_lib.train_and_evaluate(config, str(tmp_path / "run2"))


def test_model_size_names_a_size_and_a_wrong_one_is_one_error():
  from jpipe.train import tasks

  config = base_config.base_config()
  config.model.name = "t5_v1"
  config.model.size = "3b"
  config.model.kwargs = {"dropout": 0.0}
  kwargs = tasks.model_kwargs(config)
  assert kwargs["d_ff"] == 16384 and kwargs["dropout"] == 0.0
  config.model.size = "3B"
  with pytest.raises(UsageError, match=r"sizes \['11b', '3b'"):
    tasks.model_kwargs(config)
  config.model.name = "gpt"
  with pytest.raises(UsageError, match="has no named sizes"):
    tasks.model_kwargs(config)
