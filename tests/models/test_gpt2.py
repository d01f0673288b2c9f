"""GPT-2 against HuggingFace's PyTorch implementation: its checkpoint of
a tiny random model, read through ``hf:PATH`` by the name map, gives its
logits (reference written by tests/models/make_hf_reference.py)."""

import os

import jax
import numpy as np
import pytest

from jpipe.models import gpt2
from tests.models import hf_loading

REFERENCE = os.path.join(os.path.dirname(__file__), "hf_reference", "gpt2")
# The reference model's fields in jpipe's names.
GPT2_TINY = dict(
  vocab_size=300, n_positions=64, d_model=24, num_layers=2, num_heads=3
)


def test_logits_equal_huggingface():
  ref = np.load(os.path.join(REFERENCE, "reference.npz"))
  model = gpt2.Model(**GPT2_TINY, dropout=0.0)
  params = hf_loading.load(
    model, gpt2.hf_names(model), REFERENCE, ref["tokens"]
  )
  logits = model.apply({"params": params}, ref["tokens"], train=False)
  np.testing.assert_allclose(logits, ref["logits"], rtol=1e-5, atol=1e-5)


def test_sizes_have_the_published_parameter_counts():
  """Abstract: HuggingFace's counts of gpt2 and gpt2-xl (tied head)."""
  tokens = jax.ShapeDtypeStruct((1, 8), np.int32)
  for size, count in {"small": 124_439_808, "xl": 1_557_611_200}.items():
    total = hf_loading.param_count(gpt2.Model(**gpt2.SIZES[size]), tokens)
    assert total == count, (size, total)


@pytest.mark.slow
def test_the_pretrained_model_through_two_stages_keeps_its_loss():
  """The tied embedding on the first and last stages, from HuggingFace's
  weights (read as they are placed): the loss through the pipeline is
  the loss on one device."""
  import optax

  import jpipe

  ref = np.load(os.path.join(REFERENCE, "reference.npz"))
  model = gpt2.Model(**GPT2_TINY, dropout=0.0)
  params = hf_loading.load(
    model, gpt2.hf_names(model), REFERENCE, ref["tokens"], lazy=True
  )

  def loss_fn(params, batch):
    logits = model.apply({"params": params}, batch["x"], train=False)
    return optax.softmax_cross_entropy_with_integer_labels(
      logits[:, :-1], batch["x"][:, 1:]
    ).mean()

  batch = {"x": np.concatenate([ref["tokens"]] * 2)}
  pipe = jpipe.Pipeline(
    loss_fn,
    params,
    batch,
    num_stages=2,
    schedule="1f1b",
    num_microbatches=2,
    optimizer=optax.sgd(0.0),
    devices=jax.devices()[:2],
  )
  state = pipe.init(params)
  whole = jax.tree.map(np.asarray, params)
  np.testing.assert_allclose(
    float(pipe.evaluate(state, batch)["loss"]),
    float(loss_fn(whole, batch)),
    rtol=1e-5,
  )
