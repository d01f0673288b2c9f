"""GPT-2 against HuggingFace's PyTorch implementation: its checkpoint of
a tiny random model, read through ``hf:PATH`` by the name map, gives its
logits (reference written by tests/models/make_hf_reference.py)."""

import json
import os

import jax
import numpy as np
import pytest

from jpipe.models import gpt2
from jpipe.train import hf_checkpoint, pretrained
from jpipe.train.errors import UsageError
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


def _pretrained_through_two_stages(after_init=None, **kwargs):
  """HuggingFace's tiny GPT-2 (``gpt2.Model(**kwargs)``), its weights read
  as they are placed, through a 2-stage pipeline: (pipe, state, the params
  on the host); the pipeline's loss is checked equal to one device's.
  ``after_init(lazy params)`` runs once they are placed, before the host
  reads them again."""
  import optax

  import jpipe

  ref = np.load(os.path.join(REFERENCE, "reference.npz"))
  model = gpt2.Model(**GPT2_TINY, dropout=0.0, **kwargs)
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
  if after_init is not None:
    after_init(params)
  whole = jax.tree.map(np.asarray, params)
  np.testing.assert_allclose(
    float(pipe.evaluate(state, batch)["loss"]),
    float(loss_fn(whole, batch)),
    rtol=1e-5,
  )
  return pipe, state, whole


@pytest.mark.slow
def test_the_pretrained_model_through_two_stages_keeps_its_loss():
  """The tied embedding on the first and last stages, from HuggingFace's
  weights (read as they are placed): the loss through the pipeline is
  the loss on one device."""
  _pretrained_through_two_stages()


def test_scanned_layers_load_huggingface_layers_stacked():
  """scan_layers=True: HF's per-layer h.0..., h.1... stacked into the
  scanned leaves (row i = layer i of the unrolled model's load), and the
  logits are HuggingFace's."""
  ref = np.load(os.path.join(REFERENCE, "reference.npz"))
  scanned = gpt2.Model(**GPT2_TINY, dropout=0.0, scan_layers=True)
  names = gpt2.hf_names(scanned)
  params = hf_loading.load(scanned, names, REFERENCE, ref["tokens"], lazy=True)
  leaf = params["blocks"]["c_attn"]["kernel"]
  assert isinstance(leaf, hf_checkpoint.LazyStack) and leaf.reads == 0
  params = jax.tree.map(np.asarray, params)
  unrolled = gpt2.Model(**GPT2_TINY, dropout=0.0)
  flat = hf_loading.load(
    unrolled, gpt2.hf_names(unrolled), REFERENCE, ref["tokens"]
  )
  for i in range(GPT2_TINY["num_layers"]):
    jax.tree.map(
      lambda s, u, i=i: np.testing.assert_array_equal(s[i], u),
      params["blocks"],
      flat[f"block_{i}"],
    )
  logits = scanned.apply({"params": params}, ref["tokens"], train=False)
  np.testing.assert_allclose(logits, ref["logits"], rtol=1e-5, atol=1e-5)


def test_scanned_layers_past_the_checkpoints_are_one_line(tmp_path):
  """A scan longer than the checkpoint's layers: the missing layer's name
  and the stacked leaf it was for; rows of different shapes refused."""
  ref = np.load(os.path.join(REFERENCE, "reference.npz"))
  deeper = gpt2.Model(**{**GPT2_TINY, "num_layers": 3}, scan_layers=True)
  template = hf_loading.abstract_params(deeper, ref["tokens"])
  with pytest.raises(UsageError, match=r"no tensor 'transformer\.h\.2\.") as e:
    pretrained.load_params(
      f"hf:{REFERENCE}", template, hf_names=gpt2.hf_names(deeper)
    )
  assert "'blocks/" in str(e.value) and "\n" not in str(e.value)
  path = tmp_path / "odd.safetensors"
  _write_safetensors(
    path, {"a.0": np.zeros((2, 3), np.float32), "a.1": np.zeros(3, np.float32)}
  )
  with pytest.raises(UsageError, match="'a.1' has shape .3,. but 'a.0'"):
    hf_checkpoint.params(str(path), {"stack/w": (["a.0", "a.1"], False)})


def _write_safetensors(path, tensors):
  """A float32 safetensors file (8-byte header size, JSON header, data)."""
  header, offset = {}, 0
  for name, array in tensors.items():
    end = offset + array.nbytes
    header[name] = {
      "dtype": "F32",
      "shape": list(array.shape),
      "data_offsets": [offset, end],
    }
    offset = end
  text = json.dumps(header).encode()
  with open(path, "wb") as f:
    f.write(len(text).to_bytes(8, "little") + text)
    f.write(b"".join(a.tobytes() for a in tensors.values()))


@pytest.mark.slow
def test_scanned_pretrained_model_through_two_stages_keeps_its_loss():
  """The scanned GPT-2 from HuggingFace's per-layer weights (stacked as
  placed), one layer per stage: the pipeline's loss is one device's,
  each layer read once (by the stage that holds it), and the gathered
  params are stacked as the model declares them."""

  def each_layer_read_once(params):
    rows = params["blocks"]["c_fc"]["kernel"].rows
    assert [r.reads for r in rows] == [1, 1]

  pipe, state, whole = _pretrained_through_two_stages(
    each_layer_read_once, scan_layers=True
  )
  stacked = pipe.gather_params(state)["blocks"]["c_attn"]["kernel"]
  np.testing.assert_array_equal(stacked, whole["blocks"]["c_attn"]["kernel"])


def test_a_checkpoint_deeper_than_the_model_has_its_extra_tensors_named():
  """A 1-layer model from the 2-layer reference: layer 1's tensors are
  unread, and named (HuggingFace warns so too); the 2-layer model reads
  every tensor (GPT-2's causal-mask buffers aside)."""
  ref = np.load(os.path.join(REFERENCE, "reference.npz"))

  def unused(num_layers):
    model = gpt2.Model(**{**GPT2_TINY, "num_layers": num_layers})
    template = hf_loading.abstract_params(model, ref["tokens"])
    loaded = pretrained.load_params(
      f"hf:{REFERENCE}", template, hf_names=gpt2.hf_names(model), lazy=True
    )
    return hf_checkpoint.unused_names(jax.tree.leaves(loaded))

  assert unused(GPT2_TINY["num_layers"]) == []
  extra = unused(1)
  assert extra and all(".h.1." in n for n in extra), extra
