"""BERT against HuggingFace's PyTorch implementation: its checkpoints of
tiny random models with each head, read through ``hf:PATH`` by the name
map, give its logits; full sizes have its parameter counts (reference
written by tests/models/make_hf_reference.py)."""

import json
import os

import jax
import numpy as np
import pytest

from jpipe.models import bert
from tests.models import hf_loading

REFERENCE = os.path.join(os.path.dirname(__file__), "hf_reference")
# The reference models' fields in jpipe's names.
BERT_TINY = dict(
  vocab_size=300,
  max_position=64,
  d_model=24,
  num_layers=2,
  num_heads=3,
  d_ff=40,
)


@pytest.mark.parametrize("head", bert.HEADS)
def test_logits_equal_huggingface(head):
  directory = os.path.join(REFERENCE, f"bert-{head}")
  ref = np.load(os.path.join(directory, "reference.npz"))
  model = bert.Model(**BERT_TINY, dropout=0.0, head=head, num_classes=3)
  args = (ref["tokens"], ref["types"])
  params = hf_loading.load(model, bert.hf_names(model), directory, *args)
  out = model.apply({"params": params}, *args, train=False)
  if head == "pretraining":
    np.testing.assert_allclose(out[0], ref["mlm"], rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(out[1], ref["nsp"], rtol=1e-5, atol=1e-5)
  else:
    np.testing.assert_allclose(out, ref["scores"], rtol=1e-5, atol=1e-5)


def test_sizes_have_huggingfaces_parameter_counts():
  with open(os.path.join(REFERENCE, "bert_counts.json")) as f:
    counts = json.load(f)
  tokens = jax.ShapeDtypeStruct((1, 8), np.int32)
  for size in ("base", "large"):
    model = bert.Model(**bert.SIZES[size])
    total = hf_loading.param_count(model, tokens)
    assert total == counts[f"bert-{size}-pretraining"], size
