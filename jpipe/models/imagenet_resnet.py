"""The ImageNet ResNets (He et al. 2016), 18 to 152 layers, as torchvision
and the Flax examples build them (v1.5: a bottleneck's stride on its 3x3).

PipeDream's and SD-Pipe's ResNet-50: a 7x7/2 stem, 3x3/2 max pool, four
groups of residual blocks (basic blocks for 18/34, bottlenecks with 4x
expansion for 50/101/152) at strides 1, 2, 2, 2, global average pooling
and a dense head; BatchNorm after every convolution (momentum 0.9,
epsilon 1e-5, as torchvision's 0.1 update), a 1x1 projection on a
shortcut that changes shape. ``stem="cifar"`` (a 3x3/1 convolution, no
pool) is DynPipe's variant for 32x32 images.

Input: float [B, H, W, C]; output: logits float32 [B, num_classes]. Batch
statistics live in the ``batch_stats`` collection. For the pipeline the
modules are the stem, every block and the head.
"""

import flax.linen as nn
import jax
import jax.numpy as jnp

# Blocks per group, and whether they are bottlenecks; ResNet-50 has
# 25,557,032 parameters with the 1000-class head (torchvision's count).
SIZES = {
  "18": dict(blocks=(2, 2, 2, 2), bottleneck=False),
  "34": dict(blocks=(3, 4, 6, 3), bottleneck=False),
  "50": dict(blocks=(3, 4, 6, 3), bottleneck=True),
  "101": dict(blocks=(3, 4, 23, 3), bottleneck=True),
  "152": dict(blocks=(3, 8, 36, 3), bottleneck=True),
}
STEMS = ("imagenet", "cifar")


def _norm(train: bool, name: str, zero: bool = False):
  return nn.BatchNorm(
    use_running_average=not train,
    momentum=0.9,
    epsilon=1e-5,
    scale_init=nn.initializers.zeros if zero else nn.initializers.ones,
    name=name,
  )


def _conv(features, size, strides=1, name=None):
  # He (fan-out) initialisation, as torchvision's kaiming_normal_.
  return nn.Conv(
    features,
    (size, size),
    (strides, strides),
    padding=[(size // 2, size // 2)] * 2,
    use_bias=False,
    kernel_init=nn.initializers.variance_scaling(2.0, "fan_out", "normal"),
    name=name,
  )


class Block(nn.Module):
  """A residual block: two 3x3 convolutions (basic) or 1x1, 3x3 (with
  the stride), 1x1 to 4x ``features`` (bottleneck), BatchNorm after each,
  ReLU after each but the last, the shortcut added before the last ReLU."""

  features: int
  strides: int
  bottleneck: bool
  zero_init_residual: bool

  @nn.compact
  def __call__(self, x, train: bool):
    out = self.features * (4 if self.bottleneck else 1)
    if self.bottleneck:
      widths = ((self.features, 1, 1), (self.features, 3, self.strides))
      last = (out, 1, 1)
    else:
      widths = ((self.features, 3, self.strides),)
      last = (out, 3, 1)
    y = x
    for i, (features, size, strides) in enumerate(widths):
      y = _conv(features, size, strides, f"conv_{i}")(y)
      y = nn.relu(_norm(train, f"bn_{i}")(y))
    i = len(widths)
    y = _conv(last[0], last[1], last[2], f"conv_{i}")(y)
    y = _norm(train, f"bn_{i}", self.zero_init_residual)(y)
    shortcut = x
    if x.shape[-1] != out or self.strides != 1:
      shortcut = _conv(out, 1, self.strides, "shortcut")(x)
      shortcut = _norm(train, "shortcut_bn")(shortcut)
    return nn.relu(y + shortcut)


class Stem(nn.Module):
  """7x7/2 convolution, BatchNorm, ReLU, 3x3/2 max pool ("imagenet"), or
  a 3x3/1 convolution, BatchNorm, ReLU ("cifar")."""

  kind: str

  @nn.compact
  def __call__(self, x, train: bool):
    if self.kind == "imagenet":
      x = nn.relu(_norm(train, "bn")(_conv(64, 7, 2, "conv")(x)))
      return nn.max_pool(x, (3, 3), (2, 2), padding=((1, 1), (1, 1)))
    return nn.relu(_norm(train, "bn")(_conv(64, 3, 1, "conv")(x)))


class Model(nn.Module):
  """An ImageNet ResNet; sizes by name in ``SIZES`` (``config.model.size
  =50``). ``zero_init_residual``: each block's last BatchNorm scale starts
  at 0 (Goyal et al.'s large-batch recipe; torchvision's option)."""

  blocks: tuple = (3, 4, 6, 3)
  bottleneck: bool = True
  num_classes: int = 1000
  stem: str = "imagenet"
  zero_init_residual: bool = False

  @nn.compact
  def __call__(self, x: jax.Array, train: bool = True) -> jax.Array:
    if self.stem not in STEMS:
      raise ValueError(f"stem={self.stem!r}: one of {STEMS}")
    x = Stem(self.stem, name="stem")(x, train)
    index = 0
    for group, count in enumerate(self.blocks):
      for i in range(count):
        x = Block(
          64 * 2**group,
          2 if i == 0 and group > 0 else 1,
          self.bottleneck,
          self.zero_init_residual,
          name=f"block_{index}",
        )(x, train)
        index += 1
    x = jnp.mean(x, axis=(1, 2))
    return nn.Dense(self.num_classes, dtype=jnp.float32, name="head")(x)
