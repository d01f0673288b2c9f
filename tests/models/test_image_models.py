"""The seeds' image models at their published sizes: parameter counts
equal torchvision's (ResNet, VGG) and the WRN paper's layout, counted on
shapes only; a tiny bottleneck ResNet's forward against a NumPy
restatement of its layers."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jpipe.models import imagenet_resnet, resnet, vgg


def _count(model, shape):
  variables = jax.eval_shape(
    lambda: model.init(jax.random.key(0), jnp.zeros(shape), train=False)
  )
  return sum(x.size for x in jax.tree.leaves(variables["params"]))


# torchvision.models' documented parameter counts (1000 classes, 224x224).
TORCHVISION = {
  (imagenet_resnet, "18"): 11_689_512,
  (imagenet_resnet, "34"): 21_797_672,
  (imagenet_resnet, "50"): 25_557_032,
  (imagenet_resnet, "101"): 44_549_160,
  (imagenet_resnet, "152"): 60_192_808,
  (vgg, "11"): 132_863_336,
  (vgg, "16"): 138_357_544,
}


@pytest.mark.parametrize("module, size", list(TORCHVISION))
def test_parameter_counts_equal_torchvision(module, size):
  model = module.Model(**module.SIZES[size])
  assert _count(model, (1, 224, 224, 3)) == TORCHVISION[(module, size)]


def test_wrn_28_10_count():
  """Pre-activation WRN-28-10 with 1x1 projection shortcuts on CIFAR-100:
  the conv weights restated from the layout (16 -> 160 -> 320 -> 640, 4
  blocks per group), BatchNorm scale + bias, the head."""
  widths = [16, 160, 320, 640]
  conv = 3 * 3 * 3 * 16
  bn = 0
  for g in range(3):
    cin, cout = widths[g], widths[g + 1]
    for i in range(4):
      c = cin if i == 0 else cout
      conv += 9 * c * cout + 9 * cout * cout + (c * cout if c != cout else 0)
      bn += 2 * c + 2 * cout
  bn += 2 * 640
  head = 640 * 100 + 100
  model = resnet.Model(**resnet.SIZES["28-10"])
  assert _count(model, (1, 32, 32, 3)) == conv + bn + head


def _conv(x, w, stride, pad):
  """NumPy NHWC convolution, kernel HWIO."""
  x = np.pad(x, ((0, 0), (pad, pad), (pad, pad), (0, 0)))
  kh, kw, _, cout = w.shape
  n, h, wd, _ = x.shape
  oh, ow = (h - kh) // stride + 1, (wd - kw) // stride + 1
  out = np.zeros((n, oh, ow, cout))
  for i in range(oh):
    for j in range(ow):
      patch = x[:, i * stride : i * stride + kh, j * stride : j * stride + kw]
      out[:, i, j] = np.einsum("nhwc,hwco->no", patch, w)
  return out


def _bn(x, p, s):
  return (x - s["mean"]) / np.sqrt(s["var"] + 1e-5) * p["scale"] + p["bias"]


def _block(x, p, s, stride):
  y = np.maximum(
    _bn(_conv(x, p["conv_0"]["kernel"], 1, 0), p["bn_0"], s["bn_0"]), 0
  )
  y = np.maximum(
    _bn(_conv(y, p["conv_1"]["kernel"], stride, 1), p["bn_1"], s["bn_1"]), 0
  )
  y = _bn(_conv(y, p["conv_2"]["kernel"], 1, 0), p["bn_2"], s["bn_2"])
  short = x
  if "shortcut" in p:
    short = _bn(
      _conv(x, p["shortcut"]["kernel"], stride, 0),
      p["shortcut_bn"],
      s["shortcut_bn"],
    )
  return np.maximum(y + short, 0)


@pytest.mark.slow
def test_bottleneck_resnet_equals_numpy_in_evaluation():
  """Two bottleneck groups (one block each, the second strided) on the
  CIFAR stem, random BatchNorm statistics: logits equal a NumPy
  restatement (stride on the 3x3, projection shortcut, mean pool)."""
  model = imagenet_resnet.Model(
    blocks=(1, 1), num_classes=5, stem="cifar", bottleneck=True
  )
  x = np.random.default_rng(0).normal(size=(2, 8, 8, 3)).astype(np.float32)
  variables = model.init(jax.random.key(0), x, train=False)
  rng = np.random.default_rng(1)
  stats = jax.tree.map(
    lambda v: rng.uniform(0.5, 1.5, v.shape).astype(np.float32),
    variables["batch_stats"],
  )
  params = jax.tree.map(
    lambda v: v + rng.normal(0, 0.1, v.shape).astype(np.float32),
    variables["params"],
  )
  got = model.apply({"params": params, "batch_stats": stats}, x, train=False)
  p = jax.tree.map(np.asarray, params)
  s = jax.tree.map(np.asarray, stats)
  y = np.maximum(
    _bn(
      _conv(x, p["stem"]["conv"]["kernel"], 1, 1),
      p["stem"]["bn"],
      s["stem"]["bn"],
    ),
    0,
  )
  y = _block(y, p["block_0"], s["block_0"], 1)
  y = _block(y, p["block_1"], s["block_1"], 2)
  want = y.mean(axis=(1, 2)) @ p["head"]["kernel"] + p["head"]["bias"]
  np.testing.assert_allclose(np.asarray(got), want, rtol=2e-4, atol=2e-4)
  assert y.shape == (2, 4, 4, 512)  # 128 x 4 after one stride.


@pytest.mark.slow
def test_imagenet_stem_and_unknown_stem():
  model = imagenet_resnet.Model(blocks=(1,), num_classes=3)
  x = jnp.zeros((1, 32, 32, 3))
  variables = model.init(jax.random.key(0), x, train=False)
  out, updates = model.apply(variables, x, train=True, mutable=["batch_stats"])
  assert out.shape == (1, 3) and "batch_stats" in updates
  with pytest.raises(ValueError, match="stem='vit'"):
    imagenet_resnet.Model(stem="vit").init(jax.random.key(0), x, train=False)
